"""A forward now and its backward later, on torch (a pipeline stage's step).

The stage's inputs become leaves that require a gradient, the forward records its graph as
any forward does, and the backward is ``torch.autograd.backward`` from the output with the
gradient the next stage sent: parameter gradients accumulate in ``.grad`` (units' hooks
run as in any backward), the inputs' gradients are what goes back to the previous stage.
Any number of such forwards may be pending, their backwards in any order.
"""

from __future__ import annotations

import torch


def forward_for_later_backward(module, fn, inputs, keep_graph: bool) -> tuple:
    del module, keep_graph  # parameters accumulate on themselves; every graph is kept
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    output = fn(*leaves)

    def backward(grad_output):
        torch.autograd.backward(output, grad_output)
        return [x.grad for x in leaves], None

    return output, backward
