"""Which positions of the sequence each context-parallel rank holds.

[Note: torch's round-robin of 2 x cp chunks]
Under a causal mask, position t attends to t + 1 keys: split the sequence into cp
consecutive pieces and the last rank does cp times the first one's work. torch's
``context_parallel`` (its head-tail load balancer) cuts the sequence into 2 x cp chunks
instead and gives rank r chunks r and 2cp-1-r: a rank's early chunk is as cheap as its late
chunk is dear, and every rank attends to the same number of (query, key) chunk pairs
(2cp + 1 of them). The same layout is used without a mask (attention without a mask does not
depend on the order), so one split serves every attention of a model; the ring and the
all-to-all attention read each rank's chunk ids from here to build their masks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.platform import get_platform


def chunk_ids(rank: int, cp: int) -> tuple:
    """The two chunks (of 2 x ``cp``) rank ``rank`` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def positions(rank: int, cp: int, chunk: int) -> np.ndarray:
    """The sequence positions of rank ``rank``'s ``2 * chunk`` local elements."""
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(rank, cp)])


def split_error(length: int, cp: int) -> str | None:
    """Why a sequence of ``length`` cannot be split over ``cp`` ranks (None: it can)."""
    if length % (2 * cp):
        return (f"a sequence of {length} cannot be split over {cp} context-parallel ranks: "
                f"it is cut into 2 x cp = {2 * cp} equal chunks (torch's round-robin, which "
                f"balances a causal mask), so its length must be a multiple of {2 * cp}; "
                f"pad the sequence or choose a degree that divides it")
    return None


def local_share(tensor: Any, dim: int, rank: int, cp: int) -> Any:
    """Rank ``rank``'s part of ``tensor`` along ``dim``: its two chunks, in new memory."""
    p = get_platform()
    chunk = p.shape(tensor)[dim] // (2 * cp)
    return p.cat([p.narrow(tensor, dim, c * chunk, chunk) for c in chunk_ids(rank, cp)], dim)
