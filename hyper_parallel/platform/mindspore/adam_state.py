"""mindspore.experimental.optim.Adam / AdamW state, read and written per parameter.

These optimizers keep ParameterTuples ``exp_avg``, ``exp_avg_sq`` and ``max_exp_avg_sq``
aligned with ``optimizer.parameters`` (zeros from construction, shaped like each
parameter, padding rows included), and one ``state_step`` (int32) for every parameter.
"""

from __future__ import annotations

import mindspore as ms
from mindspore.experimental.optim import Adam, AdamW


def _check(optimizer) -> None:
    if not isinstance(optimizer, (Adam, AdamW)):
        raise TypeError(f"checkpoints store the state of mindspore.experimental.optim.Adam "
                        f"and AdamW, not {type(optimizer).__name__}")


def _position(optimizer, param) -> int:
    for i, p in enumerate(optimizer.parameters):
        if p is param:
            return i
    raise KeyError("the parameter is not one the optimizer updates")


def _amsgrad(optimizer, position) -> bool:
    for group_id, group in enumerate(optimizer.param_groups):
        if optimizer.group_start_id[group_id] <= position < optimizer.group_start_id[group_id + 1]:
            return bool(group.get("amsgrad"))
    return False


def adam_params(optimizer) -> list:
    _check(optimizer)
    return list(optimizer.parameters)


def _names(optimizer, position) -> tuple:
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if _amsgrad(optimizer, position) \
        else ("exp_avg", "exp_avg_sq")


def adam_state(optimizer, param):
    _check(optimizer)
    i = _position(optimizer, param)
    step = int(optimizer.state_step.asnumpy())
    return step, {name: getattr(optimizer, name)[i] for name in _names(optimizer, i)}


def set_adam_state(optimizer, param, step, moments) -> None:
    _check(optimizer)
    i = _position(optimizer, param)
    for name, value in moments.items():
        getattr(optimizer, name)[i].set_data(value.astype(getattr(optimizer, name)[i].dtype))
    optimizer.state_step.set_data(ms.Tensor(step, ms.int32))
