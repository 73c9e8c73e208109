"""Tensor parallelism written once over the platform: torch's styles, plan and loss
parallelism (``torch.distributed.tensor.parallel``), for frameworks without them.

``hyper_parallel.parallelize_module`` and the style names resolve to torch's own objects
on torch and to these on MindSpore (hyper_parallel/__init__.py); this package runs on
both, which is how the tests hold it against torch's DTensor tensor parallelism.
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
