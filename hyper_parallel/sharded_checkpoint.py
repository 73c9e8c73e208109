"""A sharded checkpoint on disk: each rank's pieces in the framework's own format, with
their layout beside them; loadable at any world size.

[Note: checkpoint layout]
A directory holds, per saving rank r, ``rank<r>.<ext>`` (the pieces: ``mindspore.
save_checkpoint`` on MindSpore, ``torch.save`` on torch, named by key) and
``rank<r>.layout.json``: ``{"world_size": n, "values": {key: ShardedValue.layout()}}``.
Loading reads every layout first (no data), checks that the pieces cover each of this
rank's rows, then reads one rank's file at a time and keeps only the rows it needs: a
rank holds its own part plus one saved file, never the whole model.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hyper_parallel.platform import get_platform
from hyper_parallel.state_dict import ShardedValue, check_state, get_state_dict, set_state_dict
from hyper_parallel.state_dict import state_entries, to_numpy

LAYOUT_SUFFIX = ".layout.json"


def save_sharded_checkpoint(model: Any, directory: str, optimizer: Any = None) -> None:
    """Write this rank's part of the model (and optimizer) into ``directory``; every rank
    calls it with the same directory."""
    platform = get_platform()
    state = get_state_dict(model, optimizer)
    os.makedirs(directory, exist_ok=True)
    rank = platform.rank()
    platform.save_tensors({k: v.local for k, v in state.items()},
                          os.path.join(directory, f"rank{rank}.{platform.checkpoint_extension}"))
    layout = {"world_size": platform.world_size(),
              "values": {k: v.layout() for k, v in state.items()}}
    with open(os.path.join(directory, f"rank{rank}{LAYOUT_SUFFIX}"), "w") as file:
        json.dump(layout, file)


def load_sharded_checkpoint(model: Any, directory: str, optimizer: Any = None,
                            strict: bool = True) -> None:
    """Load a checkpoint saved by ``save_sharded_checkpoint`` at any world size into the
    (sharded) model and optimizer; nothing is written unless every value is found."""
    platform = get_platform()
    layouts = _read_layouts(directory)
    # every key, shape and row checked on the layouts alone, before any data is read
    pieces_by_key = {}
    for layout in layouts.values():
        for key, record in layout["values"].items():
            pieces_by_key.setdefault(key, []).append(ShardedValue.from_layout(record))
    undo = None if optimizer is None else platform.create_optimizer_state(optimizer)
    try:
        entries = state_entries(model, optimizer)
        check_state(platform, entries, pieces_by_key, strict)
    except Exception:
        if undo is not None:
            undo()
        raise
    wanted = {e.key: e.target(platform) for e in entries}
    state = {k: [] for k in pieces_by_key if k in wanted}
    for rank, layout in sorted(layouts.items()):
        # a whole value is read from the first file that has it
        needed = [k for k, r in layout["values"].items()
                  if k in wanted and _needs(ShardedValue.from_layout(r), wanted[k], state[k])]
        if not needed:
            continue
        saved = platform.load_tensors(
            os.path.join(directory, f"rank{rank}.{platform.checkpoint_extension}"))
        for key in needed:
            piece = ShardedValue.from_layout(layout["values"][key])
            state.setdefault(key, []).append(
                ShardedValue(to_numpy(platform, saved[key]), piece.global_shape,
                             piece.shard_dim, piece.offset, piece.length))
        del saved
    set_state_dict(model, state, optimizer, strict=strict)


def _read_layouts(directory: str) -> dict:
    """``{saving rank: layout}``; an error naming what is missing when the set is not whole."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no checkpoint directory {directory!r}")
    layouts = {}
    for name in os.listdir(directory):
        if name.startswith("rank") and name.endswith(LAYOUT_SUFFIX):
            with open(os.path.join(directory, name)) as file:
                layouts[int(name[len("rank"):-len(LAYOUT_SUFFIX)])] = json.load(file)
    if not layouts:
        raise FileNotFoundError(f"{directory!r} holds no rank<r>{LAYOUT_SUFFIX}: not a "
                                "checkpoint written by save_sharded_checkpoint")
    world = {layout["world_size"] for layout in layouts.values()}
    missing = sorted(set(range(max(world))) - set(layouts)) if len(world) == 1 else None
    if missing is None or missing:
        raise ValueError(f"{directory!r} is not one whole checkpoint: saved at world size(s) "
                         f"{sorted(world)}, layouts found for ranks {sorted(layouts)}"
                         + (f", missing ranks {missing}" if missing else ""))
    return layouts


def _needs(piece: ShardedValue, target: ShardedValue, have: list) -> bool:
    """Whether ``piece`` holds rows of ``target`` that the pieces in ``have`` lack. An
    empty piece never does (and MindSpore's checkpoint leaves empty tensors out)."""
    if any(p.shard_dim is None for p in have) or piece.shard_dim is not None and not piece.length:
        return False
    if piece.shard_dim is None:
        return not have
    if piece.shard_dim != target.shard_dim:
        return True
    return piece.offset < target.offset + target.length and target.offset < piece.offset + piece.length
