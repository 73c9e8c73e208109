"""``fully_shard``: make a module (or a list of modules) one unit of sharded parameters.

[Note: validate everything, then change anything]
``fully_shard`` first checks every argument (modules of the process's framework, none of
them sharded by the framework's own fully_shard, a joined job where a launcher started one,
policies and their dtypes, mesh and device, callables, thresholds) and computes and checks
the whole plan (managed parameters, shard dims and meshes, ignored parameters, parameters
already managed elsewhere); only then does it replace parameters, swap the class and
install hooks, so a bad call leaves the module untouched.

[Note: which parameters a unit manages]
The parameters registered on the given modules and their submodules, minus those of
submodules that are already units (apply fully_shard bottom-up, blocks first, then the
root) and minus ``ignored_params``. A parameter shared by modules of two different units
cannot be sharded by both: that is an error naming the fix (wrap their common ancestor).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterable

from hyper_parallel.fully_shard.param import SHARDED_BY as _SHARDED_BY, FSDPParam
from hyper_parallel.device_mesh import DeviceMesh, as_device_mesh
from hyper_parallel.fully_shard.mesh import (
    DataParallelMeshDims, MeshInfo, data_parallel_dims, data_parallel_mesh,
)
from hyper_parallel.fully_shard.placement import placement_mesh, resolve_placement
from hyper_parallel.fully_shard.layout import LayoutStrategy
from hyper_parallel.fully_shard.param_group import FSDPParamGroup
from hyper_parallel.fully_shard.policy import (
    CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, as_policy, policy_dtypes,
)
from hyper_parallel.fully_shard.fsdp_module import (
    FSDPModule, _make_post_forward_group, _resolve_reshard_after_forward,
)
from hyper_parallel.fully_shard.state import STATE_ATTR, FSDPState
from hyper_parallel.fully_shard.iteration import reduce_accumulated
from hyper_parallel.launcher_job import require_joined_job
from hyper_parallel.platform import MODULE_CLASSES, get_platform, module_framework
from hyper_parallel.tensor_parallel.layout import tensor_parallel_layout

_REPLACED_BY = "_hp_replaced_by"    # on an original parameter a unit replaced


@functools.lru_cache(maxsize=None)
def _fsdp_class(cls: type, platform_bases: tuple) -> type:
    """``FSDP<cls>``: our methods first, then the module's class, then the platform's
    ``unit_bases`` (torch: FSDP2's own ``FSDPModule``, so torch's code recognises a unit)."""
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls, *platform_bases), {})


def _module_list(module) -> list:
    """``module`` as a list of modules of one framework; anything else is a TypeError."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    expected = " or a ".join(spelling for *_, spelling in MODULE_CLASSES.values())
    for m in modules:
        if module_framework(m) is None:
            raise TypeError(f"fully_shard takes a {expected}, or a list of them; got "
                            f"{'None' if m is None else 'a ' + type(m).__name__}"
                            f"{' in the list' if m is not module else ''}")
    frameworks = sorted({module_framework(m) for m in modules})
    if len(frameworks) > 1:
        raise TypeError(f"fully_shard got modules of {' and '.join(frameworks)} in one list; a "
                        f"unit's modules are of one framework")
    return modules


def _refuse_native_units(platform, modules: list) -> None:
    """A module the framework's own fully_shard sharded (torch's FSDP2) cannot be, or be
    inside, a unit of ours: its parameters are that API's shards."""
    for root in modules:
        for name, sub in platform.named_modules(root):
            api = platform.native_unit_api(sub)
            if api is not None:
                which = (f"a {type(root).__name__} whose submodule {name!r} "
                         f"({type(sub).__name__}) is" if name else
                         f"a {type(root).__name__}, which is")
                raise ValueError(
                    f"fully_shard got {which} sharded by {api} already; one model's units "
                    f"must all be hyper_parallel's: apply hp.fully_shard to the model before "
                    f"any other sharding, in place of {api}")


def _mesh_info(mesh: DeviceMesh, replicate_dims: tuple, shard_dims: tuple) -> MeshInfo:
    return MeshInfo(data_parallel_mesh(mesh, replicate_dims, shard_dims), mesh, shard_dims)


def _group_by_mesh(platform, default: MeshInfo, plan: list) -> list:
    """``[(MeshInfo, plan entries)]``: one per distinct set of groups the parameters are
    sharded over, in order of first use (placement.py, [Note: a unit over several meshes])."""
    found = []
    for entry in plan:
        fqn, placed = entry[0], entry[4]
        info = default
        if placed is not None:
            mesh = placement_mesh(platform, placed, fqn)
            info = _mesh_info(mesh, *data_parallel_dims(mesh, placed.dp_mesh_dims))
        for known, entries in found:
            if known.same_groups(info):
                entries.append(entry)
                break
        else:
            found.append((info, [entry]))
    return found


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


