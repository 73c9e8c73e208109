"""``FSDPModule``: the methods a module gains from ``fully_shard`` (its class becomes
``FSDP<Class>``), as FSDP2's: unshard/reshard, the per-unit settings (``set_*``, most with
``recurse=True``), prefetch lists and ``reset_iter_state``. A setter validates its argument
before it changes any unit.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from hyper_parallel.fully_shard.mesh import MeshInfo
from hyper_parallel.fully_shard.param import library_attrs, restore_library_attrs
from hyper_parallel.fully_shard.post_forward import post_forward_size
from hyper_parallel.fully_shard.reduce_op import normalize_reduce_op, validate_factor
from hyper_parallel.fully_shard.state import STATE_ATTR, FSDPState
from hyper_parallel.platform import get_platform


class FSDPModule:
    """Methods of a module after ``fully_shard`` (its class becomes ``FSDP<Class>``)."""

    def unshard(self, async_op: bool = False):
        """Gather this unit's full parameters now (they stay until the next forward uses
        them). With ``async_op=True`` return a handle; ``wait()`` makes them the attributes."""
        state = _state_of(self)
        state.keep_until_next_forward()  # the next forward uses these, gathered or in flight
        if not async_op:
            _unshard_explicitly(state)
            return None
        state.prefetch()
        return UnshardHandle(state)

    def reshard(self) -> None:
        """Free this unit's full parameters; the module sees its sharded parameters."""
        _state_of(self).reshard()

    def _apply(self, fn, *args, **kwargs):
        """The framework's conversion of a module's parameters (``.to(dtype)``), on a unit:
        resharded first (full parameters of the old dtype are dropped; the next forward
        gathers the converted shards), then each sharded parameter made one of its new
        dtype (``Platform.refresh_converted_param``)."""
        state = _state_of(self)
        state.reshard()
        kept = [library_attrs(fsdp_param.sharded_param) for fsdp_param in state.params]
        result = super()._apply(fn, *args, **kwargs)
        for fsdp_param, attrs in zip(state.params, kept):
            restore_library_attrs(fsdp_param.sharded_param, attrs)
            state.platform.refresh_converted_param(fsdp_param.sharded_param)
        return result

    def __deepcopy__(self, memo):
        """Refused, as FSDP2 refuses it: a copy's shards would share this unit's state and
        process groups, and neither framework's copy gives a unit that computes."""
        raise TypeError(
            f"{type(self).__name__} is a fully_shard unit and cannot be deep-copied; copy the "
            f"model before fully_shard, or build a new model and load hp.get_full_state_dict"
            f"(model) (or a checkpoint) into it")

    def set_reshard_after_forward(self, reshard_after_forward: bool | int | None,
                                  recurse: bool = True) -> None:
        """Free full parameters after forward (re-gather for backward) or keep them. Takes
        what ``fully_shard`` takes: a bool, None (every unit but the root) or an int, the
        size of the group to reshard to (1: False, the shard size: True)."""
        states = _states_under(self, recurse)
        # resolve for every unit first: a value one unit rejects changes none
        values = [_resolve_reshard_after_forward(
            reshard_after_forward, [group.mesh_info.shard_size for group in state.groups])
            for state in states]
        for state, value in zip(states, values):
            for group in state.groups:
                _make_post_forward_group(state.platform, value, group.mesh_info)
        for state, value in zip(states, values):
            state.reshard_after_forward = value

    def set_reshard_after_backward(self, reshard_after_backward: bool, recurse: bool = True) -> None:
        """Keep full parameters after backward (saves the next forward's all-gather when no
        optimizer step happens in between, e.g. gradient accumulation)."""
        for state in _states_under(self, recurse):
            state.reshard_after_backward = bool(reshard_after_backward)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, recurse: bool = True) -> None:
        """Off: backward accumulates unsharded gradients locally, no communication; the next
        backward with it on reduces the accumulated sum."""
        for state in _states_under(self, recurse):
            state.requires_gradient_sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, recurse: bool = True) -> None:
        """HSDP: off, each backward still reduce-scatters but defers the replicate all-reduce;
        the next backward with it on all-reduces the deferred sum once."""
        for state in _states_under(self, recurse):
            state.requires_all_reduce = bool(requires_all_reduce)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Off: the coming backward does not wait for its gradient reductions at its end;
        they finish at the next last backward or when the next forward starts. Call it on
        the root module (the one whose backward ends the pass)."""
        state = _state_of(self)
        if state.iteration is not None and not state.is_root:
            raise ValueError("set_is_last_backward applies to the whole backward pass: call it on "
                             "the root module, not on a nested fully_shard unit")
        for state in _states_under(self, True):
            state.is_last_backward = bool(is_last_backward)

    def set_reduce_op_type(self, reduce_op: str, recurse: bool = True) -> None:
        """"avg" (default: divide by the data-parallel size) or "sum" (no division)."""
        op = normalize_reduce_op(reduce_op)
        for state in _states_under(self, recurse):
            state.reduce_op = op

    def set_gradient_divide_factor(self, factor: float, recurse: bool = True) -> None:
        """Divide summed gradients by ``factor`` instead of the data-parallel size."""
        value = validate_factor(factor, "gradient divide factor")
        for state in _states_under(self, recurse):
            state.divide_factor = value

    def set_gradient_scaling_factor(self, factor, recurse: bool = True) -> None:
        """Multiply every gradient by ``factor`` exactly once, before its first collective
        (float, int or one-element tensor)."""
        value = validate_factor(_as_scalar(factor), "gradient scaling factor")
        for state in _states_under(self, recurse):
            state.scaling_factor = value

    def set_force_sum_reduction_for_comms(self, force_sum: bool, recurse: bool = True) -> None:
        """On: collectives sum the raw gradients and all division happens after (no fp16
        pre-divide). Collectives always use SUM in hyper_parallel (reduce_op.py)."""
        for state in _states_under(self, recurse):
            state.force_sum_reduction = bool(force_sum)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2 for ``set_gradient_divide_factor``, which it calls."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use "
                      "set_gradient_divide_factor instead", FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this unit's backward reads none of its full parameters (an embedding's),
        so full parameters freed after forward are not gathered again before its backward.
        This unit only, as FSDP2's."""
        _state_of(self).unshard_in_backward = bool(unshard_in_backward)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """True: a parameter no rank's backward reached gets a zero gradient (FSDP2's
        behaviour with it); False (default): it gets none. Ranks stay in step either way."""
        for state in _states_under(self, recurse):
            state.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """How many reduce-scatter inputs may be in flight at once (>= 1). Validated and
        kept; one reduce-scatter is in flight at a time here, whose input is freed when it
        completes, so larger values change nothing (docs/api.md)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got "
                            f"{type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for state in _states_under(self, recurse):
            state.reduce_scatter_max_input_buffers = max_input_buffers

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """``hook(reduced)`` runs on each of this unit's reduced gradient buffers (after the
        reduce-scatter, and the replicate all-reduce with HSDP), before they are delivered.
        It may change the tensor in place (torch) or return a new one of the same shape."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook takes a callable hook(tensor), got "
                            f"{type(hook).__name__}")
        if stream is not None:
            raise NotImplementedError(
                "set_all_reduce_hook(stream=...): hyper_parallel runs its collectives and the "
                "hook in the order of the backward pass, on no side stream; leave stream out")
        _state_of(self).all_reduce_hook = hook

    def set_post_optim_event(self, event) -> None:
        """An event recorded after the optimizer step (torch.Event, mindspore.runtime.Event):
        the root's next forward waits for it (``event.wait()``) before its all-gathers,
        then forgets it; set a new one each iteration."""
        if not callable(getattr(event, "wait", None)):
            raise TypeError(f"set_post_optim_event takes an event with a wait() method "
                            f"(torch.Event, mindspore.runtime.Event), got {type(event).__name__}")
        state = _state_of(self)
        if state.iteration is not None and not state.is_root:
            raise ValueError("set_post_optim_event applies to the root's next forward: call it "
                             "on the root module, not on a nested fully_shard unit")
        state.post_optim_event = event

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """False is what hyper_parallel does (its buffers come from the framework's
        allocator); True raises NotImplementedError."""
        _state_of(self)
        if enable:
            raise NotImplementedError(
                "set_allocate_memory_from_process_group_for_comm(True): hyper_parallel's "
                "communication buffers come from the framework's allocator (the gradients "
                "and shards themselves where they can), never from a process group's own "
                "allocator (NCCL zero-copy); leave it False")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Raises NotImplementedError: no symmetric-memory all-gather buffers."""
        _state_of(self)
        raise NotImplementedError(
            f"set_symm_mem_for_comm({backend!r}): hyper_parallel all-gathers into buffers from "
            f"the framework's allocator (or into the full parameters themselves), not into "
            f"symmetric memory (torch.distributed._symmetric_memory over NCCL)")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """True: gradients are reduce-scattered over a process group of their own (the
        same ranks as the shard group), so they can progress beside all-gathers; made once
        per mesh, so call it on every rank. False: back to the shard group."""
        units = [(state, group.mesh_info) for state in _states_under(self, recurse)
                 for group in state.groups]
        platform = get_platform()
        for state, info in units:  # every check before any group is made
            if enable and info.shard_size > 1 and info.source.size() != platform.world_size():
                raise ValueError(
                    f"set_separate_reduce_scatter_group makes new process groups, which needs "
                    f"a mesh over all {platform.world_size()} ranks; {state.name} shards over "
                    f"one of {info.source.size()}: pass the whole mesh to fully_shard (or to "
                    f"hp.ShardPlacementResult), with dp_mesh_dims")
        for _, info in units:
            separate = enable and info.shard_size > 1
            info.reduce_scatter_group = info.separate_shard_group() if separate else info.shard_group

    def set_custom_all_gather(self, comm) -> None:
        """Raises NotImplementedError (see docs/api.md)."""
        _state_of(self)
        raise NotImplementedError(_CUSTOM_COMM.format(name="set_custom_all_gather",
                                                      kind="AllGather"))

    def set_custom_reduce_scatter(self, comm) -> None:
        """Raises NotImplementedError (see docs/api.md)."""
        _state_of(self)
        raise NotImplementedError(_CUSTOM_COMM.format(name="set_custom_reduce_scatter",
                                                      kind="ReduceScatter"))

    def reset_iter_state(self) -> None:
        """Recover from an exception that aborted a forward or backward mid-flight: wait the
        collectives in flight, drop the gradient reductions pending (that iteration's
        gradients are lost), reshard every unit and clear the iteration's trackers, so the
        next iteration runs normally. Call it on the root; on a nested unit it raises
        RuntimeError. Before the first forward there is nothing to reset."""
        state = _state_of(self)
        if state.iteration is not None and not state.is_root:
            raise RuntimeError("reset_iter_state must be called on the root fully_shard module "
                               "(the one whose forward starts the iteration), not on a nested unit")
        if state.iteration is not None:
            state.iteration.reset()

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """Units whose all-gather starts when this unit's forward starts."""
        _state_of(self).forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """Units re-gathered when this unit's backward starts."""
        _state_of(self).backward_prefetch = [_state_of(m) for m in modules]


