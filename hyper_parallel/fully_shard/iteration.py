"""The per-root iteration context: what one forward/backward of one root model shares.

[Note: why not globals]
Every unit under one root points to the same IterationContext, created by the root at its
first forward. Two models wrapped independently have two roots and two contexts, so their
pending collectives, flags and final callbacks never mix. Nothing here is class-level.

[Note: roots]
The first unit whose forward runs (state.py) becomes the root: it creates the
IterationContext shared by every unit in its module tree, starts each iteration, and its
final callback reshards everything after backward. ``reshard_after_forward=None`` (the
default) means True for every unit but the root, whose backward comes first; an explicit
True on the root is honoured.

[Note: the overlap pipeline]
Unit N's reduce-scatter is issued (async) in its post-backward and becomes
``pending_reduce_scatter``. When unit N-1's post-backward issues its own, unit N's is
waited and its all-reduce issued (async) into ``pending_all_reduce``; unit N's gradients
that need no all-reduce (plain FSDP) are delivered then. Unit N's all-reduce is waited,
and the rest of its gradients delivered, when unit N-2's post-backward advances the
pipeline again. Each gradient is thus delivered during backward as soon as its reduction
is waited, while one reduce-scatter and one all-reduce stay in flight over the next
unit's compute. At the end of backward (the root's final callback) everything left is
drained, before the optimizer can see a gradient. ``HP_SYNC_COLLECTIVES=1`` in the
environment (read when the root initializes) runs every gradient-reduction collective
synchronously instead, for debugging (all-gathers issued early by a prefetch or
``unshard(async_op=True)`` stay async). Unset, it follows
``Capabilities.collectives_overlap_compute``: MindSpore on CPU, whose collectives do not
overlap compute, reduces synchronously; ``HP_SYNC_COLLECTIVES=0`` forces the pipeline there
too.

[Note: gradients returned from backward]
Where backward's return value is what the user receives (MindSpore ``value_and_grad``) and
a unit's reduction runs synchronously, its post-backward returns the reduced shards
themselves. Otherwise it returns zero placeholders that the drain fills in place: three
more full-shard operations per parameter (zeros, a snapshot, the copy).

[Note: implicit prefetch]
Each iteration records the order in which units start their forward. From the second
iteration on, a unit starting its forward issues the next unit's all-gather (async), and a
unit about to run its backward issues the re-gather of the unit before it in forward order
(the next to run backward), so communication overlaps compute as in FSDP2. The re-gather
fills the full parameters that unit used in the same root forward (``forward_fulls``, held
weakly, a new one per root forward, seen by that forward's backward hooks): where several
forwards ran before their backwards (a pipeline's microbatches), the next backward reads
those, not the latest forward's; none is issued where the unit's kept set will fill them
(state.py, "one kept set"), nor into a unit resharded since that forward (a backward's end,
an explicit ``reshard()``): the backward running may not reach it (a chunked loss's
backwards over the head alone), and the gather would be dropped unused. A unit's explicit
``set_modules_to_*_prefetch`` list replaces its implicit neighbour. Every rank records the
same order for the same model, so collectives stay in the same order.

With ``set_is_last_backward(False)`` the final callback leaves the queues alone; they are
drained by the next final callback of a last backward, or when the root's next forward
starts, whichever comes first.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import TYPE_CHECKING

from hyper_parallel.fully_shard.gradients import reduce_gradients

if TYPE_CHECKING:
    from hyper_parallel.fully_shard.full_params import FullParams
    from hyper_parallel.fully_shard.gradients import UnitReduction
    from hyper_parallel.fully_shard.state import FSDPState
    from hyper_parallel.platform import Platform

logger = logging.getLogger("hyper_parallel.fully_shard")


def _sync_collectives(platform: Platform) -> bool:
    """``HP_SYNC_COLLECTIVES`` when set ("0"/"" off, anything else on), else whether the
    platform's collectives cannot overlap compute anyway."""
    flag = os.environ.get("HP_SYNC_COLLECTIVES")
    if flag is None:
        return not platform.capabilities.collectives_overlap_compute
    return flag not in ("", "0")


