"""Attention over one block of keys, and blocks merged by their log-sum-exp.

[Note: the online-softmax merge]
Attention of queries q over keys split into blocks k_1..k_n is not the average of each
block's attention: each row's softmax normalises over all keys. A block's result is kept
with its log-sum-exp ``lse_i = log sum_j exp(s_ij)`` (per query), and the whole attention is
``sum_i out_i * exp(lse_i - M) / sum_i exp(lse_i - M)`` with ``M = max_i lse_i`` (taken so the
exponentials cannot overflow). That is exactly softmax over all keys, computed a block at a
time: what ring attention needs, whose keys arrive one rank at a time. The merge is written
with ``cat``/``amax``/``exp``/``sum``, so both frameworks differentiate it as they
differentiate any tensor code; scores and the merge are computed in float32 and the result
cast back to the queries' dtype.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from hyper_parallel.platform import get_platform


def causal_mask(q_positions: np.ndarray, k_positions: np.ndarray) -> Any:
    """A boolean (queries, keys) tensor: where a query may attend to a key (key <= query)."""
    return get_platform().from_numpy(q_positions[:, None] >= k_positions[None, :])


def block_attention(q: Any, k: Any, v: Any, scale: float, mask: Any = None) -> tuple:
    """``(out, lse)``: softmax attention of float32 ``q`` over ``k``/``v`` (``mask``: where a
    query may attend; every query row must keep at least one key), and each query's
    log-sum-exp of scores, its last dim kept (size 1)."""
    p = get_platform()
    scores = p.multiply(p.matmul(q, p.movedim(k, -1, -2)), scale)
    if mask is not None:
        scores = p.where(mask, scores, float("-inf"))
    top = p.amax(scores, -1)
    weights = p.exp(p.subtract(scores, top))
    total = p.sum_dim(weights, -1)
    out = p.divide(p.matmul(weights, v), total)
    return out, p.add(top, p.log(total))


def merge(blocks: Sequence[tuple]) -> Any:
    """The attention over all the keys of ``blocks`` (``(out, lse)`` pairs of one query set)."""
    if len(blocks) == 1:
        return blocks[0][0]
    p = get_platform()
    top = p.amax(p.cat([lse for _, lse in blocks], -1), -1)
    weights = [p.exp(p.subtract(lse, top)) for _, lse in blocks]
    total, out = weights[0], p.multiply(blocks[0][0], weights[0])
    for (block_out, _), weight in zip(blocks[1:], weights[1:]):
        total = p.add(total, weight)
        out = p.add(out, p.multiply(block_out, weight))
    return p.divide(out, total)


def default_scale(q: Any, scale: float | None) -> float:
    """torch's default: 1 / sqrt(head dim)."""
    return 1.0 / math.sqrt(get_platform().shape(q)[-1]) if scale is None else float(scale)


def as_float32(*tensors: Any) -> list:
    p = get_platform()
    return [p.cast(t, p.dtype("float32")) for t in tensors]


def plain_attention(q: Any, k: Any, v: Any, is_causal: bool, scale: float | None) -> Any:
    """Attention of one process over the whole sequence (outside a context)."""
    p = get_platform()
    s = default_scale(q, scale)
    q32, k32, v32 = as_float32(q, k, v)
    mask = None
    if is_causal:
        lq, lk = p.shape(q)[-2], p.shape(k)[-2]
        mask = causal_mask(np.arange(lq), np.arange(lk))
    out, _ = block_attention(q32, k32, v32, s, mask)
    return p.cast(out, p.dtype_of(q))
