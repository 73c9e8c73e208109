"""The unsharded parameters' gradients of every unit, all-reduced together once per backward.

[Note: why join the small buckets]
A parameter below ``shard_threshold_bytes`` (a bias, a norm's weight) stays whole on every
rank and its gradient is all-reduced over the data-parallel group. Issued per unit, that is
one collective of a few KiB per unit per step, and a collective costs a fixed launch
whatever its size (~0.4 ms of CPU with gloo, ~0.7 ms with mccl, docs/platforms.md): with
one per unit, keeping small parameters whole saved the copies and collectives of the
sharded path and spent the same again here. So each unit's small buffer (scaled already,
reduce_op.py) joins this bucket instead, and when the backward drains (iteration.py) one
all-reduce per (group, dtype) reduces them all; each unit then delivers its part as it
delivers any gradient (``UnitReduction.deliver_joined``). A SUM of a concatenation is the
concatenation of the SUMs: the gradients are the ones the per-unit all-reduces gave.
On the 2-core CPU machines even the joined form did not make small parameters kept whole
faster than sharded ones (docs/gradient-pipeline.md, "Small parameters"): the default
threshold stays 0, and this serves the users who set one.

Deferred micro-batches (``set_requires_all_reduce(False)``) stay in the unit's own bucket
and are folded into its buffer when it joins (all_reduce.py), so each is all-reduced once.
Only the unsharded legs join: a sharded leg's all-reduce is large and overlaps the next
unit's backward, where waiting for the drain would expose it.
"""

from __future__ import annotations

from typing import Any


class _Batch:
    """The buffers waiting for one all-reduce: one group, one dtype."""

    def __init__(self, group: Any, group_size: int, dim: str):
        self.group = group
        self.group_size = group_size
        self.dim = dim
        self.members: list = []  # [(UnitReduction, its _LegInFlight)] in join order
        self.reduced = None
        self.handle = None


class JoinedAllReduce:
    """The small buckets of one root's units, joined until the backward drains."""

    def __init__(self, platform: Any):
        self.platform = platform
        self._batches: dict = {}  # (id(group), dtype) -> _Batch, in first-join order

    def __bool__(self) -> bool:
        return bool(self._batches)

    def join(self, reduction: Any, leg: Any) -> None:
        """Hold ``leg.buffer`` (the unit's scaled small gradients) for the joined all-reduce."""
        bucket = leg.leg.bucket
        key = (id(bucket.group), self.platform.dtype_of(leg.buffer))
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = _Batch(bucket.group, bucket.group_size, bucket.dim)
        batch.members.append((reduction, leg))

    def issue(self, async_op: bool) -> None:
        """One all-reduce per batch over the concatenation of its buffers. Every rank joins
        the same units in the same order (their backward order), so the calls match."""
        p = self.platform
        for batch in self._batches.values():
            buffers = [leg.buffer for _, leg in batch.members]
            batch.reduced = p.cat(buffers, 0)  # cat copies: the all-reduce writes in place
            if batch.group_size > 1:
                batch.handle = p.all_reduce(batch.reduced, batch.group, op="sum",
                                            async_op=async_op, dim=batch.dim)

    def finish(self) -> None:
        """Wait the all-reduces and hand each unit its stretch of the result."""
        p = self.platform
        batches, self._batches = self._batches, {}
        for batch in batches.values():
            if batch.handle is not None:
                batch.handle.wait()
            offset = 0
            for reduction, leg in batch.members:
                numel = leg.leg.total_numel
                reduction.deliver_joined(leg, p.narrow(batch.reduced, 0, offset, numel))
                offset += numel

    def abandon(self) -> None:
        """Wait any all-reduce already issued and drop every buffer unreduced (an aborted
        iteration's, see reset_iter_state)."""
        batches, self._batches = self._batches, {}
        for batch in batches.values():
            if batch.handle is not None:
                batch.handle.wait()
