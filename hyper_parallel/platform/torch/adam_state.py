"""torch.optim.Adam / AdamW state, read and written per parameter for checkpoints.

torch keeps ``optimizer.state[param] = {"step", "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]}``,
made at a parameter's first step; the moments are shaped like the parameter (DTensors for
sharded parameters, whose local tensors are what a rank holds) and ``step`` is a float
tensor per parameter.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def _check(optimizer) -> None:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"checkpoints store the state of torch.optim.Adam and AdamW, not "
                        f"{type(optimizer).__name__}")


def _group_of(optimizer, param) -> dict | None:
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return group
    return None


def adam_params(optimizer) -> list:
    _check(optimizer)
    return [p for group in optimizer.param_groups for p in group["params"]]


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def adam_state(optimizer, param):
    _check(optimizer)
    state = optimizer.state.get(param)
    if not state or "step" not in state:
        return None
    moments = {"exp_avg": _local(state["exp_avg"]), "exp_avg_sq": _local(state["exp_avg_sq"])}
    if _group_of(optimizer, param).get("amsgrad"):
        moments["max_exp_avg_sq"] = _local(state["max_exp_avg_sq"])
    return int(float(state["step"])), moments


def set_adam_state(optimizer, param, step, moments) -> None:
    _check(optimizer)
    group = _group_of(optimizer, param)
    if group is None:
        raise KeyError("the parameter is not one the optimizer updates")
    old_step = optimizer.state.get(param, {}).get("step")
    scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    state = {"step": torch.tensor(float(step), dtype=scalar_dtype,
                                  device=None if old_step is None else old_step.device)}
    with torch.no_grad():
        for name, value in moments.items():
            moment = torch.zeros_like(param, memory_format=torch.preserve_format)
            _local(moment).copy_(value)
            state[name] = moment
    optimizer.state[param] = state
