"""``load_checkpoint``: each rank reads only the slices of its own regions, at any world size.

Loading is two phases so that a bad checkpoint changes nothing: every rank first reads and
checks everything it needs (names, shapes, files, tensors, optimizer steps) into numpy,
then all ranks agree (one all-reduce of failure flags), and only if none failed does any
rank write its parameters and optimizer state. The index is checked as untrusted input
before any shard file is opened (index_check.py), and each stored tensor's bytes against
their checksum as they are read (files.py). Regions follow this run's layout
(layout.py), whatever world size and mesh wrote the checkpoint: a region is assembled
from every stored slice that overlaps it (index.py, ``overlaps``).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from hyper_parallel.checkpoint.arguments import check_bool, check_path
from hyper_parallel.checkpoint.files import SliceReader
from hyper_parallel.checkpoint.index import INDEX_FILE, CheckpointError, overlaps, read_index
from hyper_parallel.checkpoint.index_check import check_index, confined
from hyper_parallel.checkpoint.layout import from_array
from hyper_parallel.checkpoint.optimizers import read_for_load
from hyper_parallel.checkpoint.save import agree_on_failure, finish_pending_saves
from hyper_parallel.checkpoint.stages import (
    check_covered, held_groups, model_parts, pp_rank_of,
)
from hyper_parallel.platform import get_platform

if TYPE_CHECKING:
    from hyper_parallel.checkpoint.layout import Held
    from hyper_parallel.platform import Platform


def load_checkpoint(path: str, model: Any, optimizer: Any = None, key_map: Any = None,
                    verify: bool = True, pp_mesh: Any = None) -> Any:
    """Load the checkpoint at directory ``path`` into ``model`` (and ``optimizer``, which
    must update the same parameters); return its ``extra``. Every rank
    calls it. ``key_map``: the stored name of each model name (names.py). ``verify``: check
    each tensor read against its checksum. On any error no rank changes anything. A
    pipelined run passes this rank's model parts (a module or a list), their optimizer
    (one, or a list with one per part) and ``pp_mesh``: each rank loads its own values,
    and the ranks together every value of the checkpoint (stages.py)."""
    path = check_path("load_checkpoint", path)
    check_bool("load_checkpoint", "verify", verify)
    platform = get_platform()
    pp_rank_of(pp_mesh)
    parts = model_parts(platform, "load_checkpoint", model, optimizer)
    finish_pending_saves()
    failure, plan = None, None
    try:
        plan = _read_everything(platform, path, held_groups(platform, parts, key_map), verify,
                                pp_mesh is not None)
    except (CheckpointError, TypeError) as error:
        failure = error
    except (KeyError, ValueError, IndexError) as error:  # an index of the wrong structure
        failure = CheckpointError(f"{os.path.join(path, INDEX_FILE)} is malformed: "
                                  f"{type(error).__name__} {error}")
    failed = agree_on_failure(platform, failure is not None)
    if failure is not None:
        raise failure
    if failed:
        raise CheckpointError(f"loading {path} failed on {failed} other rank(s); nothing was "
                              f"loaded on any rank")
    index, values, states, stored, loaded = plan
    if pp_mesh is not None:
        check_covered(platform, path, stored, loaded)
    with platform.no_grad():
        for h, array in values:
            local = h.local(platform)
            platform.copy_into(local, from_array(platform, h, array, local))
        for opt, writes, own in states:
            for h, state in writes:
                like = h.local(platform)
                platform.set_optimizer_state(opt, h.param, {
                    name: from_array(platform, h, value, like)
                    if isinstance(value, np.ndarray) else value
                    for name, value in state.items()})
            if own:
                platform.set_optimizer_state(opt, None, own)
    return index.get("extra")


def _read_everything(platform: Platform, path: str, groups: list, verify: bool,
                     stage: bool) -> tuple:
    """``(index, [(Held, region)], [(optimizer, writes, own)], the index's sorted model
    names, this rank's)``; ``stage``: the model is a pipeline stage's parts, which hold
    some of the checkpoint's names."""
    held = [h for part, _ in groups for h in part]
    confined(path, INDEX_FILE, os.path.join(path, INDEX_FILE))
    index = read_index(path)
    check_index(path, os.path.join(path, INDEX_FILE), index)
    tensors = index["tensors"]
    names = {h.key for h in held}
    model_keys = {key for key in tensors if not key.startswith("optim.")}
    missing, unknown = sorted(names - model_keys), sorted(model_keys - names)
    if missing or (unknown and not stage):
        raise CheckpointError(
            f"{os.path.join(path, INDEX_FILE)} holds a different model: "
            + "; ".join(part for part in (
                f"missing {', '.join(missing[:5])}" if missing else "",
                f"not in this model {', '.join(unknown[:5])}" if unknown else "") if part)
            + ("" if missing else " (a pipeline stage's parts: pass pp_mesh=mesh['pp'])"))
    reader = SliceReader(path, verify)
    values = [(h, _read_region(reader, path, h.key, tensors[h.key], h)) for h in held]
    states = [(opt, *read_for_load(platform, path, index, part, opt,
                                   lambda key, entry, h: _read_region(reader, path, key,
                                                                      entry, h)))
              for part, opt in groups if opt is not None]
    return index, values, states, sorted(model_keys), names


def _read_region(reader: SliceReader, path: str, key: str, entry: dict, h: Held) -> np.ndarray:
    """This rank's region of stored tensor ``key``, from every slice that overlaps it."""
    if tuple(entry["shape"]) != h.shape:
        raise CheckpointError(f"{os.path.join(path, INDEX_FILE)}: tensor {key!r} has shape "
                              f"{tuple(entry['shape'])}, the model's {h.name!r} has {h.shape}")
    shape = h.region_shape
    out = np.zeros(shape, np.float32 if entry["dtype"] == "bfloat16" else entry["dtype"])
    written = np.zeros(shape, bool)  # every element from exactly one slice
    index_path = os.path.join(path, INDEX_FILE)
    for stored, source, target in overlaps(entry, h.offsets, shape):
        if written[target].any():
            raise CheckpointError(f"{index_path}: the slices of {key!r} overlap: the one in "
                                  f"{stored['file']} at offsets {stored['offsets']} holds "
                                  f"elements another slice holds")
        out[target] = reader.read(stored, entry["dtype"], source)
        written[target] = True
    if not written.all():
        raise CheckpointError(f"{index_path}: the slices of {key!r} cover "
                              f"{int(written.sum())} of the {math.prod(shape)} elements this "
                              f"rank needs")
    return out
