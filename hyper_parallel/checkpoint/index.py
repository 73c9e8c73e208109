"""The checkpoint's JSON index: names, global shapes, dtypes and which file holds which slice.

[Note: checkpoint layout]
A checkpoint is a directory: one safetensors file per rank that owned something
(``rank-00003.safetensors``) and ``index.json``. Each stored tensor is a model parameter
under its own qualified name (``layers.0.up.weight``), or an optimizer moment of one
(``optim.exp_avg.layers.0.up.weight``). Its index entry gives the global shape and dtype
and a list of slices: the file, the key in that file, the slice's offset in every dim and
its shape. The slices of a tensor tile it exactly (checked when the index is merged), so
a reader takes the slices that overlap the region it needs and nothing else.
``optimizer`` is the optimizer's class (``type``), per parameter the names of its state
tensors and its numbers (``state``), and the optimizer's own numbers (``own``)
(optimizers.py); ``extra`` is the caller's JSON data. Everything a loader reads is JSON or
safetensors: nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import os

FORMAT = "hyper_parallel.checkpoint"
VERSION = 2
INDEX_FILE = "index.json"
# the dtypes a checkpoint stores, by the names the platforms use
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked; nothing was changed."""


def moment_key(state: str, name: str) -> str:
    """The stored name of parameter ``name``'s optimizer state tensor ``state``."""
    return f"optim.{state}.{name}"


def rank_file(rank: int, suffix: str) -> str:
    return f"rank-{rank:05d}{suffix}"


def add_slice(partial: dict, key: str, dtype: str, shape: tuple, file: str,
              offsets: tuple, slice_shape: tuple) -> None:
    """Record in a rank's partial index that ``file`` holds ``key``'s slice at ``offsets``."""
    entry = partial["tensors"].setdefault(key, {"dtype": dtype, "shape": list(shape), "slices": []})
    entry["slices"].append({"file": file, "key": key, "offsets": list(offsets),
                            "shape": list(slice_shape)})


def new_partial(optimizer_type: str | None) -> dict:
    """A rank's part of the index; ``optimizer_type`` None: saved without an optimizer."""
    return {"tensors": {}, "optimizer": None if optimizer_type is None else
            {"type": optimizer_type, "state": {}, "own": {}}}


def merge(partials: list, framework: str, world_size: int, extra) -> dict:
    """Every rank's partial index as one; checks that each tensor's slices tile it."""
    tensors, optimizer = {}, None
    for partial in partials:
        for key, entry in partial["tensors"].items():
            merged = tensors.setdefault(key, {"dtype": entry["dtype"], "shape": entry["shape"],
                                              "slices": []})
            if (merged["dtype"], merged["shape"]) != (entry["dtype"], entry["shape"]):
                raise CheckpointError(f"ranks disagree on tensor {key!r}: {merged['dtype']} "
                                      f"{merged['shape']} vs {entry['dtype']} {entry['shape']}")
            merged["slices"].extend(entry["slices"])
        part = partial["optimizer"]
        if part is None:
            continue
        if optimizer is None:
            optimizer = {"type": part["type"], "state": {}, "own": dict(part["own"])}
        if (optimizer["type"], optimizer["own"]) != (part["type"], part["own"]):
            raise CheckpointError(f"ranks disagree on the optimizer: {optimizer['type']} "
                                  f"{optimizer['own']} vs {part['type']} {part['own']}")
        for name, state in part["state"].items():
            if optimizer["state"].setdefault(name, state) != state:
                raise CheckpointError(f"ranks disagree on the optimizer state of {name!r}")
    for key, entry in tensors.items():
        covered = sum(math.prod(s["shape"]) for s in entry["slices"])
        if covered != math.prod(entry["shape"]):
            raise CheckpointError(f"the slices of {key!r} cover {covered} of "
                                  f"{math.prod(entry['shape'])} elements")
    if optimizer is not None:
        optimizer["state"] = dict(sorted(optimizer["state"].items()))
    return {"format": FORMAT, "version": VERSION, "framework": framework,
            "world_size": world_size, "tensors": dict(sorted(tensors.items())),
            "optimizer": optimizer, "extra": extra}


def write_json(path: str, data) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(data, file, indent=1)
        file.flush()
        os.fsync(file.fileno())


def read_index(path: str) -> dict:
    """The index of checkpoint directory ``path``, checked to be one of ours."""
    index_path = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(index_path):
        hint = ""
        if os.path.isdir(path + ".old"):
            hint = (f"; a save was interrupted between its two renames: the previous "
                    f"checkpoint is {path + '.old'}")
        raise CheckpointError(f"{index_path} does not exist: {path} is not a hyper_parallel "
                              f"checkpoint{hint}")
    try:
        with open(index_path, encoding="utf-8") as file:
            index = json.load(file)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{index_path} is not readable JSON: {error}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{index_path} is not a hyper_parallel checkpoint index "
                              f"(no \"format\": {FORMAT!r})")
    if index.get("version") != VERSION:
        raise CheckpointError(f"{index_path} has format version {index.get('version')!r}; "
                              f"this hyper_parallel reads version {VERSION}")
    return index


def overlaps(entry: dict, offsets: tuple, shape: tuple) -> list:
    """``(slice, source region, destination region)`` for every stored slice of ``entry``
    that overlaps the region at ``offsets`` of ``shape``; regions are tuples of ``slice``
    objects into the stored slice and into the region."""
    found = []
    for stored in entry["slices"]:
        lo = [max(o, so) for o, so in zip(offsets, stored["offsets"])]
        hi = [min(o + n, so + sn) for o, n, so, sn in
              zip(offsets, shape, stored["offsets"], stored["shape"])]
        if all(a < b for a, b in zip(lo, hi)):
            source = tuple(slice(a - so, b - so) for a, b, so in zip(lo, hi, stored["offsets"]))
            target = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
            found.append((stored, source, target))
    return found
