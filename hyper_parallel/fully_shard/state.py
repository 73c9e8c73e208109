"""The per-unit state machine: pre/post forward, pre/post backward, reshard.

[Note: one unshard node per unit per iteration]
A unit's full parameters are the outputs of one differentiable node (``Platform.
differentiable_call``) whose inputs are the unit's local shards: forward gathers, backward
reduces. The node is created at the unit's first forward of an iteration; a second call of
the same module in that forward reuses its outputs (refilling them if they were freed), so
autograd sums the gradients of every use and calls the backward once: tied parameters and
modules called twice need no special casing, and no gradient is dropped or counted twice.
A forward recomputed inside backward (activation checkpointing) reuses them too when they
are there (non-reentrant); after a no_grad first forward (reentrant), which kept no node, it
makes the iteration's node. The node saves nothing through the user's saved-tensor hooks
(``Platform.differentiable_call``), so a recomputation that makes no node still saves what
its forward saved.

[Note: freeing full parameters between forward and backward]
Autograd keeps the full parameters alive (a Linear saves its weight). Where the platform can
release a tensor's memory while autograd holds the object (torch, MindSpore), resharding
releases it, and the memory is gathered again into the same tensors before autograd reads
them. Every forward of a unit with gradients enabled hooks its outputs: when their gradient
arrives, the full parameters *that forward used* are re-gathered if their memory was
released. So it does not matter what released them in between (``reshard_after_forward``, a
second forward of the model, a ``no_grad`` forward of the unit, an explicit ``reshard()``,
the end of an earlier backward over a retained graph): autograd never reads freed memory.
Where a platform cannot release memory, the full parameters stay alive until the unit's
backward and no second all-gather is issued.

[Note: releasing after backward]
A backward frees its unit's full parameters before the gradient reduction allocates (FSDP2's
order), or after it where ``Capabilities.release_after_reduction`` says why (MindSpore CPU).

[Note: one kept set]
Several forwards may run before their backwards (torch's pipeline schedules), each with its
own full parameters, released after it. With ``reshard_after_backward=False`` those a
backward re-gathered become the unit's kept set (also if a backward's end resharded the
unit), and later backwards' released ones are copied from it (full_params.py), as FSDP2
keeps one set: the same shards made both, no optimizer step falls between them.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

from hyper_parallel.fully_shard.full_params import FullParams, Memory, aliases, copy_from_kept
from hyper_parallel.fully_shard.iteration import IterationContext
from hyper_parallel.fully_shard.post_forward import PostForwardShards, post_forward_size
from hyper_parallel.fully_shard.pytree import cast_floating, tensors_in
from hyper_parallel.fully_shard.unit_state import UnitState, check_transition
from hyper_parallel.fully_shard.gradients import reduce_gradients
from hyper_parallel.unit_marks import STATE_ATTR

if TYPE_CHECKING:
    from hyper_parallel.fully_shard.param_group import FSDPParamGroup
    from hyper_parallel.fully_shard.policy import MixedPrecisionPolicy
    from hyper_parallel.platform import Platform

logger = logging.getLogger("hyper_parallel.fully_shard")



class FSDPState:
    """State and hooks of one fully_shard unit (one module or a list of modules)."""

    def __init__(self, platform: Platform, name: str, modules: list, groups: list[FSDPParamGroup],
                 reshard_after_forward: bool | int | None, mp_policy: MixedPrecisionPolicy):
        self.platform = platform
        self.unit_type = name
        self.name = self.path = name  # refined by the root: for logs, and for errors
        self.modules = modules
        self.groups = groups  # one per mesh (placement.py); none without parameters
        # every group's parameters, in group order: the order of the unshard node's
        # inputs and outputs, and of every per-parameter list here
        self.params = [fsdp_param for group in groups for fsdp_param in group.params]
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.is_last_backward = True
        self.reduce_op = "avg"
        self.divide_factor: float | None = None
        self.scaling_factor = 1.0
        self.force_sum_reduction = False
        self.unshard_in_backward = True      # False: backward needs no full parameters
        self.reduce_scatter_unused_params = False  # True: unused ones get zeros (gradients.py)
        self.reduce_scatter_max_input_buffers = 1  # validated and kept (fsdp_module.py)
        self.all_reduce_hook = None          # hook(reduced buffer), see gradients.py
        self.post_optim_event = None         # the root waits it before its next forward
        self.to_main_grad = mp_policy.apply_grad_on_fp32_main_grad
        self.param_dtype = groups[0].param_dtype if groups else None  # one mp_policy for all
        self.output_dtype = (platform.dtype(mp_policy.output_dtype)
                             if isinstance(mp_policy.output_dtype, str) else mp_policy.output_dtype)
        self.cast_forward_inputs = mp_policy.cast_forward_inputs
        self.forward_prefetch: list | None = None   # explicit lists; None = implicit
        self.backward_prefetch: list | None = None
        self.is_root = False  # set at the root's lazy init (``iteration`` set then too)
        self.iteration: IterationContext | None = None
        self.state = UnitState.SHARDED       # see unit_state.py
        self._full: FullParams | None = None  # the current full parameters (not SHARDED)
        self._keep_full = False              # survive the next iteration start
        self._forwards_done = 0              # modules of a list unit done this round
        self.unsharded_grads: list | None = None  # accumulated while sync is off (gradients.py)

    # ---------------------------------------------------------------- lazy root init
    def _lazy_init(self, root_module: Any) -> None:
        states = []
        names = {}  # id(module) -> its name under the root, for the parameters' names
        for fqn, module in self.platform.named_modules(root_module):
            names.setdefault(id(module), fqn)
            state = module.__dict__.get(STATE_ATTR)
            if state is not None and all(state is not s for s in states):
                state.name, state.path = f"{fqn or '<root>'} ({state.unit_type})", fqn or "root"
                states.append(state)
        for state in states:  # every check before anything changes
            for fsdp_param in state.params:
                module, attr = fsdp_param.slots[0]
                prefix = names.get(id(module))
                if prefix is not None:  # errors name the parameter as the user does
                    fsdp_param.fqn = f"{prefix}.{attr}" if prefix else attr
                # a unit unsharded explicitly before this forward registers its full
                # parameters (torch): they are not replacements
                fsdp_param.reset_sharded_param(pick_up=state._full is None)
        context = IterationContext(self.platform, states)
        for state in states:
            state.is_root = state is self
            state.iteration = context

    # ---------------------------------------------------------------- forward hooks
    def _enter(self, new: UnitState) -> None:
        check_transition(self.path, self.state, new)
        self.state = new

    def pre_forward(self, module: Any, args: tuple, kwargs: dict):
        if self.iteration is None:
            self._lazy_init(module)
        if self.platform.in_backward():
            # Activation checkpointing recomputes this forward inside backward: the full
            # parameters are needed, nothing else is (no prefetch, no order to record).
            self.unshard()
            return self._cast_inputs(args, kwargs)
        if self.is_root:
            if self.post_optim_event is not None:  # set_post_optim_event: once
                event, self.post_optim_event = self.post_optim_event, None
                event.wait()
            self.iteration.begin_forward()
        self.iteration.record_forward(self)
        self.unshard()
        targets = self.forward_prefetch
        if targets is None:
            targets = self.iteration.neighbours(self, step=1)
        for target in targets:
            target.prefetch()
        return self._cast_inputs(args, kwargs)

    def _cast_inputs(self, args: tuple, kwargs: dict):
        if self.cast_forward_inputs and self.param_dtype is not None:
            args, kwargs = cast_floating(self.platform, (args, kwargs), self.param_dtype)
        return args, kwargs

    def post_forward(self, module: Any, args: tuple, kwargs: dict, output: Any):
        if not self.platform.in_backward():  # else a recomputation: backward reshards
            self._after_forward(output)
        if self.output_dtype is not None:
            output = cast_floating(self.platform, output, self.output_dtype)
        return output

    @property
    def reshards_after_forward(self) -> bool:
        """``reshard_after_forward`` resolved: None means every unit but the root."""
        if self.reshard_after_forward is None:
            return not self.is_root
        return bool(self.reshard_after_forward)

    def _after_forward(self, output: Any) -> None:
        grad_enabled = self.platform.is_grad_enabled()
        if grad_enabled and (self.is_root or self._full is not None):
            # Hooked on every forward's outputs, the first gradient of backward also queues
            # the end-of-backward callback from the outermost backward: queued first from a
            # unit inside a nested backward (reentrant activation checkpointing), it would
            # reshard every unit when that nested backward ends.
            full = self._full
            same_forward = self.iteration.record_full_params(self, full)
            for tensor in tensors_in(self.platform, output):
                self.platform.register_grad_hook(tensor,
                                                 lambda: self._pre_backward(full, same_forward))
        self._forwards_done += 1
        if self._forwards_done >= len(self.modules):
            self._forwards_done = 0
            if not grad_enabled:
                self.reshard()
            elif self.reshards_after_forward and self._full is not None:
                self._detach()
                self._release(self._full, after_forward=True)
                self._enter(UnitState.FREED)

    def begin_iteration(self) -> None:
        self._forwards_done = 0
        if self._keep_full:
            self._keep_full = False
        else:
            self.reshard()
        if self._full is None:
            # parameters replaced since the last iteration (a load between steps)
            for fsdp_param in self.params:
                fsdp_param.pick_up_replacement()

    # ---------------------------------------------------------------- unshard / reshard
    def unshard(self) -> None:
        """Make the full parameters the modules' attributes (gathering them if needed)."""
        if not self.groups:
            return
        full = self._full
        if full is None:
            logger.debug("%s: unshard (all-gather)", self.name)
            full = self._new_full(self._gather_for_forward)
        elif full.spent:
            # kept after the last backward (reshard_after_backward=False): no all-gather,
            # but a new node, so this iteration's gradients get their own backward
            if not full.live:
                self._refill(full)
            kept = full.tensors
            full = self._new_full(lambda _: aliases(self.platform, self.params, kept),
                                  full.memory)
        elif not full.live:
            self._refill(full)
        self._full = full
        for fsdp_param, tensor in zip(self.params, full.tensors):
            fsdp_param.attach(tensor)
        self._enter(UnitState.UNSHARDED)

    def per_group(self, values: list) -> list:
        """``values`` (one per parameter, ``params`` order) cut into one list per group."""
        rest = iter(values)
        return [[next(rest) for _ in group.params] for group in self.groups]

    def _new_full(self, forward_fn, memory: Memory | None = None) -> FullParams:
        """One unshard node: the local shards in, ``forward_fn``'s full parameters out."""
        full = FullParams(memory)
        held = weakref.ref(full)  # weakly: see the note "FullParams"
        full.tensors = self.platform.differentiable_call(
            [shard for group in self.groups for shard in group.local_shards()], forward_fn,
            lambda grads: self._post_backward(held(), grads),
            grads_to_inputs=self.platform.capabilities.returns_grads_from_backward)
        # kept as lists: a prefetched re-gather is matched to its fulls by identity
        full.per_group = self.per_group(full.tensors)
        return full

    def prefetch(self) -> None:
        """Start this unit's all-gathers early, to overlap another unit's compute."""
        if self._full is None and not self._gathers_pending():
            logger.debug("%s: prefetch all-gather issued", self.name)
            for group in self.groups:
                group.issue_gather(async_op=True)

    def _gathers_pending(self) -> bool:
        """Whether every group's all-gather is in flight (True without groups)."""
        return all(group.has_pending_gather() for group in self.groups)

    def reshard(self) -> None:
        """Free the full parameters; the modules see their sharded parameters again."""
        self._keep_full = False
        for group in self.groups:
            group.discard_gather()
        if self._full is None:
            return
        self._detach()
        self._release(self._full)
        self._full = None
        self._enter(UnitState.SHARDED)

    def reset(self) -> None:
        """``reset_iter_state``: reshard and drop what an aborted iteration left behind:
        the count of a list unit's modules run, gradients accumulated with sync off, and
        all-reduce sums deferred by ``set_requires_all_reduce(False)`` (as FSDP2 drops them)."""
        self.reshard()
        self._forwards_done = 0
        self.unsharded_grads = None
        for group in self.groups:
            for leg in group.legs:
                leg.bucket.discard_deferred()

    def keep_until_next_forward(self) -> None:
        self._keep_full = True

    def _gather_for_forward(self, local_shards: list) -> list:
        # The shards arrive as the node's inputs for autograd's sake; the gather reads the
        # same values (possibly already in flight from a prefetch or an async unshard).
        return [full for group in self.groups for full in group.wait_gather()]

    def _refill(self, full: FullParams) -> None:
        kept, p = self._full, self.platform
        with p.no_grad():
            if kept is not None and kept.fills(full):  # see the note "one kept set"
                logger.debug("%s: full parameters copied from the kept ones", self.name)
                copy_from_kept(p, full, kept)
            else:
                logger.debug("%s: re-gather full parameters for backward", self.name)
                for group, fulls, shards in self._released_per_group(full):
                    group.refill(fulls, shards)
        full.memory.post_forward = None
        full.memory.live = True

    def _released_per_group(self, full: FullParams) -> list:
        """``[(group, its fulls, its post-forward shards or None)]`` of released ``full``."""
        kept = full.memory.post_forward or [None] * len(self.groups)
        return list(zip(self.groups, full.per_group, kept))

    def _detach(self) -> None:
        for fsdp_param in self.params:
            fsdp_param.detach()

    def _release(self, full: FullParams, after_forward: bool = False) -> None:
        """Free ``full``'s memory where the platform can (autograd keeps the tensors); after
        forward with ``reshard_after_forward`` an int, keep its post-forward shards."""
        if self.platform.capabilities.can_release_storage and full.live:
            sizes = [post_forward_size(self.reshard_after_forward, group.mesh_info)
                     for group in self.groups]
            if after_forward and any(sizes):
                full.memory.post_forward = [
                    None if size is None else PostForwardShards(group, fulls, size)
                    for group, fulls, size in zip(self.groups, full.per_group, sizes)]
            for group, fulls in zip(self.groups, full.per_group):
                for fsdp_param, tensor in zip(group.params, fulls):
                    for memory in group.memory_of(fsdp_param, tensor):
                        self.platform.release_storage(memory)
            full.memory.live = False

    # ---------------------------------------------------------------- backward
    def _pre_backward(self, full: FullParams | None, same_forward: Any) -> None:
        """A gradient reached the outputs of a forward that used ``full``: its memory must
        be there before autograd reads it (see the note "freeing full parameters").
        ``same_forward``: what every unit's forward used in it (the prefetch's targets)."""
        if self.iteration is not None:
            self.iteration.ensure_final_callback()
        if full is not None and not full.live and self.unshard_in_backward:
            self._refill(full)
            if self._full is None and not full.spent:
                # resharded since that forward (an earlier backward's end): a recomputation
                # in this backward (activation checkpointing) reads the module's attributes
                self._full = full
            if full is self._full:
                for fsdp_param, tensor in zip(self.params, full.tensors):
                    fsdp_param.attach(tensor)
                self._enter(UnitState.UNSHARDED)
        targets = self.backward_prefetch
        if targets is None:
            targets = self.iteration.neighbours(self, step=-1)
        for target in targets:
            target._pre_backward_prefetch(same_forward.get(target))

    def _pre_backward_prefetch(self, full: FullParams | None) -> None:
        """Re-gather ``full`` early, unless it is there, the kept set will fill it or the
        unit was resharded since (iteration.py, the note "implicit prefetch")."""
        if full is not None and not full.live and self.unshard_in_backward \
                and self._full is not None and not self._full.fills(full) \
                and not self._gathers_pending():
            logger.debug("%s: prefetch re-gather issued", self.name)
            # its own pre-backward waits for it
            for group, fulls, kept in self._released_per_group(full):
                group.issue_gather(async_op=True, released=fulls, post_forward=kept)

    def _post_backward(self, full: FullParams | None, full_grads: list) -> list:
        """The backward of ``full``'s unshard node (None once nothing else holds it): start
        the reduction (or accumulate locally); return what autograd sees for the shards."""
        self.iteration.ensure_final_callback()
        release = full is not None and self.reshard_after_backward
        later = release and self.platform.capabilities.release_after_reduction  # the note
        if full is not None:
            full.spent = True
            if release and not later:  # before the reduction allocates (FSDP2's order)
                self.reshard() if full is self._full else self._release(full)
            elif not release and full is self._full:
                self._enter(UnitState.KEPT)
            elif not release and full.live and (self._full is None or not self._full.live):
                self._keep(full)
        reduced = reduce_gradients(self, full_grads)
        if later:
            self.reshard() if full is self._full else self._release(full)
        return reduced

    def _keep(self, full: FullParams) -> None:
        """``reshard_after_backward=False`` after the backward of a forward other than the
        current one (released) or resharded since: ``full`` becomes the kept set (the note)."""
        self._full = full
        for fsdp_param, tensor in zip(self.params, full.tensors):
            fsdp_param.attach(tensor)
        self._enter(UnitState.KEPT)

    def finish_backward(self) -> None:
        """Root's final callback, for every unit: reshard what backward left unsharded."""
        self._forwards_done = 0
        if self._full is None:
            return
        if self.reshard_after_backward:
            self.reshard()
        else:
            self.keep_until_next_forward()
            self._full.spent = True
            self._enter(UnitState.KEPT)
