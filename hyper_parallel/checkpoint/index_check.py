"""A checkpoint's index checked as untrusted input, before any tensor is read.

[Note: untrusted checkpoints]
A checkpoint may come from someone else, so its ``index.json`` is input to check, not to
trust. Before any shard file is opened, every rank checks the whole index: each field has
its type (strings, lists of non-negative integers, where ``True`` is not an integer),
each slice lies inside its tensor, and every file the index names is a plain name inside
the checkpoint directory: no path separator, no ``..``, not absolute, and, once symbolic
links are resolved, still inside the directory (a shard that is a link to elsewhere is
refused too). ``index.json`` itself must resolve inside the directory. A violation is a
``CheckpointError`` naming the entry; every rank reads the same index, so every rank
raises it, and the load's agreement makes sure no rank changes anything. The files hold
only JSON and safetensors: nothing is unpickled or executed. The tensors' bytes are
checked against their checksums as they are read (files.py).
"""

from __future__ import annotations

import math
import os
import re

from hyper_parallel.checkpoint.index import DTYPES, CheckpointError

CHECKSUM = re.compile(r"crc32:[0-9a-f]{8}")


def confined(directory: str, name: str, what: str) -> str:
    """The path of file ``name`` of checkpoint ``directory``, checked to be inside it after
    resolving ``..`` and symbolic links; ``what`` names the index entry for the error."""
    if not isinstance(name, str):
        raise CheckpointError(f"{what}: the file name must be a string, not "
                              f"{type(name).__name__} {name!r:.80}")
    if ("/" in name or "\\" in name or os.sep in name or name in ("", ".", "..")
            or "\0" in name or os.path.isabs(name)):
        raise CheckpointError(f"{what}: file {name!r:.200} is not a plain file name in the "
                              f"checkpoint directory (a checkpoint reads only its own files)")
    root = os.path.realpath(directory)
    real = os.path.realpath(os.path.join(root, name))
    if os.path.dirname(real) != root:
        raise CheckpointError(f"{what}: file {name!r} resolves to {real}, outside the "
                              f"checkpoint directory {root} (a symbolic link?); a checkpoint "
                              f"reads only its own files")
    return real


def check_index(directory: str, index_path: str, index: dict) -> None:
    """Every field of ``index`` that loading reads, and every file it names (the index
    file itself is checked with ``confined`` before it is opened)."""
    _expect(isinstance(index.get("tensors"), dict), index_path, "tensors",
            "an object {stored name: tensor}", index.get("tensors"))
    for key, entry in index["tensors"].items():
        _check_tensor(directory, index_path, key, entry)
    optimizer = index.get("optimizer")
    if optimizer is not None:
        _check_optimizer(index_path, optimizer)


def _check_tensor(directory: str, index_path: str, key: str, entry) -> None:
    where = f"tensors[{key!r}]"
    _expect(isinstance(entry, dict), index_path, where, "an object", entry)
    _expect(entry.get("dtype") in DTYPES, index_path, f"{where}.dtype",
            f"one of {', '.join(DTYPES)}", entry.get("dtype"))
    shape = entry.get("shape")
    _expect(_sizes(shape), index_path, f"{where}.shape", "a list of non-negative integers",
            shape)
    slices = entry.get("slices")
    _expect(isinstance(slices, list), index_path, f"{where}.slices", "a list", slices)
    for i, stored in enumerate(slices):
        at = f"{where}.slices[{i}]"
        _expect(isinstance(stored, dict), index_path, at, "an object", stored)
        confined(directory, stored.get("file"), f"{index_path}: {at}.file")
        _expect(isinstance(stored.get("key"), str), index_path, f"{at}.key", "a string",
                stored.get("key"))
        for field in ("offsets", "shape"):
            value = stored.get(field)
            _expect(_sizes(value) and len(value) == len(shape), index_path, f"{at}.{field}",
                    f"a list of {len(shape)} non-negative integers", value)
        if any(o + n > whole for o, n, whole in zip(stored["offsets"], stored["shape"], shape)):
            raise CheckpointError(f"{index_path}: {at} (offsets {stored['offsets']}, shape "
                                  f"{stored['shape']}) reaches outside the tensor's shape "
                                  f"{shape}")
        if "checksum" in stored:
            value = stored["checksum"]
            _expect(isinstance(value, str) and CHECKSUM.fullmatch(value) is not None,
                    index_path, f"{at}.checksum", "'crc32:' and 8 hex digits", value)
    if math.prod(shape) > 0 and not slices:
        raise CheckpointError(f"{index_path}: {where} has no slices")


def _check_optimizer(index_path: str, optimizer) -> None:
    _expect(isinstance(optimizer, dict), index_path, "optimizer", "an object or null",
            optimizer)
    _expect(isinstance(optimizer.get("type"), str), index_path, "optimizer.type",
            "a string", optimizer.get("type"))
    _expect(_numbers(optimizer.get("own")), index_path, "optimizer.own",
            "an object {name: number}", optimizer.get("own"))
    state = optimizer.get("state")
    _expect(isinstance(state, dict), index_path, "optimizer.state", "an object", state)
    for name, record in state.items():
        where = f"optimizer.state[{name!r}]"
        _expect(isinstance(record, dict), index_path, where, "an object", record)
        tensors = record.get("tensors")
        _expect(isinstance(tensors, list) and all(isinstance(t, str) for t in tensors),
                index_path, f"{where}.tensors", "a list of strings", tensors)
        _expect(_numbers(record.get("scalars")), index_path, f"{where}.scalars",
                "an object {name: number}", record.get("scalars"))


def _sizes(value) -> bool:
    """A list of non-negative integers (``True`` and ``1.0`` are not integers here)."""
    return isinstance(value, list) and all(
        type(v) is int and v >= 0 for v in value)  # noqa: E721 - bool is not a size


def _numbers(value) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, (int, float)) for k, v in value.items())


def _expect(ok: bool, index_path: str, where: str, expected: str, value) -> None:
    if not ok:
        raise CheckpointError(f"{index_path}: {where} must be {expected}, not "
                              f"{type(value).__name__} {value!r:.120}")
