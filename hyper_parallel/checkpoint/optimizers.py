"""Optimizer state in a checkpoint: any optimizer whose per-parameter state is tensors shaped
like the parameter, or numbers; and the table that moves it between optimizer classes.

[Note: optimizer state]
Saving records the optimizer's class (``type``: its module and name) and, per parameter
(by stored name), the names of its state tensors, stored as ``optim.<state>.<name>`` and
laid out like the parameter, and its numbers (torch's per-parameter ``step``); the
optimizer's own numbers (MindSpore's ``state_step``) apart. Hyper-parameters are not
stored: they come from the optimizer the loading run builds.

Loading into the same class writes the state as it was saved. Another class loads it only
through ``KINDS``: each entry says, for one class, which family of update rule it follows
and how its state names map to the family's (torch's ``momentum_buffer`` and MindSpore's
``accum`` and ``moments`` are SGD's ``momentum``), where it keeps the step count (per
parameter or one for all), and which tensor flags a parameter that has not stepped yet
(MindSpore SGD's ``stat``: 1 until the first step), and which states it keeps only under
an option of the parameter's group (torch's ``max_exp_avg_sq`` with ``amsgrad``, its
``momentum_buffer`` with a ``momentum``): a move leaves those out where the option is
off, so the loaded state is the one the target's own steps would have made (MindSpore's
``AdamW`` keeps ``max_exp_avg_sq``, zeros, even without amsgrad). A class missing from
the table, a move to another family, or a state the table does not name is a
CheckpointError naming the optimizers and the state, raised while reading, before
anything is written.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from hyper_parallel.checkpoint.index import INDEX_FILE, CheckpointError, moment_key

if TYPE_CHECKING:
    from hyper_parallel.platform import Platform

# an optimizer's own values that are settings, never stored (MindSpore keeps them as
# Parameters of the optimizer)
HYPER_PARAMETERS = frozenset({"learning_rate", "momentum", "weight_decay"})


@dataclass(frozen=True)
class Kind:
    """How one optimizer class keeps the state of its family's update rule."""

    family: str
    tensors: dict  # this class's state name -> the family's
    step: tuple | None = None  # ("param", name): per parameter; ("own", name): one for all
    first_step_flag: str | None = None  # a per-parameter tensor, 1 until its first step
    kept_if: dict = field(default_factory=dict)  # state -> the group option it needs


_ADAM = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "max_exp_avg_sq": "max_exp_avg_sq"}
_AMSGRAD = {"max_exp_avg_sq": "amsgrad"}
KINDS = {
    "torch.optim.sgd.SGD": Kind("sgd", {"momentum_buffer": "momentum"},
                                kept_if={"momentum_buffer": "momentum"}),
    "mindspore.experimental.optim.sgd.SGD": Kind("sgd", {"accum": "momentum"},
                                                 first_step_flag="stat"),
    "mindspore.nn.optim.sgd.SGD": Kind("sgd", {"accum": "momentum"}, first_step_flag="stat"),
    "mindspore.nn.optim.momentum.Momentum": Kind("sgd", {"moments": "momentum"}),
    "torch.optim.adam.Adam": Kind("adam", _ADAM, step=("param", "step"), kept_if=_AMSGRAD),
    "mindspore.experimental.optim.adam.Adam": Kind("adam", _ADAM, step=("own", "state_step")),
    "torch.optim.adamw.AdamW": Kind("adamw", _ADAM, step=("param", "step"),
                                    kept_if=_AMSGRAD),
    "mindspore.experimental.optim.adamw.AdamW": Kind("adamw", _ADAM,
                                                     step=("own", "state_step")),
}


def optimizer_type(optimizer: Any) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _number(platform: Platform, tensor: Any) -> int | float:
    return np.asarray(platform.to_numpy(tensor)).reshape(-1)[0].item()


def read_state(platform: Platform, optimizer: Any, held: list) -> tuple:
    """``({id(param): ({state: local tensor}, {state: number})}, {own state: number})``;
    TypeError for state that is neither shaped like its parameter nor a number."""
    name = optimizer_type(optimizer)
    by_param = {id(h.param): h for h in held}
    for param in platform.optimizer_params(optimizer):
        if id(param) not in by_param:
            raise CheckpointError(f"the {name} updates a parameter that is not one of the "
                                  f"model's (or one key_map leaves out); pass the optimizer "
                                  f"built on this model's parameters (after fully_shard)")
    per_param, own = {}, {}
    for state, owner, tensor in platform.optimizer_state(optimizer):
        shape = tuple(platform.shape(tensor))
        if owner is None:
            if state in HYPER_PARAMETERS:
                continue
            if math.prod(shape) != 1:
                raise TypeError(f"{name} keeps its own value {state!r} of shape {shape}: "
                                f"checkpoints store an optimizer's own values as numbers")
            own[state] = _number(platform, tensor)
            continue
        h = by_param[id(owner)]
        tensors, numbers = per_param.setdefault(id(owner), ({}, {}))
        if shape == tuple(platform.shape(h.local(platform))):
            tensors[state] = tensor
        elif math.prod(shape) == 1 and len(shape) <= 1:
            numbers[state] = _number(platform, tensor)
        else:
            raise TypeError(f"{name} keeps state {state!r} of shape {shape} for {h.name!r}, "
                            f"whose local shape is {tuple(platform.shape(h.local(platform)))}: "
                            f"checkpoints store per-parameter state shaped like its "
                            f"parameter, or numbers")
    return per_param, own


