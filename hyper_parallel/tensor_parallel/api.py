"""``parallelize_module``: a plan of styles applied to a module's submodules over a 1-D mesh.

The styles are this package's on every framework; on torch a plan of torch's own styles
is checked the same way and then applied by torch's ``parallelize_module``, so scripts
written for torch's tensor parallelism keep their DTensor parameters.

[Note: plan keys]
Keys are matched as torch matches them: split at ".", each part an ``fnmatch`` pattern
over the names of the children at that level (so ``*`` matches one level), "" the module
itself; a key may match several submodules, each gets the style. Where torch warns and
skips a key matching no submodule, this raises: a plan that silently parallelizes less
than written trains something else than intended.

[Note: tied weights]
A column-wise or row-wise style replaces its module's parameters by new ones holding the
blocks, so a parameter two modules share (a head tied to the embedding) would become two
parameters, trained apart: refused, naming both places (torch's own parallelize_module
replaces each module's parameter the same way, and does not check).

[Note: validate everything, then change anything]
Every key is resolved and every (module, style) pair checked (``ParallelStyle.check``)
before the first style applies, so a bad plan raises with the module untouched. A module
fully_shard already manages is refused: its parameters are data-parallel shards, not the
blocks a style splits, and a style's hooks would run outside the unit's (style.py,
[Note: styles under fully_shard]): tensor parallelism first, then fully_shard, as torch.
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Any

from hyper_parallel.device_mesh import as_device_mesh
from hyper_parallel.unit_marks import is_sharded, is_unit
from hyper_parallel.platform import get_platform
from hyper_parallel.tensor_parallel.layout import tensor_parallel_layout
from hyper_parallel.tensor_parallel.style import ParallelStyle


def _children(module: Any) -> list:
    """``[(name, child)]``: the direct submodules of ``module``."""
    return [(name, sub) for name, sub in get_platform().named_modules(module)
            if name and "." not in name]


def _resolve(module: Any, key: str) -> list:
    """``[(qualified name, submodule)]`` that plan key ``key`` names under ``module``."""
    if key == "":
        return [("", module)]
    found = [("", module)]
    for token in key.split("."):
        level = [(f"{path}.{name}" if path else name, child)
                 for path, parent in found for name, child in _children(parent)
                 if fnmatch(name, token)]
        if not level:
            names = sorted({name for _, parent in found for name, _ in _children(parent)})
            raise KeyError(f"parallelize_module: plan key {key!r} matches no submodule: no "
                           f"child matching {token!r} (children there: {names}); fix the key")
        found = level
    return found


def _mesh_1d(device_mesh: Any) -> Any:
    if device_mesh is None:
        raise ValueError("parallelize_module needs device_mesh: a 1-D mesh of the "
                         "tensor-parallel ranks (e.g. mesh['tp'])")
    mesh = as_device_mesh(device_mesh)
    if mesh.ndim != 1:
        raise ValueError(f"parallelize_module takes a 1-D mesh; got a {mesh.ndim}-D mesh with "
                         f"dims {mesh.mesh_dim_names}: pass the tensor-parallel sub-mesh, "
                         f"e.g. mesh[{mesh.mesh_dim_names[-1]!r}]")
    return mesh


def _refuse_sharded(platform: Any, module: Any) -> None:
    for name, sub in platform.named_modules(module):
        managed = [attr for attr, param in platform.direct_params(sub) if is_sharded(param)]
        if is_unit(sub) or managed:
            where = f"{name}.{managed[0]}" if managed else name
            raise ValueError(f"parallelize_module: {where or 'the module'} is managed by "
                             f"fully_shard already; apply parallelize_module first, then "
                             f"fully_shard (as torch requires)")


def _refuse_tied(platform: Any, module: Any, pairs: list) -> None:
    places = {}
    for name, sub in platform.named_modules(module):
        for attr, param in platform.direct_params(sub):
            places.setdefault(id(param), []).append(f"{name}.{attr}" if name else attr)
    for name, sub, style in pairs:
        if type(style).__name__ not in ("ColwiseParallel", "RowwiseParallel"):
            continue  # hyper_parallel's, or torch's of the same name
        for attr, param in platform.direct_params(sub):
            if len(places[id(param)]) > 1:
                raise ValueError(
                    f"parallelize_module: {type(style).__name__} on {name or 'the module'} "
                    f"would split {attr!r}, a parameter shared by {places[id(param)]} (tied "
                    f"weights); the style gives its module a parameter of its own, so they "
                    f"would stop being one: untie them, or leave the module out of the plan")


def _plan_of(parallelize_plan: Any) -> dict:
    if isinstance(parallelize_plan, dict):
        return parallelize_plan
    return {"": parallelize_plan}


def _style_kind(platform: Any, plan: dict) -> str:
    """"core" where every style is this package's, "framework" where every one is the
    framework's own (torch's), a TypeError for anything else or a mix."""
    kinds = set()
    for key, style in plan.items():
        if isinstance(style, ParallelStyle):
            kinds.add("core")
        elif platform.is_framework_style(style):
            kinds.add("framework")
        else:
            raise TypeError(f"parallelize_plan[{key!r}] must be a style (hp.ColwiseParallel(), "
                            f"hp.RowwiseParallel(), ...); got {type(style).__name__}")
    if len(kinds) > 1:
        raise TypeError("parallelize_plan mixes hyper_parallel's styles (hp.ColwiseParallel, ...) "
                        "with torch's own (torch.distributed.tensor.parallel); use one kind: "
                        "hyper_parallel's run the same on every framework")
    return kinds.pop() if kinds else "core"


def parallelize_module(module: Any, device_mesh: Any = None,
                       parallelize_plan: ParallelStyle | dict | None = None, *,
                       src_data_rank: int | None = 0) -> Any:
    """Apply ``parallelize_plan`` (a style, or ``{submodule key: style}``) to ``module``
    over the 1-D ``device_mesh`` (hp's mesh or a slice of it; on torch also torch's own
    DeviceMesh); return ``module``. Split parameters take mesh rank ``src_data_rank``'s
    values (None: each rank keeps its own).

    A plan of torch's own styles (``torch.distributed.tensor.parallel``) is checked as
    any plan ([Note: plan keys], [Note: tied weights]), then applied by torch's
    ``parallelize_module``: DTensor parameters, torch's layouts and split rules."""
    if parallelize_plan is None:
        return module
    platform = get_platform(module)  # the model's framework decides, as for fully_shard
    mesh = _mesh_1d(device_mesh)
    if not isinstance(parallelize_plan, (dict, ParallelStyle)) and \
            not platform.is_framework_style(parallelize_plan):
        raise TypeError(f"parallelize_plan must be a style (hp.ColwiseParallel(), ...) or a "
                        f"dict of them; got {type(parallelize_plan).__name__}")
    plan = _plan_of(parallelize_plan)
    kind = _style_kind(platform, plan)
    _refuse_sharded(platform, module)
    pairs, seen = [], {}
    for key, style in plan.items():
        for name, sub in _resolve(module, key):
            if id(sub) in seen:
                raise ValueError(f"parallelize_module: submodule {name!r} is named by plan keys "
                                 f"{seen[id(sub)]!r} and {key!r}; give each submodule one style")
            seen[id(sub)] = key
            pairs.append((name, sub, style))
    for name, sub, style in pairs:
        for attr, param in platform.direct_params(sub):
            if tensor_parallel_layout(param) is not None or \
                    platform.param_local_values(param) is not param:
                raise ValueError(f"parallelize_module: {name or 'the module'}.{attr} is "
                                 f"tensor-parallel already; parallelize a module once")
        if kind == "core":
            style.check(sub, mesh)
    _refuse_tied(platform, module, pairs)
    if kind == "framework":
        if mesh.native is None:
            raise TypeError("torch's own styles need a mesh torch knows: hp.init_device_mesh's "
                            "(on torch) or torch's DeviceMesh")
        return platform.framework_parallelize(module, mesh.native, plan, src_data_rank)
    for _, sub, style in pairs:
        style.src_data_rank = src_data_rank
        style.apply(sub, mesh)
    return module
