"""``export_full``: a sharded model as a Hugging Face-layout directory of full tensors.

[Note: streamed export]
The layout is planned before any data moves: every parameter's name, global shape and dtype
are known on every rank, so the files, each safetensors header and each tensor's byte
offsets are fixed up front. Then parameters are gathered one at a time (an all-gather over
their shard group, and a tensor-parallel one's over its tensor-parallel ranks; every rank
takes part) and rank 0 appends each one's bytes to its file
as it arrives: no rank holds more than one full parameter. A file is written as
``<name>.tmp`` and renamed when complete.

[Note: what an export may replace]
An export replaces only an earlier export of its own: its weight files and index carry an
``exported_by`` marker in their metadata, and those are removed first (a new export may
have fewer files). A ``model*.safetensors`` or index without it (the original weights of a
model being fine-tuned, say) is the user's and refused, as is a ``config.json`` that
differs from ``config`` in a directory holding no export of ours; other files (a
tokenizer) are left alone.

Names are the model's own qualified names, or what ``key_map`` makes of them
(names.py: a name mapped to None is not written; one mapped to a ``SplitKey``,
split_names.py, is written as several tensors, such as grouped experts under a Hugging
Face family's per-expert names). A parameter reachable under two names (tied
weights, ``lm_head.weight`` is ``model.embed_tokens.weight``) is written once, under its
first name in module order, which is what Hugging Face expects with
``tie_word_embeddings``; so a ``config`` that does not say so is refused for a tied model.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from hyper_parallel.checkpoint.arguments import check_model, check_path
from hyper_parallel.checkpoint.index import CheckpointError
from hyper_parallel.checkpoint.layout import held_params
from hyper_parallel.checkpoint.names import resolve
from hyper_parallel.checkpoint.save import agree_on_failure
from hyper_parallel.checkpoint.split_names import SplitKey
from hyper_parallel.checkpoint.full_state import _full_value
from hyper_parallel.platform import get_platform
from hyper_parallel.checkpoint.state_dict import state_entries, to_numpy

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
          "int32": "I32", "int64": "I64"}
#: in each file's ``__metadata__`` and the index's ``metadata``: what this export may replace
EXPORTED_BY = {"exported_by": "hyper_parallel"}
_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8}


def export_full(path: str, model: Any, config: dict | None = None,
                max_shard_bytes: int = 5 * 1024 ** 3, key_map: Any = None) -> None:
    """Write ``model``'s full parameters to directory ``path`` as ``model.safetensors`` (or
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` once over
    ``max_shard_bytes``), and ``config`` (a dict) as ``config.json``. ``key_map``: the
    written name of each model name (names.py). Every rank calls it; rank 0
    writes."""
    path = check_path("export_full", path)
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"export_full(config=...) takes a dict (written as config.json), "
                        f"not {type(config).__name__}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) \
            or max_shard_bytes <= 0:
        raise ValueError(f"export_full(max_shard_bytes={max_shard_bytes!r}): give a positive "
                         f"number of bytes")
    platform = get_platform()
    check_model(platform, "export_full", model)
    held = {h.name: h for h in held_params(platform, model, buffers=False)}  # each once
    keys = resolve(key_map, list(held), splits=True)
    # a tensor-parallel parameter (the core's, or a torch DTensor a unit manages:
    # held_params) is gathered over its tensor-parallel ranks too
    every = state_entries(model, tensor_parallel_parts=True)
    entries = [e for e in every if e.key in keys]
    tied = [e.key for e in every if e.key not in held]
    if tied and config is not None and config.get("tie_word_embeddings") is not True:
        raise ValueError(f"the model ties {', '.join(tied)} to another parameter, which is "
                         f"written once; set config['tie_word_embeddings'] = True so Hugging "
                         f"Face ties them back on load")
    written = {e.key: _written(keys[e.key], held[e.key].shape, e.key) for e in entries}
    specs = [(key, held[e.key].dtype, shape) for e in entries for key, shape in written[e.key]]
    plan = _plan(specs, max_shard_bytes)
    writing = platform.rank() == 0
    failure = None
    if writing:
        failure = _attempt(lambda: _prepare(path, config))
    writers = {}
    with platform.no_grad():
        for entry in entries:
            array = to_numpy(platform, _full_value(platform, entry))
            if not writing or failure is not None:
                continue
            stored, dtype = keys[entry.key], held[entry.key].dtype
            pieces = stored.pieces(array) if isinstance(stored, SplitKey) else [(stored, array)]
            for key, piece in pieces:
                failure = failure or _attempt(
                    lambda: _append(writers, path, plan, key, dtype, piece))
    if writing and failure is None:
        failure = _attempt(lambda: _finish(writers, path, plan))
    for name, handle in writers.items():  # left open only by a failure
        handle.close()
        os.remove(os.path.join(path, name + ".tmp"))
    failed = agree_on_failure(platform, failure is not None)
    if failure is not None:
        raise failure
    if failed:
        raise OSError(f"exporting to {path} failed on rank 0")


def _written(stored: Any, shape: tuple, name: str) -> list:
    """``[(written name, shape)]`` of one model value (several under a ``SplitKey``)."""
    return stored.leaves(shape, name) if isinstance(stored, SplitKey) else [(stored, tuple(shape))]


def _plan(specs: list, max_shard_bytes: int) -> list:
    """Files in order: ``(file name, header bytes, {key: (start, end)})``."""
    groups, size = [[]], 0
    for key, dtype, shape in specs:
        nbytes = _SIZES[dtype] * int(np.prod(shape, dtype=np.int64))
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((key, dtype, shape, nbytes))
        size += nbytes
    plan = []
    for i, group in enumerate(groups):
        name = SINGLE_FILE if len(groups) == 1 else \
            f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header, offsets, start = {"__metadata__": {"format": "pt", **EXPORTED_BY}}, {}, 0
        for key, dtype, shape, nbytes in group:
            header[key] = {"dtype": _CODES[dtype], "shape": list(shape),
                           "data_offsets": [start, start + nbytes]}
            offsets[key] = (start, start + nbytes)
            start += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
        plan.append((name, raw, offsets))
    return plan


def _attempt(step) -> Exception | None:
    try:
        step()
    except Exception as error:  # noqa: BLE001 - rank 0 keeps gathering so no rank hangs
        return error
    return None


def _prepare(path: str, config: dict | None) -> None:
    """Make ``path`` ready: earlier exports of ours removed, anything else of the user's
    refused before a byte is removed or written ([Note: what an export may replace])."""
    os.makedirs(path, exist_ok=True)
    weights = sorted(name for name in os.listdir(path) if name == INDEX_FILE
                     or (name.startswith("model") and name.endswith(".safetensors")))
    foreign = [name for name in weights if not _exported_by_us(os.path.join(path, name))]
    if foreign:
        raise CheckpointError(f"export_full: {path} holds weights hyper_parallel did not export "
                              f"({', '.join(foreign)}), which the export would replace; export "
                              f"into another (new or empty) directory, or move them away first")
    config_file = os.path.join(path, "config.json")
    if config is not None and not weights and os.path.exists(config_file) \
            and not _holds_json(config_file, config):
        raise CheckpointError(f"export_full: {config_file} exists and differs from the config "
                              f"given; export into another directory, or move it away first")
    for name in weights:
        os.remove(os.path.join(path, name))
    if config is not None:
        _write_json(os.path.join(path, "config.json"), config)


def _append(writers: dict, path: str, plan: list, key: str, dtype: str,
            array: np.ndarray) -> None:
    name = next(n for n, _, offsets in plan if key in offsets)
    _open(writers, path, plan, name)
    if dtype == "bfloat16":  # travels as float32; bfloat16 is its upper 16 bits
        data = (np.ascontiguousarray(array, np.float32).view(np.uint32) >> 16).astype("<u2")
    else:
        data = np.ascontiguousarray(array).astype(np.dtype(dtype).newbyteorder("<"))
    writers[name].write(data.tobytes())


def _open(writers: dict, path: str, plan: list, name: str):
    """The file ``name`` being written, opened with its header on first use."""
    if name not in writers:
        raw = next(r for n, r, _ in plan if n == name)
        handle = open(os.path.join(path, name + ".tmp"), "wb")
        handle.write(len(raw).to_bytes(8, "little") + raw)
        writers[name] = handle
    return writers[name]


def _finish(writers: dict, path: str, plan: list) -> None:
    """Close and publish each file; the index when there are several."""
    for name, _, _ in plan:
        handle = _open(writers, path, plan, name)
        del writers[name]
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        os.replace(os.path.join(path, name + ".tmp"), os.path.join(path, name))
    if len(plan) > 1:
        total = sum(end - start for _, _, offsets in plan for start, end in offsets.values())
        _write_json(os.path.join(path, INDEX_FILE),
                    {"metadata": {"total_size": total, **EXPORTED_BY},
                     "weight_map": {key: name for name, _, offsets in plan for key in offsets}})


def _exported_by_us(file: str) -> bool:
    """Whether a weight file or index carries this module's ``exported_by`` marker."""
    try:
        if file.endswith(".json"):
            metadata = _read_json(file).get("metadata")
        else:
            with open(file, "rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                metadata = json.loads(handle.read(min(size, 1 << 24))).get("__metadata__")
    except (OSError, ValueError, AttributeError):  # unreadable, or not our layout
        return False
    return isinstance(metadata, dict) and all(metadata.get(k) == v for k, v in EXPORTED_BY.items())


def _holds_json(file: str, value: dict) -> bool:
    try:
        return _read_json(file) == value
    except (OSError, ValueError):
        return False


def _read_json(file: str):
    with open(file, encoding="utf-8") as handle:
        return json.load(handle)


def _write_json(file: str, value: dict) -> None:
    with open(file + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(value, handle, indent=2, sort_keys=True)
    os.replace(file + ".tmp", file)
