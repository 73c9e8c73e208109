"""One unit's gradients on their way from full to sharded, in the order they travel.

[Note: the path of a gradient]
``reduce_gradients`` (called by the unit's unshard node in backward) makes one
``UnitReduction`` per parameter group of the unit (one per mesh, placement.py), each over
its own groups, and runs, per leg of the group (param_group.py: the parameters that share
a collective):

1. layout: each full gradient in the reduce dtype, cut into one piece per rank of the
   shard group (``FSDPParam.gradient_pieces``: views, zeros for padding, no copy);
2. reduce-scatter over the shard group, SUM, pre-scaled once (``ReducePlan.pre_scale``),
   async; an unsharded (small) leg skips it: its gradients, concatenated, are its buffer;
3. ``finish_reduce_scatter``: wait, then post-scale (``ReducePlan.post_scale``, here and
   nowhere else), before any all-reduce, so a deferred sum stays linear;
4. ``start_all_reduce``: fold in the gradients deferred by ``set_requires_all_reduce(False)``
   and all-reduce (SUM) over the replicate group (HSDP; a small leg: over the whole
   data-parallel group), async; or defer the buffer instead;
5. deliver, leg by leg, as soon as its reduction is complete (``deliver_completed``, then
   ``finish``): ``Platform.write_grad`` of each parameter's shard (torch: into ``.grad``
   and the post-accumulate-grad hooks; MindSpore: into the zeros ``value_and_grad``
   returned), or into ``main_grad``. A synchronous reduction without placeholders returns
   the shards instead, for the unit's backward to return (iteration.py, "gradients
   returned from backward").

The IterationContext (iteration.py) drives steps 3 to 5 so that one reduce-scatter and one
all-reduce stay in flight over the next unit's backward, and drains everything at the end
of backward. Synchronous collectives go through the same steps, so both modes produce
bitwise-identical gradients. Every collective SUMs and every division is an explicit
multiplication (reduce_op.py explains why).

[Note: unused parameters]
Where backward gives None for a full parameter nothing used (``Capabilities.
reports_unused_grads``, torch), such a parameter gets no gradient, as in a single process
over the global batch and in FSDP2, if no rank's backward reached it: otherwise an
optimizer with weight decay or moments moves it where the reference leaves it alone. A rank
that did not use it still takes part in every collective with zeros, so ranks that used
different parameters (experts no token was routed to on one rank) stay in step. Whether any
rank used it travels with the gradients: one leg's buffer (``_flag_leg``, one that is
concatenated anyway where there is one) of each parameter group carries one count per
parameter of the group after its padded pieces, a 1 from each rank that used it, summed by
the same reduce-scatter and all-reduce (and deferred sum) as the gradients, so over the
group's own mesh; a count of 0 is delivered as nothing. Only a
rank whose own backward missed a parameter reads the counts back (a wait for the device on
CUDA); a rank that used every parameter knows each was used. With gradient sync off, a
parameter counts as used if any accumulated backward used it.

[Note: deferred all-reduce]
With ``set_requires_all_reduce(False)`` a micro-batch's buffer is not all-reduced: it is
added to the leg's ``ReplicateBucket.deferred`` (kept across micro-batches). The next
all-reduce folds it in first, so every micro-batch's gradient is all-reduced exactly once:
never dropped, never counted twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hyper_parallel.fully_shard.reduce_op import ReducePlan, plan_reduction, resolve_reduce_dtype

if TYPE_CHECKING:
    from hyper_parallel.fully_shard.param_group import FSDPParamGroup, Leg
    from hyper_parallel.fully_shard.state import FSDPState
    from hyper_parallel.platform import Handle, Platform

logger = logging.getLogger("hyper_parallel.fully_shard")


class ReplicateBucket:
    """A leg's all-reduce group, with the gradients deferred from earlier micro-batches."""

    def __init__(self, platform: Platform, group: Any, group_size: int, dim: str):
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

    def issue(self, buffer: Any, async_op: bool) -> tuple:
        """Fold deferred gradients into ``buffer`` and start its all-reduce:
        ``(buffer, handle or None)``."""
        if self.deferred is not None:
            buffer, self.deferred = self.platform.add(buffer, self.deferred), None
        if self.group_size == 1:
            return buffer, None
        handle = self.platform.all_reduce(buffer, self.group, op="sum", async_op=async_op,
                                          dim=self.dim)
        return buffer, handle


