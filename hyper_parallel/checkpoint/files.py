"""safetensors files through numpy: write a rank's tensors, read back slices of them.

Both frameworks read and write the same files because numpy is the interchange. numpy has
no bfloat16, so a bfloat16 tensor travels as float32 (the platforms convert exactly: every
bfloat16 value is a float32 whose low 16 bits are zero) and is stored as safetensors
``BF16``, its upper 16 bits. safetensors' numpy reader refuses ``BF16``, so those slices
are read straight from the file's bytes at the offsets its header gives (a JSON header,
like every safetensors reader parses); every other dtype is read with ``get_slice``.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
from safetensors import SafetensorError, safe_open, serialize_file

try:  # safetensors >= 0.8 takes specs of memory; older releases take the bytes
    from safetensors import TensorSpec
except ImportError:
    TensorSpec = None

from hyper_parallel.checkpoint.index import CheckpointError

_NUMPY = {"float32": np.float32, "float16": np.float16, "float64": np.float64,
          "int32": np.int32, "int64": np.int64}
_SAFETENSORS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
                "int32": "I32", "int64": "I64"}
_MAX_HEADER = 100 * 1024 * 1024  # what safetensors itself accepts


def write_file(path: str, tensors: dict) -> None:
    """``tensors``: ``{key: (dtype name, array)}``, bfloat16 ones as float32 arrays."""
    specs, keep_alive = {}, []
    for key, (dtype, array) in tensors.items():
        if dtype == "bfloat16":
            data = np.asarray((array.astype(np.float32).view(np.uint32) >> 16)
                              .astype(np.uint16), order="C")
        else:
            data = np.asarray(array, dtype=_NUMPY[dtype], order="C")  # a copy only if needed
        keep_alive.append(data)
        if TensorSpec is None:
            specs[key] = {"dtype": _numpy_dtype_name(dtype), "shape": data.shape,
                          "data": data.tobytes()}
        else:
            specs[key] = TensorSpec(dtype=_numpy_dtype_name(dtype), shape=data.shape,
                                    data_ptr=data.ctypes.data, data_len=data.nbytes)
    serialize_file(specs, path, metadata=None)
    with open(path, "rb+") as file:
        os.fsync(file.fileno())


def _numpy_dtype_name(dtype: str) -> str:
    return "bfloat16" if dtype == "bfloat16" else np.dtype(_NUMPY[dtype]).name


class SliceReader:
    """Reads slices of a checkpoint's files, opening each file once."""

    def __init__(self, directory: str):
        self.directory = directory
        self._open = {}

    def read(self, stored: dict, dtype: str, region: tuple) -> np.ndarray:
        """``region`` (slices) of the stored slice ``stored`` (an index entry's slice), as
        numpy (float32 for bfloat16)."""
        file, key = stored["file"], stored["key"]
        path = os.path.join(self.directory, file)
        handle = self._handle(path)
        if key not in handle.keys():
            raise CheckpointError(f"{path} has no tensor {key!r}, which the index puts there")
        view = handle.get_slice(key)
        if view.get_dtype() != _SAFETENSORS[dtype] or list(view.get_shape()) != stored["shape"]:
            raise CheckpointError(
                f"{path}: tensor {key!r} is {view.get_dtype()} {list(view.get_shape())}, "
                f"the index says {_SAFETENSORS[dtype]} {stored['shape']}")
        try:
            if dtype == "bfloat16":
                bits = _raw_view(path, key, stored["shape"])[region]
                flat = np.asarray(bits, np.uint32).reshape(-1)  # 1-d: numpy keeps uint32
                return (flat << 16).view(np.float32).reshape(np.shape(bits))
            return np.asarray(view[region] if region else view[()])  # () reads a 0-dim tensor
        except (SafetensorError, OSError, ValueError) as error:
            raise CheckpointError(f"{path}: cannot read tensor {key!r}: {error}") from None

    def _handle(self, path: str):
        if path not in self._open:
            if not os.path.isfile(path):
                raise CheckpointError(f"{path} is missing (the index lists it)")
            try:
                self._open[path] = safe_open(path, framework="numpy")
            except (SafetensorError, OSError) as error:
                raise CheckpointError(f"{path} is not a readable safetensors file "
                                      f"(truncated or corrupt?): {error}") from None
        return self._open[path]


def _raw_view(path: str, key: str, shape: list) -> np.ndarray:
    """A read-only memory map of a ``BF16`` tensor's bytes as uint16 (pages are read only
    where a slice of it is taken)."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        if length > _MAX_HEADER:
            raise CheckpointError(f"{path}: header of {length} bytes")
        header = json.loads(file.read(length))
    start, end = header[key]["data_offsets"]
    if end - start != 2 * int(np.prod(shape)):
        raise CheckpointError(f"{path}: tensor {key!r} holds {end - start} bytes, not a "
                              f"BF16 tensor of shape {shape}")
    if 0 in shape:
        return np.zeros(shape, np.uint16)
    return np.memmap(path, dtype=np.uint16, mode="r", offset=8 + length + start,
                     shape=(int(np.prod(shape)),)).reshape(shape)
