"""ContextParallelSupport on torch (platform/cp_support.py)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from hyper_parallel.platform.cp_support import ContextParallelSupport


class TorchContextParallelSupport(ContextParallelSupport):
    def replace_values(self, tensor, new):
        # the tensor is pointed at new memory (set_) rather than written into (torch's own
        # resize_ and copy_): buffers that share memory, such as ids and targets sliced from
        # one token array, must not overwrite each other
        with torch.no_grad():
            tensor.set_(new.contiguous().clone())

    @contextlib.contextmanager
    def route_framework_attention(self, attention):
        # as torch's own context_parallel does: the function of torch.nn.functional is
        # replaced while the context is open (a model that imported the function by name
        # before keeps the original)
        original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = attention
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original
