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

from hyper_parallel.checkpoint.arguments import check_bool, check_model, check_path
from hyper_parallel.checkpoint.files import SliceReader
from hyper_parallel.checkpoint.index import INDEX_FILE, CheckpointError, overlaps, read_index
from hyper_parallel.checkpoint.index_check import check_index, confined
from hyper_parallel.checkpoint.layout import from_array, held_params
from hyper_parallel.checkpoint.optimizers import read_for_load
from hyper_parallel.checkpoint.save import agree_on_failure, finish_pending_saves
from hyper_parallel.platform import get_platform

if TYPE_CHECKING:
    from hyper_parallel.checkpoint.layout import Held
    from hyper_parallel.platform import Platform


def load_checkpoint(path: str, model: Any, optimizer: Any = None, key_map: Any = None,
                    verify: bool = True) -> Any:
    """Load the checkpoint at directory ``path`` into ``model`` (and ``optimizer``, which
    must update the same parameters); return its ``extra``. Every rank
    calls it. ``key_map``: the stored name of each model name (names.py). ``verify``: check
    each tensor read against its checksum. On any error no rank changes anything."""
    path = check_path("load_checkpoint", path)
    check_bool("load_checkpoint", "verify", verify)
    platform = get_platform()
    check_model(platform, "load_checkpoint", model, optimizer)
    finish_pending_saves()
    failure, plan = None, None
    try:
        plan = _read_everything(platform, path, model, optimizer, key_map, verify)
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
    index, values, (states, own) = plan
    with platform.no_grad():
        for h, array in values:
            local = h.local(platform)
            platform.copy_into(local, from_array(platform, h, array, local))
        for h, state in states:
            like = h.local(platform)
            platform.set_optimizer_state(optimizer, h.param, {
                name: from_array(platform, h, value, like) if isinstance(value, np.ndarray)
                else value for name, value in state.items()})
        if own:
            platform.set_optimizer_state(optimizer, None, own)
    return index.get("extra")


def _read_everything(platform: Platform, path: str, model: Any, optimizer: Any,
                     key_map: Any, verify: bool) -> tuple:
    held = held_params(platform, model, key_map)
    confined(path, INDEX_FILE, os.path.join(path, INDEX_FILE))
    index = read_index(path)
    check_index(path, os.path.join(path, INDEX_FILE), index)
    tensors = index["tensors"]
    names = {h.key for h in held}
    model_keys = {key for key in tensors if not key.startswith("optim.")}
    if names != model_keys:
        missing, unknown = sorted(names - model_keys), sorted(model_keys - names)
        raise CheckpointError(
            f"{os.path.join(path, INDEX_FILE)} holds a different model: "
            + "; ".join(part for part in (
                f"missing {', '.join(missing[:5])}" if missing else "",
                f"not in this model {', '.join(unknown[:5])}" if unknown else "") if part))
    reader = SliceReader(path, verify)
    values = [(h, _read_region(reader, path, h.key, tensors[h.key], h)) for h in held]
    states = ([], {}) if optimizer is None else read_for_load(
        platform, path, index, held, optimizer,
        lambda key, entry, h: _read_region(reader, path, key, entry, h))
    return index, values, states


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