def _check_tensor_parallel_apart(platform, info: MeshInfo, entries: list) -> None:
    """A parameter split by the core's tensor parallelism is sharded over data-parallel
    ranks that hold the same tensor-parallel block: its mesh may share no rank but this one
    with the unit's data-parallel mesh (torch checks the same of a DTensor's mesh)."""
    data_parallel = set(info.mesh.ranks)
    for fqn, param, *_ in entries:
        layout = tensor_parallel_layout(param)
        if layout is not None and data_parallel & set(layout.mesh.ranks) != {platform.rank()}:
            raise ValueError(
                f"parameter {fqn!r} is split by tensor parallelism over ranks "
                f"{sorted(layout.mesh.ranks)}, and fully_shard's data-parallel mesh "
                f"{info.mesh.mesh_dim_names} spans ranks {sorted(data_parallel)}, which hold "
                f"other blocks of it: shard over the data-parallel dims only (e.g. "
                f"fully_shard(block, mesh=mesh['dp']) after parallelize_module(model, "
                f"mesh['tp'], plan))")


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
    (left alone). ``shard_placement_fn(param)`` gives a parameter's shard dim, or a
    ``ShardPlacementResult`` with a mesh of its own too (placement.py): the unit then
    keeps one parameter group per mesh.
    A parameter of fewer than ``shard_threshold_bytes`` bytes is not sharded: every rank
    keeps it whole and its gradient is all-reduced over the data-parallel group (default
    0: shard everything, as FSDP2).
    A sharded parameter whose all-gather piece (its padded shard in the compute dtype) has
    at least ``own_collective_bytes`` bytes gets its own all-gather and reduce-scatter,
    which need no copy into or out of a fused buffer; the others share the unit's fused
    collectives. ``None``: always fuse (FSDP2's layout); ``"auto"``: the platform's default
    (torch on CPU: 1 MiB; CUDA and MindSpore: fuse).
    ``mp_policy`` and ``offload_policy`` are ours, or on torch FSDP2's own (policy.py).
    """
    modules = _module_list(module)
    platform = get_platform(modules[0])
    require_joined_job("fully_shard", platform)
    _refuse_native_units(platform, modules)
    for m in modules:
        if STATE_ATTR in m.__dict__:
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__}; "
                             f"apply it once per module (use the FSDPModule setters to change settings)")
    mp_policy = as_policy(mp_policy, MixedPrecisionPolicy, "mp_policy", platform.option_from_native)
    offload_policy = as_policy(offload_policy, OffloadPolicy, "offload_policy",
                               platform.option_from_native)
    param_dtype, reduce_dtype, _ = policy_dtypes(platform, mp_policy)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"shard_placement_fn must be a function of a parameter (or None), got "
                        f"{shard_placement_fn!r}")
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
    ignored_ids.update(id(p) for m in modules for _, sub in platform.named_modules(m)
                       for p in platform.updated_in_forward(sub))
    managed, _ = _managed_params(platform, modules, ignored_ids)
    plan = []
    for fqn, param, slots in managed:
        owner = getattr(param, _SHARDED_BY, None) or getattr(param, _REPLACED_BY, None)
        if owner is not None:
            raise ValueError(
                f"Parameter {fqn!r} is shared with a parameter already managed by another "
                f"FSDP group (the fully_shard unit {owner}): either fully_shard was applied "
                f"top-down (apply it to the blocks first, then the root) or the parameter is "
                f"shared with modules of another unit (wrap only their common ancestor, or "
                f"both modules as one unit, fully_shard([module_a, module_b]), so one unit "
                f"owns it)")
        local = platform.param_local_values(param)  # what this rank shards (tensor parallel)
        nbytes = math.prod(platform.shape(local)) * platform.element_size(platform.dtype_of(local))
        dim, placed = resolve_placement(platform, param, fqn, len(platform.shape(param)),
                                        shard_placement_fn)
        plan.append((fqn, param, slots, dim, placed, nbytes >= shard_threshold_bytes))

    default = _mesh_info(device_mesh, replicate_dims, shard_dims)
    by_mesh = _group_by_mesh(platform, default, plan)
    for info, entries in by_mesh:
        has_small = not all(is_sharded for *_, is_sharded in entries)
        if has_small and info.replicate_size > 1 and info.shard_size > 1 \
                and info.mesh.size() != platform.world_size():
            raise ValueError("shard_threshold_bytes with both a shard and a replicate dim is "
                             "only supported where the data-parallel ranks are the whole job "
                             "(small parameters are all-reduced over the whole job); use a mesh "
                             "of only data-parallel dims over all ranks, or "
                             "shard_threshold_bytes=0")
    for info, entries in by_mesh:
        _check_tensor_parallel_apart(platform, info, entries)
    infos = [info for info, _ in by_mesh] or [default]
    reshard_after_forward = _resolve_reshard_after_forward(
        reshard_after_forward, [info.shard_size for info in infos])
    for info in infos:
        _make_post_forward_group(platform, reshard_after_forward, info)
    unit_name = "+".join(type(m).__name__ for m in modules)
    made = []  # may still fail: nothing changed yet
    for info, entries in by_mesh:
        made.append((info, [FSDPParam(platform, fqn, param, slots, dim, info, is_sharded=is_sharded)
                            for fqn, param, slots, dim, _, is_sharded in entries], entries))
    for _, fsdp_params, entries in made:
        for fsdp_param, (_, param, *_) in zip(fsdp_params, entries):
            fsdp_param.register()
            object.__setattr__(param, _REPLACED_BY, unit_name)
            object.__setattr__(fsdp_param.sharded_param, _SHARDED_BY, unit_name)
    groups = [FSDPParamGroup(platform, fsdp_params, info, param_dtype, reduce_dtype,
                             LayoutStrategy(own_collective_bytes))
              for info, fsdp_params, _ in made]
    state = FSDPState(platform, unit_name, modules, groups, reshard_after_forward, mp_policy)
    for m in modules:
        object.__setattr__(m, STATE_ATTR, state)
        m.__class__ = _fsdp_class(type(m), platform.unit_bases())
        platform.present_unit(m, functools.partial(reduce_accumulated, state))
        platform.register_forward_hooks(m, state.pre_forward, state.post_forward)
    return module
