"""The torch platform's state-dict primitives: optimizer state and checkpoint files."""

from __future__ import annotations

from hyper_parallel.platform.state_io import StateIO

import numpy as np
import torch
from torch.distributed.tensor import DTensor


class TorchStateIO(StateIO):
    """Mixed into TorchPlatform."""

    checkpoint_extension = "pt"

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

    def save_tensors(self, tensors, path):
        torch.save({k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v.detach()
                    for k, v in tensors.items()}, path)

    def load_tensors(self, path):
        return torch.load(path, weights_only=True)

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