class IterationContext:
    """All units of one root, in pre-order (root first), and their collectives in flight."""

    def __init__(self, platform: Platform, states: list[FSDPState]):
        self.platform = platform
        self.states = states
        self.root = states[0]
        self.sync_collectives = _sync_collectives(platform)
        self.pending_reduce_scatter: list = []  # one unit's reductions, one per group
        self.pending_all_reduce: list = []
        self._final_callback_queued = False
        self._forward_order: list = []       # units by first forward, this iteration
        self._seen: set = set()              # ids of _forward_order
        self._known_order: list = []         # the last complete iteration's order
        self._known_index: dict = {}
        self.forward_fulls = weakref.WeakValueDictionary()  # see the note "implicit prefetch"

    def begin_forward(self) -> None:
        """The root's forward starts a new iteration: finish reductions still in flight and
        drop full parameters left from the last one (unless kept on purpose)."""
        self.drain()
        if self._forward_order:
            self._known_order, self._forward_order = self._forward_order, []
            self._known_index = {id(s): i for i, s in enumerate(self._known_order)}
            self._seen = set()
        self.forward_fulls = weakref.WeakValueDictionary()
        for state in self.states:
            state.begin_iteration()
        self.keep_working_set()

    def keep_working_set(self) -> None:
        """Let the platform keep the memory a step's gathers will ask for again
        (``Platform.keep_released_memory``): the full parameters of every unit that keeps
        them through forward (the root, ``reshard_after_forward=False``), which the step
        holds at once anyway, plus the two largest units that reshard after forward (one
        computing, one prefetched). Asked again each iteration: the setting may change."""
        kept, resharded = 0, []
        for state in self.states:
            if not state.groups:
                continue
            gathered = sum(group.gathered_bytes for group in state.groups)
            if not state.reshards_after_forward:
                kept += gathered
            else:
                resharded.append(gathered)
        if self.platform.capabilities.can_release_storage:
            self.platform.keep_released_memory(kept + sum(sorted(resharded)[-2:]))

    @property
    def forwards_run(self) -> list:
        """The units whose forward ran this iteration, in order (collective_check.py)."""
        return self._forward_order

    def record_forward(self, state: FSDPState) -> None:
        if id(state) not in self._seen:
            self._seen.add(id(state))
            self._forward_order.append(state)

    def record_full_params(self, state: FSDPState, full: FullParams | None):
        """``state``'s forward in the root's current forward used ``full``; return the
        record of that forward (``forward_fulls``) for its backward hooks (see the note
        "implicit prefetch")."""
        if full is not None:
            self.forward_fulls[state] = full
        return self.forward_fulls

    def neighbours(self, state: FSDPState, step: int) -> list:
        """[the unit ``step`` places after ``state`` in the known forward order] or []."""
        index = self._known_index.get(id(state))
        if index is None or not 0 <= index + step < len(self._known_order):
            return []
        return [self._known_order[index + step]]

    def ensure_final_callback(self) -> None:
        """Queue ``finish_backward`` once per backward pass (call only during backward)."""
        if not self._final_callback_queued:
            self._final_callback_queued = True
            self.platform.queue_backward_final_callback(self.finish_backward)

    def enqueue(self, reductions: list[UnitReduction]) -> list | None:
        """A unit's reduce-scatters (one per parameter group) were issued: advance the unit
        issued before it. With synchronous collectives run all the unit's steps now and
        return what ``UnitReduction.finish`` returns, joined in group order."""
        if self.sync_collectives:
            delivered = []
            for reduction in reductions:
                reduction.finish_reduce_scatter()
                reduction.start_all_reduce()
                delivered.append(reduction.finish())
            return None if delivered[0] is None else [g for part in delivered for g in part]
        self._advance()
        self.pending_reduce_scatter = reductions
        return None

    def _advance(self) -> None:
        """Wait the pending reduce-scatter and issue its all-reduces, then deliver every
        gradient whose reduction is complete: the all-reduces the last advance issued (a
        unit's backward ran since) and this unit's legs that need none. A gradient is thus
        delivered during backward, one unit after its reduce-scatter (or its all-reduce)
        was issued, with one collective of each kind still overlapping compute."""
        issued_before, self.pending_all_reduce = self.pending_all_reduce, []
        scattering, self.pending_reduce_scatter = self.pending_reduce_scatter, []
        for reduction in scattering:
            reduction.finish_reduce_scatter()
            reduction.start_all_reduce()
            self.pending_all_reduce.append(reduction)
        for reduction in issued_before:
            reduction.finish()
        for reduction in self.pending_all_reduce:
            reduction.deliver_completed()
        self.pending_all_reduce = [r for r in self.pending_all_reduce if r.in_flight]

    def drain(self) -> None:
        """Wait every collective in flight and deliver every gradient."""
        self._advance()
        pending, self.pending_all_reduce = self.pending_all_reduce, []
        for reduction in pending:
            reduction.finish()

    def has_pending(self) -> bool:
        return bool(self.pending_reduce_scatter) or bool(self.pending_all_reduce)

    def finish_backward(self) -> None:
        """After the whole backward: drain (on a last backward) and reshard every unit
        (units whose backward never ran included)."""
        self._final_callback_queued = False
        if self.root.is_last_backward:
            self.drain()
        else:
            logger.debug("backward ended with is_last_backward=False: reductions left in flight")
        for state in self.states:
            state.finish_backward()

    def reduce_accumulated(self) -> None:
        """Reduce what every unit accumulated with gradient sync off, one reduction per
        unit and parameter group (in backward order), as a last microbatch's backward
        would, then end the step as its final callback does: drain (with the root's
        ``is_last_backward`` set) and reshard every unit. A unit whose sync is still off
        keeps accumulating.

        A unit with trainable parameters whose forward ran in the step but whose backward
        never did is an error, raised before any collective (every rank of its groups runs
        the same stage): its gradients took a way around the unit (torch's zero-bubble
        schedules compute weight gradients from the parameters' own accumulators, which a
        unit's gradients do not pass through), and reducing nothing would train it wrong."""
        p = self.platform
        missed = [state.name for state in self.forwards_run if state.unsharded_grads is None
                  and any(p.param_requires_grad(fp.sharded_param) for fp in state.params)]
        if missed:
            raise RuntimeError(
                f"the step's backwards never reached the parameters of {', '.join(missed)}, "
                f"whose forward ran: no gradient to reduce. A pipeline schedule that splits "
                f"each backward into input and weight parts (torch's zero-bubble schedules) "
                f"computes weight gradients without running a unit's backward; use one that "
                f"runs each backward whole (ScheduleGPipe, Schedule1F1B, "
                f"ScheduleInterleaved1F1B)")
        for state in reversed(self.states):
            accumulated, state.unsharded_grads = state.unsharded_grads, None
            if accumulated is not None:
                reduce_gradients(state, accumulated)
        self.finish_backward()

    def reset(self) -> None:
        """After an exception aborted a forward or backward (``reset_iter_state``): wait every
        collective in flight and drop what it carried (the aborted iteration's gradients,
        gradients deferred by ``set_requires_all_reduce(False)`` and those accumulated with
        ``set_requires_gradient_sync(False)`` are lost, as in FSDP2), reshard every unit and
        forget the aborted iteration's forward order and queued final callback, and let the
        platform drop what its autograd kept of the aborted recording. The order of the last
        complete iteration stays known."""
        in_flight = self.pending_reduce_scatter + self.pending_all_reduce
        self.pending_reduce_scatter, self.pending_all_reduce = [], []
        for reduction in in_flight:
            reduction.abandon()
        self._final_callback_queued = False
        self._forward_order, self._seen = [], set()
        for state in self.states:
            state.reset()  # also waits and drops an all-gather in flight
        self.platform.discard_aborted_autograd()
        logger.debug("iteration state reset: %d reductions in flight dropped", len(in_flight))


def reduce_accumulated(state: FSDPState) -> None:
    """``IterationContext.reduce_accumulated`` of ``state``'s root, for a driver that ends a
    step outside any backward (torch's pipeline stages); before any forward, nothing."""
    if state.iteration is not None:
        state.iteration.reduce_accumulated()
