"""All-to-all attention (DeepSpeed's Ulysses): heads traded for sequence, and back.

[Note: heads <-> sequence]
Attention is independent per head. So instead of passing keys and values around, each rank
sends heads [j H/cp, (j+1) H/cp) of its sequence share to rank j (one all-to-all per query,
key and value): rank j then holds its cp-th of the heads over the whole sequence, attends
with one plain attention, and a reverse all-to-all returns each rank the output of all heads
for its own share. Two exchanges of activations each way, whatever cp, against cp - 1 ring
steps; it needs the heads to divide by cp. The whole sequence arrives in rank order, each
rank's share in its round-robin chunks (balance.py), so a causal mask is built from those
positions. The exchanges are ``all_to_all`` of autograd_collectives.py, whose backward is the
reverse exchange.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.autograd_collectives import all_to_all
from hyper_parallel.context_parallel.balance import positions
from hyper_parallel.context_parallel.blocks import block_attention, causal_mask
from hyper_parallel.platform import get_platform


def _heads_to_sequence(x: Any, mesh: Any) -> Any:
    """(B, H, L, D) of this rank's share -> (B, H/cp, cp*L, D) of its heads, every share."""
    p = get_platform()
    cp = mesh.size()
    b, h, length, d = p.shape(x)
    rows = p.contiguous(p.movedim(p.reshape(x, (b, cp, h // cp, length, d)), 1, 0))
    rows = p.reshape(rows, (cp * b * (h // cp) * length, d))
    split = [b * (h // cp) * length] * cp
    received = p.reshape(all_to_all(rows, split, split, mesh), (cp, b, h // cp, length, d))
    return p.reshape(p.contiguous(p.movedim(received, 0, 2)), (b, h // cp, cp * length, d))


def _sequence_to_heads(x: Any, mesh: Any) -> Any:
    """``_heads_to_sequence``'s reverse: (B, H/cp, cp*L, D) -> (B, H, L, D)."""
    p = get_platform()
    cp = mesh.size()
    b, heads, whole, d = p.shape(x)
    length = whole // cp
    rows = p.contiguous(p.movedim(p.reshape(x, (b, heads, cp, length, d)), 2, 0))
    rows = p.reshape(rows, (cp * b * heads * length, d))
    split = [b * heads * length] * cp
    received = p.reshape(all_to_all(rows, split, split, mesh), (cp, b, heads, length, d))
    return p.reshape(p.contiguous(p.movedim(received, 0, 1)), (b, cp * heads, length, d))


def all_to_all_attention(q: Any, k: Any, v: Any, is_causal: bool, scale: float,
                         mesh: Any) -> Any:
    """Attention of float32 ``q`` (B, H, L, D) over the whole sequence split over ``mesh``."""
    cp = mesh.size()
    whole_q, whole_k, whole_v = (_heads_to_sequence(t, mesh) for t in (q, k, v))
    mask = None
    if is_causal:
        chunk = get_platform().shape(q)[-2] // 2
        order = np.concatenate([positions(r, cp, chunk) for r in range(cp)])
        mask = causal_mask(order, order)
    out, _ = block_attention(whole_q, whole_k, whole_v, scale, mask)
    return _sequence_to_heads(out, mesh)