@dataclass
class LegGradients:
    """One leg's gradients on their way (its buffer once reduce-scattered)."""

    leg: Leg
    buffer: Any              # the core's own memory: scaling may overwrite it
    handle: Handle | None    # the collective in flight, if any
    deferred: bool = False   # parked in the bucket: nothing to deliver this time
    settled: bool = False    # delivered or deferred: nothing left to do


def reduce_gradients(state: FSDPState, full_grads: list) -> list:
    """Start reducing one unit's full gradients (its unshard node's backward), one
    reduction per parameter group, each over its own mesh; return what autograd receives
    for the local shards: placeholders, the reduced shards themselves (see the note), or
    Nones while gradient sync is off (accumulated unsharded here)."""
    p, first = state.platform, state.groups[0]  # every group has the unit's mp_policy
    present = [g for g in full_grads if g is not None]  # None: unused (see the note)
    grad_dtype = p.dtype_of(present[0]) if present else state.params[0].orig_dtype
    dtype = resolve_reduce_dtype(first.reduce_dtype, first.param_dtype, grad_dtype)
    full_grads = [None if g is None else p.cast(g, dtype) for g in full_grads]
    if state.unsharded_grads is not None:
        full_grads = [_accumulate(p, acc, g) for acc, g in zip(state.unsharded_grads, full_grads)]
        state.unsharded_grads = None
    if not state.requires_gradient_sync:
        logger.debug("%s: gradient sync off, accumulating unsharded gradients", state.name)
        state.unsharded_grads = full_grads
        return [None] * len(full_grads)
    sync = state.iteration.sync_collectives
    returned = sync and p.capabilities.returns_grads_from_backward and not state.to_main_grad
    placeholders = None if returned else [fp.grad_placeholder() for fp in state.params]
    used = ([g is not None for g in full_grads] if p.capabilities.reports_unused_grads
            else None)
    if state.reduce_scatter_unused_params:  # FSDP2's: every parameter gets a gradient
        used = None
    nothing = [None] * len(state.groups)
    reductions = []
    for group, grads, group_placeholders, group_used in zip(
            state.groups, state.per_group(full_grads),
            nothing if placeholders is None else state.per_group(placeholders),
            nothing if used is None else state.per_group(used)):
        plan = plan_reduction(group.mesh_info.data_parallel_size, reduce_op=state.reduce_op,
                              custom_divide_factor=state.divide_factor,
                              scaling_factor=state.scaling_factor,
                              reduce_in_fp16=dtype == p.dtype("float16"),
                              force_sum=state.force_sum_reduction)
        reductions.append(UnitReduction(state.name, state.path, group, grads, dtype, plan,
                                        group_placeholders, state.to_main_grad,
                                        async_op=not sync,
                                        requires_all_reduce=state.requires_all_reduce,
                                        used=group_used, hook=state.all_reduce_hook))
    delivered = state.iteration.enqueue(reductions)
    return delivered if returned else placeholders


def _accumulate(platform: Platform, acc: Any, grad: Any) -> Any:
    if acc is None or grad is None:
        return grad if acc is None else acc
    return platform.add(acc, grad)


def _flag_leg(group: FSDPParamGroup) -> Leg:
    """The leg whose buffer carries the group's usage counts (see the note "unused
    parameters"): one whose parts are concatenated anyway (the small leg, or a fused leg
    of several parameters) where there is one, so no own leg's gradient is copied for it."""
    for leg in group.legs:
        if not leg.sharded or len(leg.params) > 1:
            return leg
    return group.legs[-1]


