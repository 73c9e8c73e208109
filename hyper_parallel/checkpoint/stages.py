"""Checkpoints of a pipelined run: model parts, their optimizers, and which pp rank holds
which stored names.

[Note: pipeline stages in a checkpoint]
``save_checkpoint`` and ``load_checkpoint`` take this rank's model parts (one module, or a
list: an interleaved schedule's several stages) and their optimizer (one over every
part's parameters, or a list, one per part), and ``pp_mesh``, the 1-D mesh the stages
are spread over. The parts keep the whole model's names (``pipeline_module_split``), so a
checkpoint of a pipelined run is the whole model's, as any other run writes it.

Saving: the ranks of one pp rank hold the same values (its data- and tensor-parallel
ranks, as any run's ranks do), and no stored name is held at two pp ranks. Every rank's
pp rank and stored names are gathered (layout.py, ``written_here``) before anything is
written, and a rank that breaks either rule makes every rank raise, naming it. Without ``pp_mesh``
every rank must hold the same values.

Loading: a rank reads only its own names, each of which the checkpoint must hold; and the
ranks together must load every name the checkpoint holds, else a stage's parameters would
keep the values they had. Once every rank has read what it needs (and agreed that none
failed), one all-reduce sums per-name flags over the index's sorted names
(``check_covered``); a name no rank loads is an error on every rank, before any rank
writes anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hyper_parallel.checkpoint.arguments import check_model
from hyper_parallel.checkpoint.index import CheckpointError
from hyper_parallel.checkpoint.layout import held_params
from hyper_parallel.checkpoint.optimizers import optimizer_type, read_state

if TYPE_CHECKING:
    from hyper_parallel.platform import Platform


def model_parts(platform: Platform, function: str, model: Any, optimizer: Any) -> list:
    """``[(model parts, the optimizer that updates them or None)]``: one entry per
    optimizer of a list (one per part), else one; TypeError for arguments of the wrong
    kind."""
    parts = list(model) if isinstance(model, (list, tuple)) else [model]
    if not parts:
        raise TypeError(f"{function}(model=...) takes a module or a non-empty list of this "
                        f"rank's model parts")
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else None
    if optimizers is not None and len(optimizers) != len(parts):
        raise TypeError(f"{function}(optimizer=[...]) takes one optimizer per model part: "
                        f"{len(optimizers)} optimizers for {len(parts)} parts")
    for i, part in enumerate(parts):
        check_model(platform, function, part,
                    optimizer if optimizers is None else optimizers[i])
    if optimizers is not None:
        return [([part], opt) for part, opt in zip(parts, optimizers)]
    return [(parts, optimizer)]


def held_groups(platform: Platform, groups: list, key_map: Any) -> list:
    """``model_parts``'s groups with the values they hold: ``[(Held list, optimizer)]``."""
    return [([h for part in parts for h in held_params(platform, part, key_map)], opt)
            for parts, opt in groups]


def optimizer_states(platform: Platform, groups: list) -> tuple:
    """``(the optimizers' class name, (per-parameter state, own state))`` of ``groups``
    (``read_state``'s, joined), or ``(None, None)`` without an optimizer."""
    optimizers = [(held, opt) for held, opt in groups if opt is not None]
    if not optimizers:
        return None, None
    types = sorted({optimizer_type(opt) for _, opt in optimizers})
    if len(types) > 1:
        raise CheckpointError(f"the model parts' optimizers are of different classes "
                              f"({', '.join(types)}): give every part the same optimizer class")
    per_param, own = {}, None
    for held, opt in optimizers:
        mine, theirs = read_state(platform, opt, held)
        if own is not None and theirs != own:
            raise CheckpointError(f"the model parts' optimizers keep different values of "
                                  f"their own ({own} and {theirs}): step them together")
        per_param.update(mine)
        own = theirs
    return types[0], (per_param, own)


def pp_rank_of(pp_mesh: Any) -> int | None:
    """This rank's place on ``pp_mesh`` (None without one)."""
    if pp_mesh is None:
        return None
    if getattr(pp_mesh, "ndim", None) != 1:
        raise TypeError(f"pp_mesh must be None or a 1-D hp DeviceMesh (mesh['pp']), got "
                        f"{type(pp_mesh).__name__}")
    return pp_mesh.get_local_rank(0)


def check_covered(platform: Platform, path: str, stored: list, loaded: set) -> None:
    """Every name of ``stored`` (the index's, sorted) loaded by some rank (``loaded``:
    this rank's): an all-reduce of per-name flags."""
    flags = np.array([name in loaded for name in stored], np.float32)
    if platform.world_size() > 1 and platform.is_initialized():
        tensor = platform.from_numpy(flags)
        platform.all_reduce(tensor, None, "sum").wait()
        flags = np.asarray(platform.to_numpy(tensor))
    missed = [name for name, flag in zip(stored, flags) if flag == 0]
    if missed:
        raise CheckpointError(f"{path}: no rank loads {', '.join(missed[:5])}"
                              f"{f' and {len(missed) - 5} more' if len(missed) > 5 else ''}: "
                              f"the pipeline's stages together must hold every value of the "
                              f"checkpoint; nothing was loaded on any rank")
