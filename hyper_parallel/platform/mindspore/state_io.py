"""The MindSpore platform's state-dict primitives: optimizer state.

A MindSpore optimizer is a Cell whose per-parameter state are Parameters cloned from the
parameters it steps, named ``<state>.<parameter name>`` (``exp_avg.0.weight``,
``moment1.0.weight``); its other Parameters (``state_step``, ``global_step``,
``beta1_power``, ``learning_rate``) are its own values.
"""

from __future__ import annotations

from hyper_parallel.platform.state_io import StateIO

import numpy as np
from mindspore import Tensor
from mindspore.experimental.optim import Optimizer as ExperimentalOptimizer
from mindspore.nn import Optimizer


class MindSporeStateIO(StateIO):
    """Mixed into MindSporePlatform."""

    def optimizer_state(self, optimizer):
        stepped = {id(p) for p in optimizer.parameters}
        by_name = {p.name: p for p in optimizer.parameters}
        state = []
        for name, value in optimizer.parameters_and_names():
            if id(value) in stepped:
                continue
            prefix, _, param_name = value.name.partition(".")
            owner = by_name.get(param_name) if param_name else None
            if owner is not None and owner.shape == value.shape:
                state.append((prefix, owner, value))
            else:
                state.append((value.name, None, value))
        return state

    def optimizer_params(self, optimizer):
        if not isinstance(optimizer, (Optimizer, ExperimentalOptimizer)):
            raise TypeError(f"expected a mindspore.nn.Optimizer or a mindspore.experimental."
                            f"optim.Optimizer, got {type(optimizer).__name__}")
        return list(optimizer.parameters)

    def optimizer_options(self, optimizer, param):
        # experimental.optim keeps torch's param_groups; an nn.Optimizer has no groups' options
        for group in getattr(optimizer, "param_groups", ()):
            if any(p is param for p in group["params"]):
                return {k: v for k, v in group.items() if k != "params"}
        return {}

    def set_optimizer_state(self, optimizer, param, values):
        by_name = {value.name: value for _, value in optimizer.parameters_and_names()}
        targets = {}
        for name in values:  # every name found before anything is written
            stored = name if param is None else f"{name}.{param.name}"
            if stored not in by_name:
                raise KeyError(f"{type(optimizer).__name__} has no state {stored!r}")
            targets[name] = by_name[stored]
        for name, value in values.items():
            target = targets[name]
            if isinstance(value, (int, float)):
                value = Tensor(np.full(target.shape, value), target.dtype)
            target.set_data(value.astype(target.dtype))
