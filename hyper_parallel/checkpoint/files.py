"""safetensors files through numpy: write a rank's tensors, read back slices of them.

Both frameworks read and write the same files because numpy is the interchange. numpy has
no bfloat16, so a bfloat16 tensor travels as float32 (the platforms convert exactly: every
bfloat16 value is a float32 whose low 16 bits are zero) and is stored as safetensors
``BF16``, its upper 16 bits. safetensors' numpy reader refuses ``BF16``, so those slices
are read straight from the file's bytes at the offsets its header gives (a JSON header,
like every safetensors reader parses); every other dtype is read with ``get_slice``.

[Note: checksums]
Saving records a CRC-32 of each tensor's bytes in the file (``"checksum": "crc32:<8 hex>"``
on its slice in the index), computed from the bytes it writes. Loading checks a stored
tensor's bytes the first time it reads any part of it (as read, when it reads the whole
tensor; otherwise from a memory map of the file), and a mismatch is a ``CheckpointError``
naming the file and the tensor, raised while reading, before anything changes. Per tensor
rather than per file: the error names the tensor, and a rank checks only the tensors it
reads from. A CRC because what it guards against is damage (a disk, a copy, a hand that
edited a file), not forgery: the index that holds the checksums is no more trustworthy
than the files, so a cryptographic hash would add nothing but time (zlib's CRC-32 runs
several times faster than hashlib's SHA-256 here), and zlib releases the GIL while it
runs, so an asynchronous save checksums in its writer thread without holding up training.
A slice without a checksum (a checkpoint written before they were recorded) is read
unchecked.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np
from safetensors import SafetensorError, safe_open, serialize_file

try:  # safetensors >= 0.8 takes specs of memory; older releases take the bytes
    from safetensors import TensorSpec
except ImportError:
    TensorSpec = None

from hyper_parallel.checkpoint.index import CheckpointError
from hyper_parallel.checkpoint.index_check import confined

_NUMPY = {"float32": np.float32, "float16": np.float16, "float64": np.float64,
          "int32": np.int32, "int64": np.int64}
_SAFETENSORS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
                "int32": "I32", "int64": "I64"}
_MAX_HEADER = 100 * 1024 * 1024  # what safetensors itself accepts


def checksum(data: np.ndarray) -> str:
    """The checksum of a C-contiguous array's bytes, as the index records it."""
    return f"crc32:{zlib.crc32(data.reshape(-1).view(np.uint8)):08x}"


def write_file(path: str, tensors: dict) -> dict:
    """``tensors``: ``{key: (dtype name, array)}``, bfloat16 ones as float32 arrays;
    returns ``{key: checksum of the bytes written}``."""
    specs, keep_alive, sums = {}, [], {}
    for key, (dtype, array) in tensors.items():
        if dtype == "bfloat16":
            data = np.asarray((array.astype(np.float32).view(np.uint32) >> 16)
                              .astype(np.uint16), order="C")
        else:
            data = np.asarray(array, dtype=_NUMPY[dtype], order="C")  # a copy only if needed
        keep_alive.append(data)
        sums[key] = checksum(data)
        if TensorSpec is None:
            specs[key] = {"dtype": _numpy_dtype_name(dtype), "shape": data.shape,
                          "data": data.tobytes()}
        else:
            specs[key] = TensorSpec(dtype=_numpy_dtype_name(dtype), shape=data.shape,
                                    data_ptr=data.ctypes.data, data_len=data.nbytes)
    serialize_file(specs, path, metadata=None)
    with open(path, "rb+") as file:
        os.fsync(file.fileno())
    return sums


def _numpy_dtype_name(dtype: str) -> str:
    return "bfloat16" if dtype == "bfloat16" else np.dtype(_NUMPY[dtype]).name


class SliceReader:
    """Reads slices of a checkpoint's files, opening each file once; with ``verify``, checks
    each stored tensor's checksum the first time it reads from it."""

    def __init__(self, directory: str, verify: bool = True):
        self.directory, self.verify = directory, verify
        self._open, self._bytes, self._verified = {}, {}, set()

    def read(self, stored: dict, dtype: str, region: tuple) -> np.ndarray:
        """``region`` (slices) of the stored slice ``stored`` (an index entry's slice), as
        numpy (float32 for bfloat16)."""
        file, key = stored["file"], stored["key"]
        path = confined(self.directory, file, f"the slice of {key!r} in {file!r}")
        handle = self._handle(path)
        if key not in handle.keys():
            raise CheckpointError(f"{path} has no tensor {key!r}, which the index puts there")
        view = handle.get_slice(key)
        if view.get_dtype() != _SAFETENSORS[dtype] or list(view.get_shape()) != stored["shape"]:
            raise CheckpointError(
                f"{path}: tensor {key!r} is {view.get_dtype()} {list(view.get_shape())}, "
                f"the index says {_SAFETENSORS[dtype]} {stored['shape']}")
        check = self.verify and "checksum" in stored and (path, key) not in self._verified
        # a region that is the whole stored slice (saved and loaded in the same layout) is
        # hashed as read; a part of it, from the file's bytes first
        whole = all(part.start == 0 and part.stop == n
                    for part, n in zip(region, stored["shape"]))
        if check and not whole:
            self._check(path, key, stored, lambda: self._tensor_bytes(path, key))
        try:
            if dtype == "bfloat16":
                bits = self._tensor_bytes(path, key).view("<u2").reshape(stored["shape"])[region]
                read = np.asarray(bits)
            else:
                read = np.asarray(view[region] if region else view[()])  # () reads 0-dim
        except (SafetensorError, OSError, ValueError) as error:
            raise CheckpointError(f"{path}: cannot read tensor {key!r}: {error}") from None
        if check and whole:
            self._check(path, key, stored, lambda: np.ascontiguousarray(read).reshape(-1))
        if dtype == "bfloat16":
            flat = np.asarray(read, np.uint32).reshape(-1)  # 1-d: numpy keeps uint32
            return (flat << 16).view(np.float32).reshape(np.shape(read))
        return read

    def _check(self, path: str, key: str, stored: dict, data) -> None:
        """Tensor ``key``'s bytes (``data()``: the whole tensor as a 1-d array) against
        the index's checksum."""
        try:
            found = checksum(data())
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{path}: cannot read the bytes of tensor {key!r}: "
                                  f"{type(error).__name__} {error}") from None
        if found != stored["checksum"]:
            raise CheckpointError(
                f"{path}: the bytes of tensor {key!r} (the slice at offsets "
                f"{stored['offsets']}, shape {stored['shape']}) do not match their checksum "
                f"in the index: the file was changed or damaged after it was saved")
        self._verified.add((path, key))

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

    def _tensor_bytes(self, path: str, key: str) -> np.ndarray:
        """A read-only memory map of tensor ``key``'s bytes in file ``path`` (uint8; pages
        are read only where it is read)."""
        if path not in self._bytes:
            with open(path, "rb") as file:
                (length,) = struct.unpack("<Q", file.read(8))
                if length > _MAX_HEADER:
                    raise CheckpointError(f"{path}: header of {length} bytes")
                header = json.loads(file.read(length))
            data = np.memmap(path, dtype=np.uint8, mode="r")[8 + length:]
            self._bytes[path] = (header, data)
        header, data = self._bytes[path]
        start, end = header[key]["data_offsets"]
        if not 0 <= start <= end <= data.size:
            raise CheckpointError(f"{path}: tensor {key!r} lies outside the file")
        return data[start:end]
