"""TensorParallelSupport on MindSpore (platform/tp_support.py)."""

from __future__ import annotations

from mindspore import Parameter, mint, nn, ops

from hyper_parallel.platform.tp_support import ParallelLayer, TensorParallelSupport


class MindSporeTensorParallelSupport(TensorParallelSupport):
    def parallel_layer(self, module):
        # nn.Dense applies its activation after the bias: on a row-wise split it would act
        # on partial sums, so only a Dense without one is a linear layer here
        if isinstance(module, nn.Dense) and getattr(module, "activation", None) is None:
            return ParallelLayer("linear", "weight", "bias" if module.has_bias else None)
        if isinstance(module, mint.nn.Linear):
            return ParallelLayer("linear", "weight",
                                 "bias" if getattr(module, "bias", None) is not None else None)
        if isinstance(module, nn.Embedding):  # its construct reshapes by embedding_size
            return ParallelLayer("embedding", "embedding_table", split_dims=(0,))
        if isinstance(module, mint.nn.Embedding):
            return ParallelLayer("embedding", "weight")
        return None

    def unsplittable_reason(self, module):
        if isinstance(module, nn.Dense) and getattr(module, "activation", None) is not None:
            return (f"its activation ({type(module.activation).__name__}) runs inside the layer, "
                    f"after the bias: on a row-wise split it would act on partial sums, so "
                    f"only an nn.Dense without activation is split; build it without one and "
                    f"apply the activation in the model's construct")
        return None

    def framework_cross_entropy(self, logits, target, ignore_index, reduction,
                                label_smoothing=0.0):
        return ops.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                                 label_smoothing=label_smoothing)

    def new_local_param(self, orig_param, local):
        return Parameter(local + 0, name=orig_param.name, requires_grad=orig_param.requires_grad)

    def set_local_param(self, module, attr_name, param):
        module._params[attr_name] = param  # Cell.__setattr__ would check the name's prefix

    def amax(self, tensor, dim):
        return mint.amax(tensor, dim, True)

    def sum_dim(self, tensor, dim):
        return mint.sum(tensor, dim, True)

    def take_along_dim(self, tensor, index, dim):
        return mint.gather(tensor, dim, index)

    def where(self, condition, tensor, other):
        return mint.where(condition, tensor, other)
