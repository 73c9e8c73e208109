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
release a tensor's memory while autograd holds the object (torch), ``reshard_after_forward``
releases it and a gradient hook on the unit's outputs re-gathers into the same tensors just
before the unit's backward. Where it cannot (MindSpore), the full parameters stay alive
until the unit's backward and no second all-gather is issued (docs/platforms.md).

[Note: roots]
The first unit whose forward runs becomes the root: it creates the IterationContext shared
by every unit in its module tree, starts each iteration, and its final callback reshards
everything after backward. The root never reshards after forward (its backward comes first).
"""

from __future__ import annotations

import logging
from typing import Any

from hyper_parallel.fully_shard.iteration import IterationContext
from hyper_parallel.fully_shard.reduce_op import plan_reduction, resolve_reduce_dtype
from hyper_parallel.fully_shard.reduction import UnitReduction

logger = logging.getLogger("hyper_parallel.fully_shard")

STATE_ATTR = "_hp_state"
_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


class FSDPState:
    """State and hooks of one fully_shard unit (one module or a list of modules)."""

    def __init__(self, platform: Any, name: str, modules: list, group: Any,
                 reshard_after_forward: bool, mp_policy: Any):
        self.platform = platform
        self.unit_type = name
        self.name = name  # refined to "<fqn> (<type>)" once the root knows the tree
        self.modules = modules
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.is_last_backward = True
        self.reduce_op = "avg"
        self.divide_factor: float | None = None
        self.scaling_factor = 1.0
        self.force_sum_reduction = False
        self.to_main_grad = mp_policy.apply_grad_on_fp32_main_grad
        self.param_dtype = group.param_dtype if group is not None else None
        self.output_dtype = (platform.dtype(mp_policy.output_dtype)
                             if isinstance(mp_policy.output_dtype, str) else mp_policy.output_dtype)
        self.cast_forward_inputs = mp_policy.cast_forward_inputs
        self.forward_prefetch: list | None = None   # explicit lists; None = implicit
        self.backward_prefetch: list | None = None
        self.is_root: bool | None = None
        self.iteration: IterationContext | None = None
        self._full: list | None = None       # this iteration's full parameters
        self._storage_live = False           # False while their memory is released
        self._keep_full = False              # survive the next iteration start
        self._node_spent = False             # _full came from a node backward already ran
        self._forwards_done = 0              # modules of a list unit done this round
        self._unsharded_grads: list | None = None  # accumulated while sync is off
        self._floating = tuple(platform.dtype(n) for n in _FLOAT_NAMES)

    # ---------------------------------------------------------------- lazy root init
    def _lazy_init(self, root_module: Any) -> None:
        states = []
        for fqn, module in self.platform.named_modules(root_module):
            state = module.__dict__.get(STATE_ATTR)
            if state is not None and all(state is not s for s in states):
                state.name = f"{fqn or '<root>'} ({state.unit_type})"  # logs tell units apart
                states.append(state)
        context = IterationContext(self.platform, states)
        for state in states:
            state.is_root = state is self
            state.iteration = context

    # ---------------------------------------------------------------- forward hooks
    def pre_forward(self, module: Any, args: tuple, kwargs: dict):
        if self.is_root is None:
            self._lazy_init(module)
        if self.platform.in_backward():
            # Activation checkpointing recomputes this forward inside backward: the full
            # parameters are needed, nothing else is (no prefetch, no order to record).
            self.unshard()
            return self._cast_inputs(args, kwargs)
        if self.is_root:
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
            args, kwargs = self._cast_tree((args, kwargs), self.param_dtype)
        return args, kwargs

    def post_forward(self, module: Any, args: tuple, kwargs: dict, output: Any):
        if not self.platform.in_backward():  # else a recomputation: backward reshards
            self._after_forward(output)
        if self.output_dtype is not None:
            output = self._cast_tree(output, self.output_dtype)
        return output

    def _after_forward(self, output: Any) -> None:
        self._forwards_done += 1
        if self._forwards_done >= len(self.modules):
            self._forwards_done = 0
            if not self.platform.is_grad_enabled():
                self.reshard()
            elif self.is_root:
                # Queue the end-of-backward callback from the first gradient of backward, so
                # it belongs to the outermost backward: queued first from a unit inside a
                # nested backward (reentrant activation checkpointing), it would reshard
                # every unit when that nested backward ends.
                for tensor in self._tensors_in(output):
                    self.platform.register_grad_hook(tensor, self.iteration.ensure_final_callback)
            elif self.reshard_after_forward:
                self._reshard_after_forward(output)

    def begin_iteration(self) -> None:
        self._forwards_done = 0
        if self._keep_full:
            self._keep_full = False
        else:
            self.reshard()

    # ---------------------------------------------------------------- unshard / reshard
    def unshard(self) -> None:
        """Make the full parameters the modules' attributes (gathering them if needed)."""
        if self.group is None:
            return
        if self._full is None:
            logger.debug("%s: unshard (all-gather)", self.name)
            self._full = self.platform.differentiable_call(
                self.group.local_shards(), self._gather_for_forward, self._post_backward)
            self._storage_live = True
        elif self._node_spent:
            # kept after the last backward (reshard_after_backward=False): no all-gather,
            # but a new node, so this iteration's gradients get their own backward
            kept = self._full
            self._full = self.platform.differentiable_call(
                self.group.local_shards(), lambda _: [self.platform.alias(t) for t in kept],
                self._post_backward)
            self._node_spent = False
        elif not self._storage_live:
            self._refill()
        for fsdp_param, full in zip(self.group.params, self._full):
            fsdp_param.attach(full)

    def prefetch(self) -> None:
        """Start this unit's all-gather early, to overlap it with another unit's compute
        (forward: the next unit's while this one computes; see IterationContext.neighbours)."""
        if self.group is not None and self._full is None and not self.group.has_pending_gather():
            logger.debug("%s: prefetch all-gather issued", self.name)
            self.group.issue_gather(async_op=True)

    def reshard(self) -> None:
        """Free the full parameters; the modules see their sharded parameters again."""
        self._keep_full = False
        self._node_spent = False
        if self.group is None:
            return
        self.group.discard_gather()
        if self._full is None:
            return
        self._detach_and_release()
        self._full = None

    def keep_until_next_forward(self) -> None:
        self._keep_full = True

    def _gather_for_forward(self, local_shards: list) -> list:
        # The shards arrive as the node's inputs for autograd's sake; the gather reads the
        # same values (possibly already in flight from a prefetch or an async unshard).
        return self.group.wait_gather()

    def _refill(self) -> None:
        logger.debug("%s: re-gather full parameters for backward", self.name)
        with self.platform.no_grad():
            self.group.refill(self._full)
        self._storage_live = True

    def _detach_and_release(self) -> None:
        for fsdp_param in self.group.params:
            fsdp_param.detach()
        if self.platform.can_release_storage and self._storage_live:
            for full in self._full:
                self.platform.release_storage(full)
        self._storage_live = False

    def _reshard_after_forward(self, output: Any) -> None:
        if self.group is None or self._full is None or not self.platform.can_release_storage:
            return
        self._detach_and_release()
        for tensor in self._tensors_in(output):
            self.platform.register_grad_hook(tensor, self._pre_backward)

    # ---------------------------------------------------------------- backward
    def _pre_backward(self) -> None:
        if self.iteration is not None:
            self.iteration.ensure_final_callback()
        if self._full is not None and not self._storage_live:
            self._refill()
            for fsdp_param, full in zip(self.group.params, self._full):
                fsdp_param.attach(full)
        targets = self.backward_prefetch
        if targets is None:
            targets = self.iteration.neighbours(self, step=-1)
        for target in targets:
            target._pre_backward_prefetch()

    def _pre_backward_prefetch(self) -> None:
        if self.group is not None and self._full is not None and not self._storage_live \
                and not self.group.has_pending_gather():
            logger.debug("%s: prefetch re-gather issued", self.name)
            # its own pre-backward waits for it
            self.group.issue_gather(async_op=True, released=self._full)

    def _post_backward(self, full_grads: list) -> list:
        """The unshard node's backward: start the reduction (or accumulate locally) and
        return what autograd should see for the shards (see reduction.py)."""
        self.iteration.ensure_final_callback()
        if self.reshard_after_backward:
            # Free the full parameters before the reduction allocates its buffers, so
            # those can take their memory (FSDP2 reshards first too).
            self.reshard()
        p, group = self.platform, self.group
        dtype = resolve_reduce_dtype(group.reduce_dtype, group.param_dtype, p.dtype_of(full_grads[0]))
        full_grads = [p.cast(g, dtype) for g in full_grads]
        if self._unsharded_grads is not None:
            full_grads = [p.add(acc, g) for acc, g in zip(self._unsharded_grads, full_grads)]
            self._unsharded_grads = None
        if not self.requires_gradient_sync:
            logger.debug("%s: gradient sync off, accumulating unsharded gradients", self.name)
            self._unsharded_grads = full_grads
            result = [None] * len(full_grads)
        else:
            plan = plan_reduction(group.mesh_info.data_parallel_size, reduce_op=self.reduce_op,
                                  custom_divide_factor=self.divide_factor,
                                  scaling_factor=self.scaling_factor,
                                  reduce_in_fp16=dtype == p.dtype("float16"),
                                  force_sum=self.force_sum_reduction)
            sync = self.iteration.sync_collectives
            returned = sync and p.returns_grads_from_backward and not self.to_main_grad
            placeholders = None if returned else [p.grad_placeholder(fp.sharded_param)
                                                  for fp in group.params]
            reduction = UnitReduction(self.name, group, full_grads, dtype, plan, placeholders,
                                      self.to_main_grad, async_op=not sync,
                                      joined=self.iteration.joined)
            delivered = self.iteration.enqueue(reduction, self.requires_all_reduce)
            result = delivered if returned else placeholders
        return result

    def finish_backward(self) -> None:
        """Root's final callback, for every unit: reshard what backward left unsharded."""
        self._forwards_done = 0
        if self._full is None:
            return
        if self.reshard_after_backward:
            self.reshard()
        else:
            self.keep_until_next_forward()
            self._node_spent = True

    # ---------------------------------------------------------------- pytrees
    def _tensors_in(self, tree: Any):
        if self.platform.is_tensor(tree):
            yield tree
        elif isinstance(tree, (tuple, list)):
            for item in tree:
                yield from self._tensors_in(item)
        elif isinstance(tree, dict):
            for item in tree.values():
                yield from self._tensors_in(item)

    def _cast_tree(self, tree: Any, dtype: Any):
        if self.platform.is_tensor(tree):
            if self.platform.dtype_of(tree) in self._floating:
                return self.platform.cast(tree, dtype)
            return tree
        if isinstance(tree, tuple):
            return tuple(self._cast_tree(item, dtype) for item in tree)
        if isinstance(tree, list):
            return [self._cast_tree(item, dtype) for item in tree]
        if isinstance(tree, dict):
            return {key: self._cast_tree(item, dtype) for key, item in tree.items()}
        return tree
