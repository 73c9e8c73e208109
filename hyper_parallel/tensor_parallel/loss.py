"""Loss parallelism: cross entropy over logits split on the class dim, never gathered.

[Note: the arithmetic, as torch's loss_parallel]
Over logits ``x`` split on the class dim (a ``LayoutTensor`` in Shard(1) of an
``(N, C)`` tensor, e.g. a column-wise head with ``use_local_output=False``):
log-softmax with the row maximum and the sum of exponentials each all-reduced (max, sum);
the target's log-probability read on the rank whose columns hold it (zero on the others)
and all-reduced; ``ignore_index`` rows count zero and are left out of the mean. The
backward needs no collective: each rank's gradient is ``(exp(logp) - onehot) * g`` on its
own columns, ``g`` the incoming gradient (divided by the number of counted rows for
"mean"). Each step is the one torch 2.13's ``loss_parallel`` takes, in the same order,
and in its dtypes: the log-softmax of float16 or bfloat16 logits is computed in float32
and its result cast back (torch's elementwise type promotion), the rest in the logits'
dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import numpy as np

from hyper_parallel.platform import get_platform
from hyper_parallel.tensor_parallel import collectives as C
from hyper_parallel.tensor_parallel.layout import LayoutTensor
from hyper_parallel.tensor_parallel.placement import Shard, normalized

_ENABLED = contextvars.ContextVar("hp_loss_parallel", default=False)


@contextlib.contextmanager
def loss_parallel():
    """Within it, ``cross_entropy`` takes logits split on the class dim (torch's
    ``loss_parallel()``; torch also needs the backward inside it, this does not). On torch
    it also enters torch's own ``loss_parallel()``, so ``F.cross_entropy`` keeps taking the
    DTensor logits of torch's own styles."""
    token = _ENABLED.set(True)
    try:
        with get_platform().framework_loss_parallel():
            yield
    finally:
        _ENABLED.reset(token)


def cross_entropy(input: Any, target: Any, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> Any:
    """``F.cross_entropy(input, target)``, one name on every framework. ``input``: a
    ``LayoutTensor`` of ``(N, C)`` logits in Shard(1) (a column-wise head with
    ``use_local_output=False``), inside ``loss_parallel()``, never gathered; or a plain
    framework tensor of ``(N, C)`` logits (whole, e.g. a model without tensor parallelism,
    or torch's DTensor logits inside ``loss_parallel()``), given to the framework's own
    cross entropy. ``target``: ``(N,)`` class ids, replicated. Returns a plain tensor, the
    same on every rank."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got {reduction!r}")
    p = get_platform()
    if not isinstance(input, LayoutTensor):
        if not p.is_tensor(input):
            raise TypeError(f"hp.cross_entropy takes logits as a framework tensor or a "
                            f"LayoutTensor (a column-wise head with use_local_output=False); "
                            f"got {type(input).__name__}")
        return p.framework_cross_entropy(input, target, ignore_index, reduction,
                                         label_smoothing)
    if label_smoothing:
        raise NotImplementedError("hp.cross_entropy over split logits: label_smoothing is not "
                                  "supported (nor is it by torch's loss_parallel)")
    if not _ENABLED.get():
        raise RuntimeError("hp.cross_entropy over logits split on the class dim (a "
                           "LayoutTensor) runs only inside hp.loss_parallel(); wrap the loss in "
                           "`with hp.loss_parallel():`")
    if len(input.shape) != 2 or normalized(input.placement, 2) != Shard(1):
        raise ValueError(f"hp.cross_entropy takes (N, C) logits split on the class dim: a "
                         f"LayoutTensor in Shard(1) (a column-wise head with "
                         f"use_local_output=False; reshape (b, t, C) logits with "
                         f".reshape(-1, C)); got {input!r}")
    mesh = input.device_mesh
    local = input.local_tensor
    columns = p.shape(local)[1]
    low = mesh.get_local_rank(0) * columns
    counted = p.not_equal(target, ignore_index)
    safe = p.where(counted, target, 0)
    mine = p.in_range(safe, low, low + columns)
    column = p.reshape(p.where(mine, p.subtract(safe, low), 0), (-1, 1))
    saved = {}

    def forward(inputs):
        x = inputs[0]
        dtype = p.dtype_of(x)
        if dtype in (p.dtype("float16"), p.dtype("bfloat16")):
            x = p.cast(x, p.dtype("float32"))
        shifted = p.subtract(x, C.summed(p.amax(x, 1), mesh, op="max"))
        sumexp = C.summed(p.sum_dim(p.exp(shifted), 1), mesh)
        logp = p.cast(p.subtract(shifted, p.log(sumexp)), dtype)
        picked = p.where(p.reshape(mine, (-1, 1)), p.take_along_dim(logp, column, 1), 0.0)
        losses = p.where(counted, p.reshape(-C.summed(picked, mesh), (-1,)), 0.0)
        total = p.cast(p.total(counted), p.dtype_of(x))
        saved.update(logp=logp, total=total)
        if reduction == "none":
            return [losses]
        summed = p.total(losses)
        return [summed if reduction == "sum" else p.divide(summed, total)]

    def backward(grads):
        grad = grads[0]
        if reduction == "mean":
            grad = p.divide(grad, saved["total"])
        grad = p.reshape(p.where(counted, grad, 0.0), (-1, 1))
        arange = p.from_numpy(np.arange(columns, dtype=np.int64).reshape(1, -1))
        onehot = p.cast(p.equal(arange, column), p.dtype_of(saved["logp"]))
        onehot = p.multiply(onehot, p.cast(p.reshape(mine, (-1, 1)), p.dtype_of(onehot)))
        return [p.multiply(p.add(-onehot, p.exp(saved["logp"])), grad)]

    return p.differentiable_call([local], forward, backward)[0]
