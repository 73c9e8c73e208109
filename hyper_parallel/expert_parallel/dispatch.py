"""Token dispatch and combine of expert parallelism: each token row travels to the rank
holding its expert and its result comes back to where it was, both differentiable.

[Note: the order of the rows]
The experts module receives the rows of this rank's tokens grouped by global expert
(expert 0's rows first, torchtitan's ``GroupedExperts`` input) and the number of rows per
global expert. With ``E`` experts over ``ep`` ranks, rank ``r`` holds experts
``r*E/ep .. (r+1)*E/ep - 1``, so the rows for one destination rank are one contiguous run,
and one all-to-all on dim-0 rows (``autograd_collectives.all_to_all``, whose backward is
the reverse all-to-all) moves them. The split sizes come from the per-expert counts,
exchanged first (not differentiable): rank ``r`` learns, for every source ``s`` and local
expert ``e``, how many rows arrive (``received[s, e]``). The rows arrive ordered by source,
then by local expert; the local experts want them grouped by local expert, so they are
permuted to (expert, source) order before the experts run and back to (source, expert)
order after, then the reverse all-to-all returns each row to its source, in the order the
source sent it. The permutation moves runs of rows (``narrow`` and ``cat``, differentiable
on every framework), and a run of no rows is skipped: an expert no token chose, on any
rank, is equal tokens never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.autograd_collectives import all_to_all, exchange_counts
from hyper_parallel.platform import get_platform


@dataclass(frozen=True)
class Routed:
    """One dispatch, as its combine undoes it: rows sent to each rank, rows received from
    each, and ``received[s, e]`` (source rank, local expert)."""

    input_splits: tuple
    output_splits: tuple
    received: Any  # numpy (ep, local experts) int64


def _runs(rows: Any, counts: np.ndarray, order: list) -> Any:
    """The runs of ``rows`` (consecutive, of ``counts`` rows each, in C order of
    ``counts``) concatenated in ``order`` (their indices into ``counts.flat``)."""
    p = get_platform()
    starts = np.concatenate([[0], np.cumsum(counts.ravel())[:-1]])
    pieces = [p.narrow(rows, 0, int(starts[i]), int(counts.flat[i]))
              for i in order if counts.flat[i]]
    if len(pieces) <= 1:
        return rows  # one run of rows or none: already in order
    return p.cat(pieces, 0)


def dispatch(x: Any, num_tokens_per_expert: Any, mesh: Any) -> tuple:
    """``(local rows, local counts, Routed)``: this rank's rows ``x`` (grouped by global
    expert, ``num_tokens_per_expert`` of each) sent to their experts' ranks over the 1-D
    ``mesh``; returns the rows this rank's experts compute, grouped by local expert, and
    the number of rows per local expert (a tensor of the counts' dtype)."""
    p = get_platform()
    ep = mesh.size()
    counts = np.asarray(p.to_numpy(num_tokens_per_expert)).astype(np.int64).ravel()
    local_experts = counts.size // ep
    received = exchanged(counts, mesh).reshape(ep, local_experts)
    routed = Routed(tuple(int(n) for n in counts.reshape(ep, local_experts).sum(1)),
                    tuple(int(n) for n in received.sum(1)), received)
    arrived = all_to_all(x, list(routed.input_splits), list(routed.output_splits), mesh)
    # (source, expert) -> (expert, source)
    order = [s * local_experts + e for e in range(local_experts) for s in range(ep)]
    rows = _runs(arrived, received, order)
    local_counts = p.cast(p.from_numpy(received.sum(0)), p.dtype_of(num_tokens_per_expert))
    return rows, local_counts, routed


def combine(rows: Any, routed: Routed, mesh: Any) -> Any:
    """The experts' output ``rows`` (grouped by local expert, as ``dispatch`` gave them)
    back on the ranks that sent them, each rank's rows in the order it sent them."""
    ep, local_experts = routed.received.shape
    by_expert = np.ascontiguousarray(routed.received.T)  # the runs as they are now
    # (expert, source) -> (source, expert)
    order = [e * ep + s for s in range(ep) for e in range(local_experts)]
    back = _runs(rows, by_expert, order)
    return all_to_all(back, list(routed.output_splits), list(routed.input_splits), mesh)


def exchanged(counts: np.ndarray, mesh: Any) -> np.ndarray:
    """Per-expert row counts (``E`` ints, grouped by destination rank) exchanged: row
    ``s`` of the result holds what source rank ``s`` sends to this rank's experts."""
    p = get_platform()
    received = exchange_counts(p.from_numpy(counts), mesh)
    return np.asarray(p.to_numpy(received)).astype(np.int64)