def read_for_load(platform: Platform, path: str, index: dict, held: list, optimizer: Any,
                  read_region: Callable) -> tuple:
    """``([(Held, {state: numpy region or number})], {own state: number})`` to write into
    ``optimizer``, converted through ``KINDS`` when it is another class than the saver's;
    ``read_region(key, entry, held)`` reads this rank's region of a stored tensor."""
    index_path = os.path.join(path, INDEX_FILE)
    record = index.get("optimizer")
    if record is None:
        raise CheckpointError(f"{path} holds no optimizer state (it was saved without an "
                              f"optimizer); load it without one")
    saved, target = record["type"], optimizer_type(optimizer)
    move = None
    if saved != target:
        move = (KINDS.get(saved), KINDS.get(target))
        if None in move or move[0].family != move[1].family:
            raise CheckpointError(
                f"{index_path} holds the state of {saved}, which does not map to {target}: "
                f"build a {saved}, or move between the optimizers that correspond "
                f"(docs/checkpoints.md, \"Optimizers\")")
    lists, own_listed = {}, set()  # the names the target lists now, to check against
    for state, owner, _ in platform.optimizer_state(optimizer):
        if owner is None:
            own_listed.add(state)
        else:
            lists.setdefault(id(owner), set()).add(state)
    updated = {id(p) for p in platform.optimizer_params(optimizer)}
    writes, steps = [], {}
    for h in held:
        if id(h.param) not in updated:
            continue
        entry = record["state"].get(h.key)
        values = {}
        if entry is not None:
            for state in entry["tensors"]:
                key = moment_key(state, h.key)
                if key not in index["tensors"]:
                    raise CheckpointError(f"{index_path}: tensor {key!r} is missing")
                values[state] = read_region(key, index["tensors"][key], h)
            values.update(entry["scalars"])
        if move is not None:
            values, step = _convert(index_path, saved, target, *move, values, record["own"],
                                    platform.optimizer_options(optimizer, h.param))
            if step is not None and move[1].step and move[1].step[0] == "own":
                steps[h.key] = step
        unknown = sorted(set(values) - lists[id(h.param)]) if lists.get(id(h.param)) else []
        if unknown:
            raise CheckpointError(f"{index_path}: state {', '.join(unknown)} of {h.key!r} is "
                                  f"not state of the {target}")
        writes.append((h, values))
    own = dict(record["own"]) if move is None else {}
    if move is not None and steps:
        if len(set(steps.values())) > 1:
            raise CheckpointError(
                f"{index_path} holds different optimizer steps per parameter "
                f"({sorted(set(steps.values()))}); {target} keeps one step for every parameter")
        own[move[1].step[1]] = next(iter(steps.values()))
    unknown = sorted(set(own) - own_listed)
    if unknown:
        raise CheckpointError(f"{index_path}: the optimizer's own {', '.join(unknown)} is not "
                              f"state of the {target}")
    return writes, own


def _convert(index_path: str, saved: str, target: str, source: Kind, goal: Kind,
             values: dict, own: dict, options: dict) -> tuple:
    """One parameter's saved ``values`` as ``goal``'s state, and its step (None: none);
    ``options``: the target's options for the parameter (its group's)."""
    family, numbers = {}, {}
    for state, value in values.items():
        if state == source.first_step_flag or (source.step and state == source.step[1]):
            continue
        if state not in source.tensors:
            raise CheckpointError(f"{index_path}: {saved}'s state {state!r} has no counterpart "
                                  f"in {target}")
        family[source.tensors[state]] = value
    step = None
    if source.step is not None:
        where, name = source.step
        step = values.get(name) if where == "param" else own.get(name)
        if not step:
            family = {}  # no step taken yet: no state
    flag = values.get(source.first_step_flag) if source.first_step_flag else None
    if flag is not None and np.any(np.asarray(flag) != 0):
        family = {}
    inverse = {f: state for state, f in goal.tensors.items()}
    converted = {}
    for name, value in family.items():
        if name not in inverse:
            raise CheckpointError(f"{index_path}: {saved}'s state {name!r} has no counterpart "
                                  f"in {target}")
        option = goal.kept_if.get(inverse[name])
        if option is None or options.get(option):
            converted[inverse[name]] = value
    if goal.first_step_flag:
        numbers[goal.first_step_flag] = 0 if family else 1
    if goal.step is not None and goal.step[0] == "param" and family:
        numbers[goal.step[1]] = step
    return {**converted, **numbers}, (step if family else None)
