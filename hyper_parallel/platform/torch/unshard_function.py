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

from hyper_parallel.platform.torch.eager_hooks import call_eagerly


class _CoreDefinedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward_fn, backward_fn, *inputs):
        ctx.backward_fn = backward_fn
        ctx.set_materialize_grads(False)  # an output nothing used: None, not zeros
        outputs = forward_fn(list(inputs))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *output_grads):
        input_grads = call_eagerly(ctx.backward_fn, list(output_grads))
        return (None, None, *input_grads)


def run_differentiable(inputs, forward_fn, backward_fn, grads_to_inputs=True) -> list:
    """Apply the core's (forward_fn, backward_fn) pair as one autograd node. Without
    ``grads_to_inputs`` the node hangs off one private empty tensor instead of the inputs:
    autograd then never reaches them (no accumulation into ``.grad`` and none of their
    post-accumulate-grad hooks, which the platform runs itself when it writes the reduced
    gradient), and backward_fn's results are dropped."""
    if grads_to_inputs:
        return list(_CoreDefinedFunction.apply(forward_fn, backward_fn, *inputs))
    anchor = torch.empty(0, requires_grad=any(t.requires_grad for t in inputs))

    def backward_to_anchor(grads):
        backward_fn(grads)
        return [None]

    return list(_CoreDefinedFunction.apply(lambda _: forward_fn(list(inputs)),
                                           backward_to_anchor, anchor))
