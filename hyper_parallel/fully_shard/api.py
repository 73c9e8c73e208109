"""``fully_shard`` and the FSDPModule methods a wrapped module gains.

[Note: validate everything, then change anything]
``fully_shard`` first computes and checks the whole plan (mesh, managed parameters, shard
dims, ignored parameters, parameters already managed elsewhere) and only then replaces
parameters, swaps the class and installs hooks, so a bad call leaves the module untouched.

[Note: which parameters a unit manages]
The parameters registered on the given modules and their submodules, minus those of
submodules that are already units (apply fully_shard bottom-up, blocks first, then the
root) and minus ``ignored_params``. A parameter shared by modules of two different units
cannot be sharded by both: that is an error naming the fix (wrap their common ancestor).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable, Iterable

from hyper_parallel.fully_shard.param import (
    SHARDED_BY as _SHARDED_BY, FSDPParam, library_attrs, restore_library_attrs,
)
from hyper_parallel.fully_shard.mesh import (
    DataParallelMeshDims, MeshInfo, as_device_mesh, data_parallel_dims, data_parallel_mesh,
)
from hyper_parallel.fully_shard.param_group import FSDPParamGroup
from hyper_parallel.fully_shard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.fully_shard.reduce_op import normalize_reduce_op, validate_factor
from hyper_parallel.fully_shard.state import STATE_ATTR, FSDPState
from hyper_parallel.platform import get_platform

_REPLACED_BY = "_hp_replaced_by"    # on an original parameter a unit replaced


class FSDPModule:
    """Methods of a module after ``fully_shard`` (its class becomes ``FSDP<Class>``)."""

    def unshard(self, async_op: bool = False):
        """Gather this unit's full parameters now (they stay until the next forward uses
        them). With ``async_op=True`` return a handle; ``wait()`` makes them the attributes."""
        state = _state_of(self)
        state.keep_until_next_forward()  # the next forward uses these, gathered or in flight
        if not async_op:
            state.unshard()
            return None
        state.prefetch()
        return _UnshardHandle(state)

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
        params = state.group.params if state.group is not None else []
        kept = [library_attrs(fsdp_param.sharded_param) for fsdp_param in params]
        result = super()._apply(fn, *args, **kwargs)
        for fsdp_param, attrs in zip(params, kept):
            restore_library_attrs(fsdp_param.sharded_param, attrs)
            state.platform.refresh_converted_param(fsdp_param.sharded_param)
        return result

    def set_reshard_after_forward(self, reshard_after_forward: bool | int | None,
                                  recurse: bool = True) -> None:
        """Free full parameters after forward (re-gather for backward) or keep them. Takes
        what ``fully_shard`` takes: a bool, None (every unit but the root) or an int, the
        size of the group to reshard to (1: False, the shard size: True)."""
        states = _states_under(self, recurse)
        # resolve for every unit first: a value one unit rejects changes none
        values = []
        for state in states:
            shard_size = None if state.group is None else state.group.mesh_info.shard_size
            values.append(_resolve_reshard_after_forward(reshard_after_forward, shard_size))
        for state, value in zip(states, values):
            if state.group is not None:
                _make_post_forward_group(state.platform, value, state.group.mesh_info)
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


class _UnshardHandle:
    def __init__(self, state: FSDPState):
        self._state = state

    def wait(self) -> None:
        self._state.unshard()


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


@functools.lru_cache(maxsize=None)
def _fsdp_class(cls: type) -> type:
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})


def _resolve_dtype(platform, dtype):
    return platform.dtype(dtype) if isinstance(dtype, str) else dtype


def _resolve_reshard_after_forward(value, shard_size: int | None):
    """``reshard_after_forward`` as the unit stores it: True, False or None (every unit but
    the root) or an int. An int is the size of the group to reshard to after forward and
    must divide ``shard_size`` (FSDP2's rule): 1 is False, ``shard_size`` is True, and a
    size between stays an int (post_forward.py). ``shard_size`` None (a unit without
    parameters, which has nothing to reshard): any int >= 1 is accepted."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(f"reshard_after_forward must be a bool, None or an int (the size of the "
                         f"group to reshard to), got {value!r} of type {type(value).__name__}")
    if value < 1 or (shard_size is not None and shard_size % value != 0):
        rule = "be >= 1" if shard_size is None else f"be a factor of the shard group size {shard_size}"
        raise ValueError(f"reshard_after_forward as an int is the size of the group to reshard "
                         f"to after forward and must {rule}, got {value}")
    if value == 1:
        # the default warnings filter shows it once per calling line
        warnings.warn("reshard_after_forward=1 (int) means resharding to a group of 1 rank, "
                      "i.e. keeping the full parameters: reshard_after_forward=False, not "
                      "True", UserWarning, stacklevel=3)
        return False
    if shard_size is None or value == shard_size:
        return True
    return value


def _make_post_forward_group(platform, value, mesh_info: MeshInfo) -> None:
    """Make the groups ``reshard_after_forward=value`` reshards to (a collective call, on
    every rank), where the platform can free full parameters after forward; elsewhere an
    int keeps them until backward, as True does there."""
    if (not isinstance(value, bool) and isinstance(value, int)
            and platform.capabilities.can_release_storage):
        mesh_info.post_forward_group(value)


def _shard_dim(param, fqn: str, ndim: int, shard_placement_fn: Callable | None) -> int:
    if ndim == 0:
        raise ValueError(f"parameter {fqn!r} is 0-dimensional and cannot be sharded; "
                         f"pass it in ignored_params")
    chosen = shard_placement_fn(param) if shard_placement_fn is not None else None
    dim = 0 if chosen is None else getattr(chosen, "dim", chosen)
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"shard_placement_fn returned {chosen!r} for parameter {fqn!r} of "
                         f"{ndim} dims; return a dim in [{-ndim}, {ndim}) (or None for dim 0)")
    return dim % ndim


