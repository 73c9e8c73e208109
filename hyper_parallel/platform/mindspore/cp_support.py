"""ContextParallelSupport on MindSpore (platform/cp_support.py)."""

from __future__ import annotations

from hyper_parallel.platform.cp_support import ContextParallelSupport


class MindSporeContextParallelSupport(ContextParallelSupport):
    def replace_values(self, tensor, new):
        # the in-place kernels are not registered on CPU (platform-facts); assign_value
        # rebinds the tensor object's data, shape included, so every reference sees it
        tensor.assign_value(new + 0)
