"""One unit's gradients on their way from full to sharded, in three stages.

[Note: the stages and who drives them]
1. ``UnitReduction(...)`` (the unit's post-backward): lay the gradients out as one piece
   per rank (param_group.py), scale once (``pre_scale``), issue the reduce-scatter over
   the shard group (async).
2. ``finish_reduce_scatter`` + ``start_all_reduce`` (driven by the IterationContext when the
   next unit's post-backward runs, or at the end of backward): wait the reduce-scatter
   and apply ``post_scale`` to every leg's result (here, and nowhere else), then either
   issue the bucket's all-reduce over the replicate group (async) or defer the bucket
   (``set_requires_all_reduce(False)``).
3. Delivery, leg by leg, as soon as a leg's reduction is complete: ``deliver_completed``
   right after stage 2 (a leg with no all-reduce: plain FSDP), ``finish`` once the
   all-reduces were waited (the next advance, or the end of backward). Each gradient shard
   goes through ``Platform.write_grad`` (torch: accumulate into ``.grad`` and run the
   parameter's post-accumulate-grad hooks; MindSpore: fill the tensor that
   ``value_and_grad`` returned for it), or into ``main_grad``. A synchronous reduction
   without placeholders returns the shards instead, for the unit's backward to return
   (iteration.py, "gradients returned from backward"). A deferred leg delivers nothing; a
   small leg joined into the root's all-reduce is delivered by ``deliver_joined``.
Running every collective synchronously goes through the same three stages, so both modes
produce bitwise-identical gradients.
"""

from __future__ import annotations

import logging
from typing import Any

from hyper_parallel.fully_shard.joined_all_reduce import JoinedAllReduce
from hyper_parallel.fully_shard.param_group import FSDPParamGroup, Leg
from hyper_parallel.fully_shard.reduce_op import ReducePlan

logger = logging.getLogger("hyper_parallel.fully_shard")


class _LegInFlight:
    def __init__(self, leg: Leg, buffer: Any, handle: Any):
        self.leg = leg
        self.buffer = buffer  # the core's own memory: scaling may overwrite it
        self.handle = handle
        self.deferred = False
        self.joined = False  # in the root's joined all-reduce, delivered by deliver_joined
        self.settled = False  # delivered, deferred or joined: nothing left for this unit to do