def _ignored_list(platform, ignored_params) -> list:
    """``ignored_params`` as a list of tensors. Parameters outside the given modules are
    allowed and left alone (FSDP2); anything that is not a tensor is an error."""
    if ignored_params is None:
        return []
    if platform.is_tensor(ignored_params) or isinstance(ignored_params, (str, bytes)) \
            or not isinstance(ignored_params, Iterable):
        raise TypeError(f"ignored_params must be a collection (set, list or tuple) of parameters, "
                        f"got a {type(ignored_params).__name__}; wrap a single parameter: "
                        f"ignored_params={{param}}")
    ignored = list(ignored_params)
    for item in ignored:
        if not platform.is_tensor(item):
            raise TypeError(f"ignored_params holds a {type(item).__name__} ({item!r:.60}), which "
                            f"is not a parameter; pass the parameters themselves (e.g. "
                            f"module.weight), not their names")
    return ignored


def _managed_params(platform, modules: list, ignored_ids: set) -> tuple[list, set]:
    """[(fqn, param, slots)] for the unit, and the ids of every parameter seen."""
    skip: set = set()
    for root in modules:
        for name, sub in platform.named_modules(root):
            if sub is not root and STATE_ATTR in sub.__dict__:
                skip.update(id(m) for _, m in platform.named_modules(sub))
    by_id: dict = {}
    seen: set = set()
    for index, root in enumerate(modules):
        prefix = f"[{index}]." if len(modules) > 1 else ""
        for name, sub in platform.named_modules(root):
            for attr, param in platform.direct_params(sub):
                seen.add(id(param))
                if id(sub) in skip or id(param) in ignored_ids:
                    continue
                fqn = prefix + (f"{name}.{attr}" if name else attr)
                entry = by_id.setdefault(id(param), [fqn, param, []])
                if all(m is not sub or a != attr for m, a in entry[2]):
                    entry[2].append((sub, attr))
    return [tuple(v) for v in by_id.values()], seen


