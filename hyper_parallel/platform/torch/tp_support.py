"""TensorParallelSupport on torch (platform/tp_support.py)."""

from __future__ import annotations

import torch

from hyper_parallel.platform.tp_support import ParallelLayer, TensorParallelSupport


class TorchTensorParallelSupport(TensorParallelSupport):
    def parallel_layer(self, module):
        if isinstance(module, torch.nn.Linear):
            return ParallelLayer("linear", "weight", "bias" if module.bias is not None else None)
        if isinstance(module, torch.nn.Embedding):
            return ParallelLayer("embedding", "weight")
        return None

    def is_framework_style(self, style):
        from torch.distributed.tensor.parallel import ParallelStyle

        return isinstance(style, ParallelStyle)

    def framework_parallelize(self, module, native_mesh, plan, src_data_rank):
        from torch.distributed.tensor.parallel import parallelize_module

        return parallelize_module(module, native_mesh, plan, src_data_rank=src_data_rank)

    def framework_cross_entropy(self, logits, target, ignore_index, reduction,
                                label_smoothing=0.0):
        return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index,
                                                 reduction=reduction,
                                                 label_smoothing=label_smoothing)

    def framework_loss_parallel(self):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def new_local_param(self, orig_param, local):
        return torch.nn.Parameter(local.detach().clone(), requires_grad=orig_param.requires_grad)

    def set_local_param(self, module, attr_name, param):
        module.register_parameter(attr_name, param)

    def amax(self, tensor, dim):
        return torch.amax(tensor, dim, keepdim=True)

    def sum_dim(self, tensor, dim):
        return torch.sum(tensor, dim, keepdim=True)

    def take_along_dim(self, tensor, index, dim):
        return torch.gather(tensor, dim, index)

    def where(self, condition, tensor, other):
        return torch.where(condition, tensor, other)
