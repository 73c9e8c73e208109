"""What ``hp.parallelize_module``, ``hp.ColwiseParallel``... are on each backend.

[Note: torch's own objects on torch]
On torch the public names are torch's own (``torch.distributed.tensor.parallel``,
``torch.distributed.tensor.Shard``/``Replicate``): a torch user keeps DTensor parameters,
DCP and torchtitan exactly as without this library, and fully_shard and checkpoints
already read DTensor layouts. On every other backend they are this package's. Resolved
at each attribute access, after the backend is known, so ``import hyper_parallel`` loads
no framework.
"""

from __future__ import annotations

import importlib

from hyper_parallel.platform import resolve_backend_name

#: public name -> the torch module that defines it
TORCH_HOMES = {
    "parallelize_module": "torch.distributed.tensor.parallel",
    "ColwiseParallel": "torch.distributed.tensor.parallel",
    "RowwiseParallel": "torch.distributed.tensor.parallel",
    "SequenceParallel": "torch.distributed.tensor.parallel",
    "PrepareModuleInput": "torch.distributed.tensor.parallel",
    "PrepareModuleOutput": "torch.distributed.tensor.parallel",
    "PrepareModuleInputOutput": "torch.distributed.tensor.parallel",
    "loss_parallel": "torch.distributed.tensor.parallel",
    "Shard": "torch.distributed.tensor",
    "Replicate": "torch.distributed.tensor",
}


def public_name(name: str):
    """The object ``hyper_parallel.<name>`` stands for on the selected backend."""
    if resolve_backend_name() == "torch":
        return getattr(importlib.import_module(TORCH_HOMES[name]), name)
    return getattr(importlib.import_module("hyper_parallel.tensor_parallel"), name)
