"""Fused all-reduce buckets: one flat buffer, one SUM all-reduce, one group.

[Note: buckets]
After a unit's reduce-scatter, the outputs of all its sharded parameters already sit in one
flat buffer (param_group.py): that buffer is the unit's bucket on its replicate group, and
one all-reduce reduces it, never one per parameter. The unit's unsharded (small)
parameters form a second bucket on the whole data-parallel group (they skip the
reduce-scatter); its buffer is all-reduced together with the other units' small buckets,
once per backward (joined_all_reduce.py). Collectives SUM; scaling happened before
(reduce_op.py).

[Note: deferred all-reduce]
With ``set_requires_all_reduce(False)`` a micro-batch's bucket is not all-reduced: it is
added to ``deferred`` (kept by the bucket, across micro-batches). The next all-reduce that
runs folds ``deferred`` into its buffer first, so every micro-batch's gradient is all-reduced
exactly once: never dropped, never counted twice. Gradients already delivered to a
parameter (an earlier, completed step) were all-reduced already and are never folded.
"""

from __future__ import annotations

from typing import Any


class FusedAllReduce:
    """The all-reduce bucket of one unit on one group, with its deferred gradients."""

    def __init__(self, platform: Any, group: Any, group_size: int, dim: str):
        self.platform = platform
        self.group = group
        self.group_size = group_size
        self.dim = dim
        self.deferred = None

    def defer(self, buffer: Any) -> None:
        self.deferred = buffer if self.deferred is None else self.platform.add(self.deferred, buffer)

    def discard_deferred(self) -> None:
        """Forget the deferred gradients (an aborted iteration's, see reset_iter_state)."""
        self.deferred = None

    def fold_deferred(self, buffer: Any) -> Any:
        """``buffer`` plus the deferred gradients, which are then no longer held here."""
        if self.deferred is not None:
            buffer = self.platform.add(buffer, self.deferred)
            self.deferred = None
        return buffer

    def issue(self, buffer: Any, async_op: bool):
        """Fold deferred gradients in, start the all-reduce; return (buffer, handle)."""
        buffer = self.fold_deferred(buffer)
        if self.group_size == 1:
            return buffer, None
        handle = self.platform.all_reduce(buffer, self.group, op="sum", async_op=async_op, dim=self.dim)
        return buffer, handle