def fully_shard(module, *, mesh=None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: Iterable | None = None, shard_threshold_bytes: int = 0,
                own_collective_bytes: int | None | str = "auto",
                dp_mesh_dims: DataParallelMeshDims | None = None):
    """Shard ``module``'s parameters over ``mesh`` (FSDP2 semantics); return ``module``.

    ``mesh`` is read by position: 1-D is (shard,), 2-D is (replicate, shard), whatever the
    dim names. On a mesh of more dims ``dp_mesh_dims`` says which dims shard and replicate;
    parameters are replicated over the others (e.g. tensor parallel), and no gradient is
    reduced over them (mesh.py, [Note: which dims are data parallel]).

    ``module`` may be a list of modules forming one unit (one all-gather for all of them).
    ``reshard_after_forward``: True, False, None (True for every unit but the root) or an
    int k, the size of the group to reshard to (1 is False, the shard size is True; between,
    each rank keeps its part of the full parameters over a group of k ranks and the
    re-gather before backward goes over that group only, post_forward.py). ``ignored_params`` may hold parameters of other modules
    (left alone).
    A parameter of fewer than ``shard_threshold_bytes`` bytes is not sharded: every rank
    keeps it whole and its gradient is all-reduced over the data-parallel group (default
    0: shard everything, as FSDP2).
    A sharded parameter whose all-gather piece (its padded shard in the compute dtype) has
    at least ``own_collective_bytes`` bytes gets its own all-gather and reduce-scatter,
    which need no copy into or out of a fused buffer; the others share the unit's fused
    collectives. ``None``: always fuse (FSDP2's layout); ``"auto"``: the platform's default
    (torch on CPU: 1 MiB; CUDA and MindSpore: fuse).
    """
    platform = get_platform()
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for m in modules:
        if STATE_ATTR in m.__dict__:
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__}; "
                             f"apply it once per module (use the FSDPModule setters to change settings)")
    for name, value, kind in (("mp_policy", mp_policy, MixedPrecisionPolicy),
                              ("offload_policy", offload_policy, OffloadPolicy)):
        if not isinstance(value, kind):
            raise TypeError(f"fully_shard: {name} must be a hp.{kind.__name__}, got {value!r}; "
                            f"leave it out for the default ({kind.__name__}())")
    device_mesh = as_device_mesh(mesh)
    replicate_dims, shard_dims = data_parallel_dims(device_mesh, dp_mesh_dims)
    if isinstance(offload_policy, CPUOffloadPolicy) and platform.device_type() != "cpu":
        raise NotImplementedError("CPUOffloadPolicy is not implemented on accelerators yet; "
                                  "use OffloadPolicy() (on a CPU device it is not needed)")
    if isinstance(shard_threshold_bytes, bool) or not isinstance(shard_threshold_bytes, int) \
            or shard_threshold_bytes < 0:
        raise ValueError(f"shard_threshold_bytes must be an int >= 0, got {shard_threshold_bytes!r}")
    if own_collective_bytes == "auto":
        own_collective_bytes = platform.capabilities.default_own_collective_bytes
    elif own_collective_bytes is not None and (
            isinstance(own_collective_bytes, bool) or not isinstance(own_collective_bytes, int)
            or own_collective_bytes < 0):
        raise ValueError(f"own_collective_bytes must be an int >= 0, None (always fuse) or "
                         f"'auto', got {own_collective_bytes!r}")
    ignored_ids = {id(p) for p in _ignored_list(platform, ignored_params)}
    managed, _ = _managed_params(platform, modules, ignored_ids)
    param_dtype = _resolve_dtype(platform, mp_policy.param_dtype)
    reduce_dtype = _resolve_dtype(platform, mp_policy.reduce_dtype)
    _resolve_dtype(platform, mp_policy.output_dtype)
    plan = []
    for fqn, param, slots in managed:
        owner = getattr(param, _SHARDED_BY, None) or getattr(param, _REPLACED_BY, None)
        if owner is not None:
            raise ValueError(
                f"parameter {fqn!r} is already managed by the fully_shard unit {owner}: either "
                f"fully_shard was applied top-down (apply it to the blocks first, then the root) "
                f"or the parameter is shared with modules of another unit (wrap only their "
                f"common ancestor, so one unit owns it)")
        local = platform.param_local_values(param)  # what this rank shards (tensor parallel)
        nbytes = math.prod(platform.shape(local)) * platform.element_size(platform.dtype_of(local))
        plan.append((fqn, param, slots, _shard_dim(param, fqn, len(platform.shape(param)),
                                                 shard_placement_fn), nbytes >= shard_threshold_bytes))

    info = MeshInfo(data_parallel_mesh(device_mesh, replicate_dims, shard_dims), device_mesh,
                    shard_dims)
    has_small = not all(is_sharded for *_, is_sharded in plan)
    if has_small and info.replicate_size > 1 and info.shard_size > 1 \
            and info.mesh.size() != platform.world_size():
        raise ValueError("shard_threshold_bytes with both a shard and a replicate dim is only "
                         "supported where the data-parallel ranks are the whole job (small "
                         "parameters are all-reduced over the whole job); use a mesh of only "
                         "data-parallel dims over all ranks, or shard_threshold_bytes=0")
    reshard_after_forward = _resolve_reshard_after_forward(reshard_after_forward, info.shard_size)
    _make_post_forward_group(platform, reshard_after_forward, info)
    unit_name = "+".join(type(m).__name__ for m in modules)
    fsdp_params = []
    for fqn, param, slots, dim, is_sharded in plan:  # may still fail: nothing changed yet
        fsdp_params.append(FSDPParam(platform, fqn, param, slots, dim, info, is_sharded=is_sharded))
    for fsdp_param, (_, param, *_) in zip(fsdp_params, plan):
        fsdp_param.register()
        object.__setattr__(param, _REPLACED_BY, unit_name)
        object.__setattr__(fsdp_param.sharded_param, _SHARDED_BY, unit_name)
    group = None
    if fsdp_params:
        group = FSDPParamGroup(platform, fsdp_params, info, param_dtype, reduce_dtype,
                               own_collective_bytes)
    state = FSDPState(platform, unit_name, modules, group, reshard_after_forward, mp_policy)
    for m in modules:
        object.__setattr__(m, STATE_ATTR, state)
        m.__class__ = _fsdp_class(type(m))
        platform.register_forward_hooks(m, state.pre_forward, state.post_forward)
    return module
