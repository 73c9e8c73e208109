"""The unshard node on MindSpore: a Cell whose construct and bprop are the core's functions.

MindSpore has no ``autograd.Function``; a Cell with a custom ``bprop`` is its equivalent. It
saves its inputs and outputs for backward, kept out of the user's saved-tensor hooks:
non-reentrant ``mindspore.recompute`` matches saved tensors by position, and a recomputed
forward that finds the parameters there makes no node.
"""

from __future__ import annotations

from mindspore import mint, nn
from mindspore.graph.api import _disable_saved_tensors_hooks


class _CoreDefinedCell(nn.Cell):
    """A Cell whose construct and bprop are the core's forward_fn and backward_fn."""

    def __init__(self, forward_fn, backward_fn):
        super().__init__()
        self._forward_fn = forward_fn
        self._backward_fn = backward_fn

    def construct(self, *inputs):
        return tuple(self._forward_fn(list(inputs)))

    def bprop(self, *args):
        # args = (*inputs, out, dout); dout is a tuple for a tuple output.
        inputs, dout = args[:-2], args[-1]
        grads = dout if isinstance(dout, (tuple, list)) else (dout,)
        # A bprop must return a tensor per input: "no gradient" is zeros here.
        return tuple(mint.zeros(x.shape, dtype=x.dtype) if g is None else g
                     for x, g in zip(inputs, self._backward_fn(list(grads))))


def run_differentiable(inputs, forward_fn, backward_fn, grads_to_inputs=True):
    """``Platform.differentiable_call`` on MindSpore (see the note at the top)."""
    if not grads_to_inputs:  # the bprop's None becomes zeros (see _CoreDefinedCell)
        backward = backward_fn
        backward_fn = lambda grads: [None for _ in backward(grads)]  # noqa: E731
    with _disable_saved_tensors_hooks("hyper_parallel: unshard node",
                                      is_error_on_outer_hook=False):
        return list(_CoreDefinedCell(forward_fn, backward_fn)(*inputs))
