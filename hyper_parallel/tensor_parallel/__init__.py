"""Tensor parallelism written once over the platform: torch's styles, plan and loss
parallelism (``torch.distributed.tensor.parallel``), the same on every framework.

These are ``hp.parallelize_module``, the style names, ``hp.Shard``/``hp.Replicate``,
``hp.loss_parallel`` and ``hp.cross_entropy`` on torch and on MindSpore alike; the tests
hold them bitwise against torch's DTensor tensor parallelism. On torch,
``parallelize_module`` also applies a plan of torch's own styles with torch's function.
docs/tensor-parallel.md describes what each style does and the current limits.
"""

from hyper_parallel.tensor_parallel.api import parallelize_module
from hyper_parallel.tensor_parallel.layout import (
    LAYOUT_ATTR, LayoutTensor, ParamLayout, tensor_parallel_layout)
from hyper_parallel.tensor_parallel.linear_styles import ColwiseParallel, RowwiseParallel
from hyper_parallel.tensor_parallel.loss import cross_entropy, loss_parallel
from hyper_parallel.tensor_parallel.placement import Placement, Replicate, Shard
from hyper_parallel.tensor_parallel.prepare import (
    PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput)
from hyper_parallel.tensor_parallel.sequence import SequenceParallel
from hyper_parallel.tensor_parallel.style import ParallelStyle

__all__ = [
    "ColwiseParallel", "LAYOUT_ATTR", "LayoutTensor", "ParallelStyle", "ParamLayout",
    "Placement", "PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput",
    "Replicate", "RowwiseParallel", "SequenceParallel", "Shard", "cross_entropy",
    "loss_parallel", "parallelize_module", "tensor_parallel_layout",
]