class UnitReduction:
    """Reduce the full gradients of one parameter group of a unit for one backward, over
    the group's mesh (steps 1 and 2 on creation)."""

    def __init__(self, name: str, path: str, group: FSDPParamGroup, full_grads: list, dtype: Any,
                 plan: ReducePlan, placeholders: list | None, to_main_grad: bool, async_op: bool,
                 requires_all_reduce: bool = True, used: list | None = None,
                 hook: Any = None):
        self.name = name
        self.path = path  # the unit's module path, which errors name (watchdog.py)
        self.group = group
        self.plan = plan
        self.placeholders = placeholders
        self.to_main_grad = to_main_grad
        self.async_op = async_op
        self.requires_all_reduce = requires_all_reduce  # False: step 4 defers (HSDP)
        self.hook = hook  # set_all_reduce_hook: called on each leg's reduced gradients
        p, info = group.platform, group.mesh_info
        by_param = {id(fp): g for fp, g in zip(group.params, full_grads)}
        # ``used``: whether this rank's backward reached each parameter; None where the
        # platform cannot tell (every parameter is delivered), see the note
        flag_leg = _flag_leg(group) if used is not None else None
        if flag_leg is not None:
            counts = p.cast(p.from_numpy(np.array(used, dtype=np.float32)), dtype)
        self.flag_leg: LegGradients | None = None
        # only a rank whose backward missed a parameter reads the counts back (on CUDA a
        # wait for the device): where this rank used it, some rank did
        self.reads_counts = used is not None and not all(used)
        self.unused: set = set()  # ids of the FSDPParams no rank used, once counted
        self.leg_grads = []
        for leg in group.legs:
            per_param = [fp.gradient_pieces(by_param[id(fp)], dtype) for fp in leg.params]
            # rank-major: rank r's padded piece of every parameter, in order
            pieces = [[part for param_pieces in per_param for part in param_pieces[rank]]
                      for rank in range(leg.params[0].shard_size)]
            if leg.sharded and info.shard_size > 1:
                if plan.pre_scale != 1.0:
                    pieces = [[p.scale(part, plan.pre_scale) for part in parts] for parts in pieces]
                if leg is flag_leg:  # every rank's piece: each rank's counts summed
                    pieces = [[*parts, counts] for parts in pieces]
                handle = p.reduce_scatter(pieces, info.reduce_scatter_group, async_op=async_op,
                                          dim="shard")
                self.leg_grads.append(LegGradients(leg, None, handle))
            else:
                # no reduce-scatter: a buffer of the core's own, all-reduced in place
                parts = [part for parts in pieces for part in parts]
                flat = p.cat([*parts, counts] if leg is flag_leg else parts, 0)
                if plan.pre_scale != 1.0:
                    flat = p.scale(flat, plan.pre_scale, may_overwrite=True)
                self.leg_grads.append(LegGradients(leg, flat, None))
            if leg is flag_leg:
                self.flag_leg = self.leg_grads[-1]
        if group.sharded_legs and info.shard_size > 1:
            logger.debug("%s: reduce-scatter issued (%s)", name, "async" if async_op else "sync")

    def finish_reduce_scatter(self) -> None:
        """Step 3: wait the reduce-scatters and post-scale every leg's buffer."""
        p = self.group.platform
        for lg in self.leg_grads:
            if lg.handle is not None:
                lg.buffer, lg.handle = lg.handle.wait(), None
            if self.plan.post_scale != 1.0:  # the one place a gradient is post-scaled
                lg.buffer = p.scale(lg.buffer, self.plan.post_scale, may_overwrite=True)

    def start_all_reduce(self) -> None:
        """Step 4: all-reduce each leg's buffer over its bucket's group, or defer it."""
        replicated = self.group.mesh_info.replicate_size > 1
        for lg in self.leg_grads:
            bucket = lg.leg.bucket
            if replicated and not self.requires_all_reduce:
                bucket.defer(lg.buffer)
                lg.deferred = True
                logger.debug("%s: %s all-reduce deferred", self.name, bucket.dim)
                continue
            lg.buffer, lg.handle = bucket.issue(lg.buffer, self.async_op)
            if lg.handle is not None:
                logger.debug("%s: %s all-reduce issued", self.name, bucket.dim)

    @property
    def in_flight(self) -> bool:
        """Whether a leg still waits for its all-reduce (or has not been advanced yet)."""
        return not all(lg.settled for lg in self.leg_grads)

    def deliver_completed(self) -> None:
        """Step 5 for the legs whose reduction is complete without waiting for anything."""
        self._deliver(wait=False)

    def finish(self) -> list | None:
        """Step 5 for the rest: wait the all-reduces still in flight and deliver, through
        ``write_grad``, or, without placeholders, as the returned list (``params`` order)
        that backward hands to the user, zeros where nothing is delivered now (a deferred
        bucket, a frozen parameter)."""
        return self._deliver(wait=True)

    def _deliver(self, wait: bool) -> list | None:
        p = self.group.platform
        delivered = {}
        # the leg with the usage counts first: the others' delivery needs them
        for lg in sorted(self.leg_grads, key=lambda lg: lg is not self.flag_leg):
            if lg.settled or (lg.handle is not None and not wait):
                if lg is self.flag_leg and not lg.settled:
                    break
                continue
            if lg.handle is not None:
                lg.handle.wait()
                lg.handle = None
            lg.settled = True
            if lg.deferred:
                continue
            if self.hook is not None:
                self._run_hook(lg)
            if lg is self.flag_leg and self.reads_counts:
                counts = p.to_numpy(p.cast(p.narrow(lg.buffer, 0, lg.leg.total_numel,
                                                    len(self.group.params)),
                                           p.dtype("float32")))  # numpy has no bfloat16
                self.unused = {id(fp) for fp, n in zip(self.group.params, counts) if n == 0}
            for fp, offset in zip(lg.leg.params, lg.leg.offsets):
                if p.param_requires_grad(fp.sharded_param) and id(fp) not in self.unused:
                    delivered[id(fp)] = fp.sharded_grad_from(lg.buffer, offset)
        if delivered:
            logger.debug("%s: %d gradient shards delivered", self.name, len(delivered))
        if self.placeholders is None:
            returned = [delivered.get(id(fp)) for fp in self.group.params]
            returned = [g if g is not None else fp.grad_placeholder()
                        for fp, g in zip(self.group.params, returned)]
            self.placeholders = returned
            return returned
        for fp, placeholder in zip(self.group.params, self.placeholders):
            if id(fp) in delivered:
                p.write_grad(fp.sharded_param, placeholder, delivered[id(fp)], self.to_main_grad)
        return None

    def _run_hook(self, lg: LegGradients) -> None:
        """``set_all_reduce_hook``: the hook gets the leg's reduced gradients (the usage
        counts left out) and may change them in place (torch) or return new ones."""
        p = self.group.platform
        numel = lg.leg.total_numel
        whole = lg is not self.flag_leg
        grads = lg.buffer if whole else p.narrow(lg.buffer, 0, 0, numel)
        returned = self.hook(grads)
        if returned is None:
            return
        if tuple(p.shape(returned)) != tuple(p.shape(grads)):
            raise ValueError(f"{self.name}: the all-reduce hook returned a tensor of shape "
                             f"{tuple(p.shape(returned))}; it must return None or a tensor of "
                             f"the shape it was given, {tuple(p.shape(grads))}")
        tail = p.narrow(lg.buffer, 0, numel, p.shape(lg.buffer)[0] - numel)
        lg.buffer = returned if whole else p.cat([returned, tail], 0)

    def abandon(self) -> None:
        """Wait the collectives still in flight and deliver nothing (an aborted
        iteration's, see reset_iter_state)."""
        for lg in self.leg_grads:
            if lg.handle is not None:
                lg.handle.wait()
                lg.handle = None
            lg.settled = True