class UnitReduction:
    """Reduce one unit's full gradients for one backward."""

    def __init__(self, name: str, path: str, group: FSDPParamGroup, full_grads: list, dtype: Any,
                 plan: ReducePlan, placeholders: list | None, to_main_grad: bool, async_op: bool,
                 joined: JoinedAllReduce):
        self.name = name
        self.path = path  # the unit's module path, which errors name
        self.group = group
        self.plan = plan
        self.placeholders = placeholders
        self.to_main_grad = to_main_grad
        self.async_op = async_op
        self.joined = joined
        p = group.platform
        by_param = {id(fp): g for fp, g in zip(group.params, full_grads)}
        self.legs = []
        for leg in group.legs:
            pieces = group.gradient_pieces(leg, by_param, dtype)
            if leg.sharded and group.mesh_info.shard_size > 1:
                if plan.pre_scale != 1.0:
                    pieces = [[p.scale(part, plan.pre_scale) for part in parts] for parts in pieces]
                handle = p.reduce_scatter(pieces, group.mesh_info.shard_group,
                                          async_op=async_op, dim="shard")
                flat = None  # handle.result (new memory, the core's own), once waited
            else:
                # no reduce-scatter: the bucket's buffer, the core's own (all-reduced in place)
                flat, handle = p.cat([part for parts in pieces for part in parts], 0), None
                if plan.pre_scale != 1.0:
                    flat = p.scale(flat, plan.pre_scale, may_overwrite=True)
            self.legs.append(_LegInFlight(leg, flat, handle))
        if group.sharded_legs and group.mesh_info.shard_size > 1:
            logger.debug("%s: reduce-scatter issued (%s)", name, "async" if async_op else "sync")

    def finish_reduce_scatter(self) -> None:
        p = self.group.platform
        for leg in self.legs:
            if leg.handle is not None:
                leg.buffer, leg.handle = leg.handle.wait(), None
            if self.plan.post_scale != 1.0:  # the one place a gradient is post-scaled
                leg.buffer = p.scale(leg.buffer, self.plan.post_scale, may_overwrite=True)

    def start_all_reduce(self, requires_all_reduce: bool) -> None:
        replicated = self.group.mesh_info.replicate_size > 1
        for leg in self.legs:
            if replicated and not requires_all_reduce:
                leg.leg.bucket.defer(leg.buffer)
                leg.deferred = True
                logger.debug("%s: %s all-reduce deferred", self.name, leg.leg.bucket.dim)
                continue
            if not leg.leg.sharded:
                leg.buffer = leg.leg.bucket.fold_deferred(leg.buffer)
                self.joined.join(self, leg)
                leg.joined = True
                continue
            leg.buffer, leg.handle = leg.leg.bucket.issue(leg.buffer, self.async_op)
            if leg.handle is not None:
                logger.debug("%s: %s all-reduce issued", self.name, leg.leg.bucket.dim)

    @property
    def in_flight(self) -> bool:
        """Whether a leg still waits for its all-reduce (or has not been advanced yet)."""
        return not all(leg.settled for leg in self.legs)

    def deliver_completed(self) -> None:
        """Deliver the legs whose reduction is complete without waiting for anything (after
        ``start_all_reduce``: the legs with no all-reduce in flight)."""
        self._deliver(wait=False)

    def finish(self) -> list | None:
        """Wait the all-reduces still in flight and deliver the remaining gradient shards:
        through ``write_grad``, or, without placeholders, as the returned list (``params``
        order) that backward hands to the user, a zero placeholder where nothing is
        delivered now (a deferred bucket, a frozen parameter, a joined leg:
        ``deliver_joined`` fills those later)."""
        return self._deliver(wait=True)

    def _deliver(self, wait: bool) -> list | None:
        p = self.group.platform
        delivered = {}
        for leg in self.legs:
            if leg.settled:
                continue
            if leg.handle is not None:
                if not wait:
                    continue
                leg.handle.wait()
                leg.handle = None
            leg.settled = True
            if leg.deferred or leg.joined:
                continue
            for fp, grad in zip(leg.leg.params, self.group.sharded_gradients(leg.leg, leg.buffer)):
                if p.param_requires_grad(fp.sharded_param):
                    delivered[id(fp)] = grad
        if delivered:
            logger.debug("%s: %d gradient shards delivered", self.name, len(delivered))
        if self.placeholders is None:
            returned = [delivered[id(fp)] if id(fp) in delivered else fp.grad_placeholder()
                        for fp in self.group.params]
            # a joined leg's entries are placeholders: deliver_joined fills them
            self.placeholders = returned
            return returned
        for fp, placeholder in zip(self.group.params, self.placeholders):
            if id(fp) in delivered:
                p.write_grad(fp.sharded_param, placeholder, delivered[id(fp)], self.to_main_grad)
        return None

    def abandon(self) -> None:
        """Wait the collectives still in flight and deliver nothing (an aborted
        iteration's, see reset_iter_state)."""
        for leg in self.legs:
            if leg.handle is not None:
                leg.handle.wait()
                leg.handle = None
            leg.settled = True

    def deliver_joined(self, leg: _LegInFlight, reduced: Any) -> None:
        """The joined all-reduce's stretch for ``leg``: deliver its gradients (after
        ``finish``, into the placeholders backward handed out)."""
        p = self.group.platform
        slot = {id(fp): i for i, fp in enumerate(self.group.params)}
        for fp, grad in zip(leg.leg.params, self.group.sharded_gradients(leg.leg, reduced)):
            if p.param_requires_grad(fp.sharded_param):
                p.write_grad(fp.sharded_param, self.placeholders[slot[id(fp)]], grad,
                             self.to_main_grad)
