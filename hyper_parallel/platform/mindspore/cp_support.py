"""ContextParallelSupport on MindSpore (platform/cp_support.py)."""

from __future__ import annotations

from mindspore.common.tensor import swap_tensors

from hyper_parallel.platform.cp_support import ContextParallelSupport


class MindSporeContextParallelSupport(ContextParallelSupport):
    def replace_values(self, tensor, new):
        # the in-place kernels are not registered on CPU; assign_value
        # rebinds the tensor object's data, shape included, so every reference sees it, and
        # writes nothing a view shares. A tensor a network took as input refuses it ("Can
        # not modify tensor id of input tensor from network"): its data is swapped instead
        try:
            tensor.assign_value(new + 0)
        except RuntimeError:
            swap_tensors(tensor, new + 0)
