"""Ring attention: each rank's queries against every rank's keys and values, which travel
around the ring of context-parallel ranks.

[Note: the ring, step by step]
Rank r holds the queries, keys and values of its two chunks (balance.py). At step i it holds
the keys and values of rank (r - i) mod cp: it attends its queries to them, keeping each
block's ``(out, lse)``, and passes them on with ``ring_shift`` (autograd_collectives.py), so
after cp - 1 shifts every query has met every key; the blocks are merged by their
log-sum-exp (blocks.py). ``ring_shift`` is one autograd node whose backward shifts the
gradient the other way, so the gradient of a key or value reaches the rank that owns it by
the reverse ring, and both frameworks differentiate the whole without a hand-written
backward. Keys and values travel as one flat tensor: one exchange per step.

With a causal mask, a query chunk a and a key chunk b are attended in full where b < a, with
the causal mask inside the chunk where b == a, and not at all where b > a: the pairs a rank
computes are the same in number on every rank (balance.py), and no block is computed only
to be masked away.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hyper_parallel.autograd_collectives import ring_shift
from hyper_parallel.context_parallel.balance import chunk_ids
from hyper_parallel.context_parallel.blocks import block_attention, causal_mask, merge
from hyper_parallel.platform import get_platform


def ring_attention(q: Any, k: Any, v: Any, is_causal: bool, scale: float, mesh: Any) -> Any:
    """Attention of float32 ``q`` over the whole sequence, whose keys and values ``k``/``v``
    are split over ``mesh`` (1-D) as balance.py splits them; the sequence is dim -2."""
    p = get_platform()
    cp, rank = mesh.size(), mesh.get_local_rank(0)
    k_shape, v_shape = p.shape(k), p.shape(v)
    k_numel = math.prod(k_shape)
    travelling = p.cat([p.reshape(k, (-1,)), p.reshape(v, (-1,))], 0)
    chunk = p.shape(q)[-2] // 2
    diagonal = causal_mask(np.arange(chunk), np.arange(chunk)) if is_causal else None
    mine = chunk_ids(rank, cp)
    # one list of blocks per query piece: the whole local queries, or each causal chunk
    pieces = [p.narrow(q, -2, i * chunk, chunk) for i in range(2)] if is_causal else [q]
    blocks: list = [[] for _ in pieces]
    for step in range(cp):
        if step:
            travelling = ring_shift(travelling, mesh)
        keys = p.reshape(p.narrow(travelling, 0, 0, k_numel), k_shape)
        values = p.reshape(p.narrow(travelling, 0, k_numel, math.prod(v_shape)), v_shape)
        if not is_causal:
            blocks[0].append(block_attention(q, keys, values, scale))
            continue
        for q_piece, q_chunk, piece_blocks in zip(pieces, mine, blocks):
            for j, k_chunk in enumerate(chunk_ids((rank - step) % cp, cp)):
                if k_chunk > q_chunk:
                    continue
                piece_blocks.append(block_attention(
                    q_piece, p.narrow(keys, -2, j * chunk, chunk),
                    p.narrow(values, -2, j * chunk, chunk), scale,
                    diagonal if k_chunk == q_chunk else None))
    outs = [merge(piece_blocks) for piece_blocks in blocks]
    return outs[0] if len(outs) == 1 else p.cat(outs, -2)
