"""A forward now and its backward later, on MindSpore PyNative (a pipeline stage's step).

[Note: the stack of pending forwards]
``mindspore.vjp(fn, *inputs, weights=...)`` runs the forward now and returns the function
that runs its backward later, with no second forward. MindSpore keeps the forwards whose
backward is pending as a stack: only the latest one's backward may run (an older one's
raises "Can not find top cell for backward", and leaves the executor unusable for the
next backward; tests/platform/later_backward_repro.py). The core knows a schedule's whole
order and says which forwards keep their graph (``keep_graph``); any other forward runs
without recording (as under ``no_grad``: units reshard after it), keeps only its inputs,
and its backward runs the forward again under ``vjp`` followed at once by the backward,
the pair being then the latest on the stack.
"""

from __future__ import annotations

import mindspore as ms
from mindspore.graph.api import _no_grad


def forward_for_later_backward(module, fn, inputs, keep_graph: bool) -> tuple:
    weights = list(module.trainable_params())
    if keep_graph:
        output, vjp_fn = ms.vjp(fn, *inputs, weights=weights)
        return output, lambda grad_output: _grads(vjp_fn(grad_output))
    with _no_grad():
        output = fn(*inputs)

    def recompute_and_backward(grad_output):
        _, again = ms.vjp(fn, *inputs, weights=weights)
        return _grads(again(grad_output))

    return output, recompute_and_backward


def _grads(returned) -> tuple:
    input_grads, param_grads = returned  # with weights: (per input, per weight)
    return list(input_grads), list(param_grads)