_CUSTOM_COMM = (
    "{name}: hyper_parallel's collectives lay out their buffers their own way (a parameter "
    "of its own collective is gathered into and reduced from its own tensors, the rest "
    "fused; ranks' parts are passed without being joined), which FSDP2's {kind} protocol "
    "(allocate, then call on one flat buffer) does not describe. To all-gather in a lower "
    "precision, give parameters a gather codec (hp.set_gather_codec, or on torch a tensor "
    "subclass with FSDP2's fsdp_pre_all_gather/fsdp_post_all_gather); for lower-precision "
    "reductions use MixedPrecisionPolicy(reduce_dtype=...); to change reduced gradients, "
    "set_all_reduce_hook")


def share_comm_ctx(modules: list) -> None:
    """FSDP2's: roots (pipeline-parallel stages) share their communication streams. Here
    collectives run on the framework's own communication streams, which every root
    already shares, so after checking that every module is a unit there is nothing to
    do."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"share_comm_ctx expects a list of fully_shard modules, got "
                             f"{type(module).__name__}; call fully_shard on it first")


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` finishes the all-gather and
    makes the full parameters the module's attributes."""

    def __init__(self, state: FSDPState):
        self._state = state

    def wait(self) -> None:
        _unshard_explicitly(self._state)


def _unshard_explicitly(state: FSDPState) -> None:
    """``unshard()``: full parameters that no forward holds yet are gathered through a node
    no forward will differentiate (MindSpore records only what runs inside
    ``value_and_grad``), so they are marked ``spent``: the next forward makes its own node
    over the same tensors, with no all-gather, as after ``reshard_after_backward=False``."""
    fresh = state._full is None
    state.unshard()
    if fresh and state._full is not None:
        state._full.spent = True


