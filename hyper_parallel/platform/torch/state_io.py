"""The torch platform's state-dict primitives: optimizer state and buffers."""

from __future__ import annotations

from hyper_parallel.platform.state_io import StateIO

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _get_scalar_dtype


class TorchStateIO(StateIO):
    """Mixed into TorchPlatform."""

    def optimizer_state(self, optimizer):
        state = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                for name, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        local = value.to_local() if isinstance(value, DTensor) else value
                        state.append((name, param, local))
        return state

    def buffers(self, module):
        return [(n, b) for n, b in module._buffers.items()
                if b is not None and n not in module._non_persistent_buffers_set]

    def optimizer_params(self, optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        return [p for group in optimizer.param_groups for p in group["params"]]

    def optimizer_options(self, optimizer, param):
        group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
        return {k: v for k, v in group.items() if k != "params"}

    def set_optimizer_state(self, optimizer, param, values):
        if param is None:
            if values:
                raise KeyError(f"torch's {type(optimizer).__name__} keeps no state of its own: "
                               f"{sorted(values)}")
            return
        options = self.optimizer_options(optimizer, param)
        on_device = options.get("capturable") or options.get("fused")  # steps live on the device
        state = {}
        with torch.no_grad():
            for name, value in values.items():
                if isinstance(value, (int, float)):
                    state[name] = torch.tensor(float(value), dtype=_get_scalar_dtype(),
                                               device=param.device if on_device else None)
                    continue
                full = torch.zeros_like(param, memory_format=torch.preserve_format)
                local = full.to_local() if isinstance(full, DTensor) else full
                local.copy_(value)
                state[name] = full
        if state:
            optimizer.state[param] = state
        else:
            optimizer.state.pop(param, None)

    def create_optimizer_state(self, optimizer):
        # as torch.distributed.checkpoint does: one step on zero gradients at learning rate 0
        if optimizer.state:
            return None
        lrs = [group["lr"] for group in optimizer.param_groups]
        zeroed = [p for group in optimizer.param_groups for p in group["params"]
                  if p.requires_grad and p.grad is None]
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        for param in zeroed:
            param.grad = torch.zeros_like(param)
        try:
            optimizer.step()
        finally:
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr
            for param in zeroed:
                param.grad = None
        return optimizer.state.clear
