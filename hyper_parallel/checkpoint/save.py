"""``save_checkpoint``: every rank writes what it owns, in parallel; rank 0 publishes it.

[Note: atomic publish]
Ranks write into ``<path>.saving`` (rank 0 clears a stale one first): a safetensors file of
the tensors the rank writes (layout.py) and a partial index. Once every rank reports
(an all-reduce of failure flags, which doubles as the barrier), rank 0 merges the
partial indexes into ``index.json`` and swaps directories: ``path`` -> ``path.old``,
``path.saving`` -> ``path``, then removes ``path.old``. A rank that fails or dies before the
swap leaves the previous checkpoint at ``path`` as it was; a failure reported by any rank
makes every rank raise. The directory must be one filesystem every rank sees.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Any

import numpy as np

from hyper_parallel.checkpoint import files
from hyper_parallel.checkpoint.index import (
    INDEX_FILE, CheckpointError, add_slice, merge, moment_key, new_partial, rank_file,
    write_json,
)
from hyper_parallel.checkpoint.layout import dtype_name, held_params, to_array
from hyper_parallel.checkpoint.optimizers import optimizer_type, read_state
from hyper_parallel.platform import get_platform

if TYPE_CHECKING:
    from hyper_parallel.platform import Platform


def save_checkpoint(path: str, model: Any, optimizer: Any = None, extra: Any = None,
                    key_map: Any = None) -> None:
    """Write ``model``'s parameters and buffers (and ``optimizer``'s state, and
    JSON-serialisable ``extra``) to directory ``path``, replacing what is there only
    once every rank has written its part. ``key_map``: the stored name of each model name
    (names.py). Every rank calls it, between steps."""
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as error:
        raise TypeError(f"save_checkpoint(extra=...) must be JSON-serialisable: {error}") from None
    platform = get_platform()
    held = held_params(platform, model, key_map)
    # state an optimizer keeps that a checkpoint cannot store is an error before any write
    state = None if optimizer is None else read_state(platform, optimizer, held)
    path = os.path.abspath(path)
    staging, rank = path + ".saving", platform.rank()
    failure = _attempt(lambda: _make_staging(staging)) if rank == 0 else None
    failed = agree_on_failure(platform, failure is not None)
    if not failed:
        failure = _attempt(lambda: write_json(os.path.join(staging, rank_file(rank, ".json")),
                                              _write_own(platform, staging, rank, held, optimizer,
                                                         state)))
        failed = agree_on_failure(platform, failure is not None)
    if not failed:
        if rank == 0:
            failure = _attempt(lambda: _publish(platform, path, staging, extra))
        failed = agree_on_failure(platform, failure is not None)
    if failed:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if failure is not None:
            raise failure
        raise CheckpointError(f"saving {path} failed on {failed} other rank(s); the previous "
                              f"checkpoint there is unchanged")


def _attempt(step) -> Exception | None:
    """Run ``step``; its exception, to be reported to every rank before it is raised."""
    try:
        step()
    except Exception as error:  # noqa: BLE001 - every rank must hear of any failure
        return error
    return None


def _make_staging(staging: str) -> None:
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)


def agree_on_failure(platform: Platform, failed: bool) -> int:
    """How many ranks report a failure (an all-reduce: also a barrier)."""
    if platform.world_size() == 1 or not platform.is_initialized():
        return int(failed)
    flag = platform.from_numpy(np.array([1.0 if failed else 0.0], np.float32))
    platform.all_reduce(flag, None, "sum").wait()
    return int(round(float(platform.to_numpy(flag)[0])))


def _write_own(platform: Platform, staging: str, rank: int, held: list, optimizer: Any,
               state: tuple | None) -> dict:
    """Write this rank's file; return its partial index. ``state``: ``read_state``'s."""
    entries = []  # (stored name, Held, dtype name, this rank's region as numpy)
    partial = new_partial(None if optimizer is None else optimizer_type(optimizer))
    per_param = {}
    if state is not None:
        per_param, partial["optimizer"]["own"] = state
    with platform.no_grad():
        for h in held:
            if not h.writes:
                continue
            entries.append((h.key, h, h.dtype, to_array(platform, h, h.local(platform))))
            if id(h.param) not in per_param:
                continue
            tensors, numbers = per_param[id(h.param)]
            partial["optimizer"]["state"][h.key] = {"tensors": sorted(tensors),
                                                    "scalars": numbers}
            for name, tensor in sorted(tensors.items()):
                entries.append((moment_key(name, h.key), h,
                                dtype_name(platform, platform.dtype_of(tensor)),
                                to_array(platform, h, tensor)))
    file = rank_file(rank, ".safetensors")
    for key, h, dtype, array in entries:
        add_slice(partial, key, dtype, h.shape, file, h.offsets, array.shape)
    if entries:
        files.write_file(os.path.join(staging, file),
                         {key: (dtype, array) for key, _, dtype, array in entries})
    return partial


def _publish(platform: Platform, path: str, staging: str, extra) -> None:
    """Rank 0, once every rank wrote: the index, then the directory swap."""
    partial_files = sorted(f for f in os.listdir(staging) if f.endswith(".json"))
    partials = []
    for name in partial_files:
        with open(os.path.join(staging, name), encoding="utf-8") as file:
            partials.append(json.load(file))
    write_json(os.path.join(staging, INDEX_FILE),
               merge(partials, platform.name, platform.world_size(), extra))
    for name in partial_files:
        os.remove(os.path.join(staging, name))
    old = path + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(staging, path)
    shutil.rmtree(old, ignore_errors=True)