def _as_scalar(value):
    platform = get_platform()
    if platform.is_tensor(value):
        shape = platform.shape(value)
        if math.prod(shape) != 1:
            raise ValueError(f"gradient scaling factor must be a one-element tensor, got shape {shape}")
        return float(platform.to_numpy(value).reshape(-1)[0])
    return value


def _state_of(module: Any) -> FSDPState:
    state = module.__dict__.get(STATE_ATTR)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not a fully_shard unit; call fully_shard on it first")
    return state


def _states_under(module: Any, recurse: bool) -> list:
    if not recurse:
        return [_state_of(module)]
    states = []
    for _, sub in get_platform().named_modules(module):
        state = sub.__dict__.get(STATE_ATTR)
        if state is not None and all(state is not s for s in states):
            states.append(state)
    return states


def _resolve_reshard_after_forward(value, shard_sizes: list):
    """``reshard_after_forward`` as the unit stores it: True, False or None (every unit but
    the root) or an int. An int is the size of the group to reshard to after forward and
    must divide the shard size of each of the unit's meshes (FSDP2's rule, per parameter
    group): 1 is False, a size equal to every shard size is True, and otherwise it stays
    an int (post_forward.py; a group whose shard size it equals reshards as with True).
    ``shard_sizes`` empty (a unit without parameters, which has nothing to reshard): any
    int >= 1 is accepted."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(f"reshard_after_forward must be a bool, None or an int (the size of the "
                         f"group to reshard to), got {value!r} of type {type(value).__name__}")
    if value < 1 or any(size % value for size in shard_sizes):
        sizes = " and ".join(str(size) for size in sorted(set(shard_sizes)))
        rule = "be >= 1" if not shard_sizes else (
            f"be a factor of the shard group size {sizes}" if len(set(shard_sizes)) == 1 else
            f"be a factor of the shard group size of each of the unit's meshes ({sizes})")
        raise ValueError(f"reshard_after_forward as an int is the size of the group to reshard "
                         f"to after forward and must {rule}, got {value}")
    if value == 1:
        # the default warnings filter shows it once per calling line
        warnings.warn("reshard_after_forward=1 (int) means resharding to a group of 1 rank, "
                      "i.e. keeping the full parameters: reshard_after_forward=False, not "
                      "True", UserWarning, stacklevel=3)
        return False
    if all(size == value for size in shard_sizes):
        return True
    return value


def _make_post_forward_group(platform, value, mesh_info: MeshInfo) -> None:
    """Make the groups ``reshard_after_forward=value`` reshards to on ``mesh_info`` (a
    collective call, on every rank), where the platform can free full parameters after
    forward; elsewhere an int keeps them until backward, as True does there."""
    size = post_forward_size(value, mesh_info)
    if size is not None and platform.capabilities.can_release_storage:
        mesh_info.post_forward_group(size)
