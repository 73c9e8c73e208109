"""A torch autograd.Function whose forward and backward are supplied by the core.

[Note: one node per unit]
The core's unshard is one autograd node whose inputs are the unit's local shards and
whose outputs are the full parameters. Autograd calls its backward once, after the
gradients of every use of every output were summed, which is exactly FSDP's
"post-backward of this unit": tied parameters and a module called twice need no special
casing.
"""

from __future__ import annotations

import torch


class _CoreDefinedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward_fn, backward_fn, *inputs):
        ctx.backward_fn = backward_fn
        outputs = forward_fn(list(inputs))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *output_grads):
        input_grads = ctx.backward_fn(list(output_grads))
        return (None, None, *input_grads)


def run_differentiable(inputs, forward_fn, backward_fn) -> list:
    """Apply the core's (forward_fn, backward_fn) pair as one autograd node."""
    return list(_CoreDefinedFunction.apply(forward_fn, backward_fn, *inputs))
