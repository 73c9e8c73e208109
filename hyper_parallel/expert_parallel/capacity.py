"""The capacity factor of ``ExpertParallel``: how many rows each expert takes from one rank
in one call, and what becomes of the rows beyond.

[Note: dropped rows]
Before the dispatch, each rank caps the rows it sends to each expert in one call of the
experts at ``C = ceil(capacity_factor * R / num_experts)``, ``R`` being the rows it routes
in that call (its tokens times top-k). Of an expert's rows, the first ``C`` in the order
the layer gives them (for rows sorted stably by expert: the earlier tokens) are sent; the
rest are dropped: never sent, not computed, and their output rows are zero, so a token
whose choice was dropped gets nothing from that expert (its other choices and the
residual stream carry it on). The gradient of a dropped row is zero too. The cap is each
rank's own, decided from its rows alone (no exchange): which rows drop depends on the rows
a rank holds, so the same model in one process on the whole batch drops other rows, while
``ExpertParallel`` over a 1-rank mesh on each data-parallel rank drops the same ones.
``None`` (the default) drops nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.platform import get_platform


def check_capacity_factor(capacity_factor: Any) -> None:
    if capacity_factor is None:
        return
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
            or not capacity_factor > 0:
        raise ValueError(f"ExpertParallel(capacity_factor={capacity_factor!r}): give a "
                         f"positive number (the rows each expert takes from one rank, as a "
                         f"multiple of an even share), or None to drop no row")


@dataclass(frozen=True)
class Capped:
    """One call's cap: each expert's rows as given and as sent."""

    given: Any   # numpy (num_experts,) int64
    sent: Any


def cap(rows: Any, counts: Any, capacity_factor: float) -> tuple:
    """``(the rows sent, their per-expert counts, Capped)`` of ``rows`` grouped by expert,
    ``counts`` per expert, under ``capacity_factor`` (see the module note)."""
    p = get_platform()
    given = np.asarray(p.to_numpy(counts)).astype(np.int64).ravel()
    capacity = math.ceil(capacity_factor * int(given.sum()) / given.size)
    sent = np.minimum(given, capacity)
    capped = Capped(given, sent)
    if (sent == given).all():
        return rows, counts, capped
    starts = np.concatenate([[0], np.cumsum(given)[:-1]])
    pieces = [p.narrow(rows, 0, int(s), int(n)) for s, n in zip(starts, sent) if n]
    kept = p.cat(pieces, 0) if pieces else p.narrow(rows, 0, 0, 0)
    return kept, p.cast(p.from_numpy(sent), p.dtype_of(counts)), capped


def uncap(rows: Any, capped: Capped) -> Any:
    """The output of every given row: ``rows`` (the sent rows' outputs) with a zero row in
    place of each dropped one."""
    p = get_platform()
    if (capped.sent == capped.given).all():
        return rows
    width = int(p.shape(rows)[1])
    starts = np.concatenate([[0], np.cumsum(capped.sent)[:-1]])
    pieces = []
    for start, sent, given in zip(starts, capped.sent, capped.given):
        if sent:
            pieces.append(p.narrow(rows, 0, int(start), int(sent)))
        if given > sent:
            pieces.append(p.zeros((int(given - sent), width), p.dtype_of(rows)))
    return p.cat(pieces, 0)
