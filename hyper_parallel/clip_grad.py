"""Gradient clipping by the total norm of a sharded model's gradients, on both frameworks.

Design note
-----------
Under fully_shard each rank holds only its shard of a parameter's gradient, so a rank's own
norm is not the model's (MindSpore's ``ops.clip_by_global_norm`` on shard gradients uses
exactly that, and clips every rank by a different factor). The total norm here equals the
single-process norm of the full gradients:

- a sharded parameter's gradient is split over its unit's **shard group** only: the
  partial sums ``sum |g|^p`` (``inf``: the largest ``|g|``) of those shards are reduced over
  that group, never over the replicate dim of an HSDP mesh, whose ranks hold copies;
- a parameter kept whole (below ``shard_threshold_bytes``, a shard group of one rank, an
  ignored parameter, a module no unit manages) is the same on every rank and is counted
  once, locally;
- a parameter split by the core's tensor parallelism (``tensor_parallel_layout``) holds
  this rank's block: a ``Shard`` block's sums are reduced over its tensor-parallel group
  too (after the shard group, where a unit shards it), a ``Replicate`` one (every rank
  of that group holds the same values and gradient) is counted once;
- units on different meshes reduce over their own groups, in the order their parameters
  come (the same on every rank, which passes the same parameters);
- meshes that span different numbers of ranks are refused (``placement.ranks_spanned``):
  the ranks a sub-mesh leaves out hold parameters of their own, which no rank sees; a
  parameter split by tensor or expert parallelism spans its unit's mesh times its split
  mesh (experts sharded inside an expert group and split over the expert ranks are seen
  whole, each counted once);
- padding rows of a padded local shard (MindSpore) are left out of the norm;
- each gradient's norm is taken in float32 whatever its dtype, and the groups' sums are
  combined on the host in double precision.

Every gradient is then multiplied by ``max_norm / (total + 1e-6)`` clamped to 1, as torch's
``clip_grad_norm_`` does. The platform gives only the primitives: a tensor's norm
(``vector_norm``), the gradient on a parameter (``param_grad``), ``scale``, ``copy_into``
and ``all_reduce``.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any

import numpy as np

from hyper_parallel.fully_shard.param import FSDPParam, fsdp_param_of
from hyper_parallel.fully_shard.placement import ranks_spanned
from hyper_parallel.platform import get_platform
from hyper_parallel.tensor_parallel.layout import tensor_parallel_layout

if TYPE_CHECKING:
    from hyper_parallel.platform import Platform

#: added to the total norm before dividing, as torch does (a zero norm clips nothing)
EPS = 1e-6


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, *, grads: Any = None,
                    pp_mesh: Any = None) -> Any:
    """Scale gradients so that their total ``norm_type``-norm is at most ``max_norm``; return
    the total norm (a float32 tensor, equal on every rank) taken before clipping.

    ``grads=None`` (torch): the gradients are the parameters' ``.grad``, scaled in place;
    returns the norm. ``grads`` given (required on MindSpore, where ``value_and_grad``
    returns the gradients): one gradient (or None) per parameter, in order; returns
    ``(clipped gradients as a tuple, total norm)`` and leaves ``grads`` unchanged.

    ``pp_mesh`` (torchtitan's name): the 1-D pipeline mesh; each rank passes its stages'
    parameters and the norm is over every stage's (their partial sums reduced over it)."""
    platform = get_platform()
    max_norm, norm_type = _checked_numbers(max_norm, norm_type)
    params = _as_list(platform, parameters, "parameters")
    if grads is None:
        if platform.capabilities.returns_grads_from_backward:
            raise TypeError(f"on {platform.name} gradients are returned by value_and_grad, not "
                            f"attached to the parameters: pass them, "
                            f"`grads, norm = hp.clip_grad_norm_(params, max_norm, grads=grads)`")
        pairs = [(p, g) for p in params if (g := platform.param_grad(p)) is not None]
    else:
        grads = _as_list(platform, grads, "grads", allow_none=True)
        if len(grads) != len(params):
            raise ValueError(f"grads has {len(grads)} entries but parameters has {len(params)}: "
                             f"pass one gradient (or None) per parameter, in the same order")
        pairs = [(p, g) for p, g in zip(params, grads) if g is not None]
    total = total_norm(platform, pairs, norm_type)
    if pp_mesh is not None:
        total = _over_stages(platform, total, norm_type, pp_mesh)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total}, "
                           f"so they cannot be clipped; pass error_if_nonfinite=False to scale "
                           f"them anyway (they then become non-finite too)")
    coef = max_norm / (total + EPS)
    clips = coef < 1.0 or math.isnan(coef)  # a NaN total makes the gradients NaN, as torch's
    norm = platform.from_numpy(np.array(total, dtype=np.float32))
    if grads is None:
        if clips:
            for param, g in pairs:
                local = _local(platform, param, g)
                platform.copy_into(local, platform.scale(local, coef))
        return norm
    clipped = tuple(None if g is None else (platform.scale(g, coef) if clips else g)
                    for g in grads)
    return clipped, norm


def total_norm(platform: Platform, pairs: list, norm_type: float) -> float:
    """The ``norm_type``-norm of the full gradients of ``pairs`` (parameter, this rank's
    gradient), the same on every rank: see the design note."""
    whole = []  # norms of gradients every rank holds whole
    by_groups: dict = {}  # ids of the groups -> ([(group, dim name)], norms of this rank's parts)
    spans = ranks_spanned(fp for fp in map(fsdp_param_of, (p for p, _ in pairs))
                          if fp is not None)
    if spans:
        raise NotImplementedError(
            f"the parameters are sharded over meshes spanning {spans[0]} and {spans[-1]} "
            f"ranks: the ranks a smaller mesh leaves out hold parameters of their own (other "
            f"experts, with expert parallelism), whose gradients no rank sees, so no rank can "
            f"take the total norm. Pass each mesh's parameters apart (clip_grad_norm_(them, "
            f"float('inf')) returns their norm and scales nothing), combine the norms across "
            f"the ranks that hold different parameters and scale the gradients yourself; or "
            f"shard every parameter over meshes of the same ranks")
    for param, grad in pairs:
        fsdp_param = fsdp_param_of(param)
        if fsdp_param.is_tensor_parallel if fsdp_param is not None else \
                platform.param_local_values(param) is not param:
            raise NotImplementedError(
                f"a parameter of shape {platform.shape(param)} is split by tensor parallelism, "
                f"whose dims this norm does not reduce over: use "
                f"torch.nn.utils.clip_grad_norm_, which reads the DTensor gradients' placements")
        grad = _local(platform, param, grad)
        groups = _groups_over(fsdp_param, tensor_parallel_layout(param))
        if fsdp_param is not None and fsdp_param.shard_size > 1:
            grad = _without_padding(platform, fsdp_param, grad)
        if grad is None or not _numel(platform, grad):
            grad = None
        if not groups:
            if grad is not None:
                whole.append(platform.vector_norm(grad, norm_type))
            continue
        _, norms = by_groups.setdefault(tuple(id(group) for group, _ in groups), (groups, []))
        if grad is not None:
            norms.append(platform.vector_norm(grad, norm_type))
    is_inf = math.isinf(norm_type)
    partials = [_combined(platform, whole, norm_type)]
    for groups, norms in by_groups.values():  # every rank of a group joins, shards or not
        local = _combined(platform, norms, norm_type)
        value = platform.from_numpy(np.array([local if is_inf else local ** norm_type],
                                             dtype=np.float32))
        for group, dim in groups:
            platform.all_reduce(value, group, op="max" if is_inf else "sum", dim=dim).wait()
        reduced = float(platform.to_numpy(value)[0])
        partials.append(reduced if is_inf else reduced ** (1.0 / norm_type))
    return _combined_floats(partials, norm_type)


def _over_stages(platform: Platform, total: float, norm_type: float, pp_mesh: Any) -> float:
    """The norm over every pipeline stage from each stage's ``total``."""
    if getattr(pp_mesh, "ndim", None) != 1:
        raise TypeError(f"pp_mesh must be a 1-D hp DeviceMesh (mesh['pp']), got "
                        f"{type(pp_mesh).__name__}")
    is_inf = math.isinf(norm_type)
    value = platform.from_numpy(np.array([total if is_inf else total ** norm_type], np.float32))
    platform.all_reduce(value, pp_mesh.get_group(0), op="max" if is_inf else "sum",
                        dim=pp_mesh.mesh_dim_names[0]).wait()
    reduced = float(platform.to_numpy(value)[0])
    return reduced if is_inf else reduced ** (1.0 / norm_type)


def _groups_over(fsdp_param: FSDPParam | None, layout: Any) -> list:
    """``[(group, dim name)]`` a gradient's partial sums are reduced over: its unit's shard
    group where the unit shards it, then its tensor-parallel group where tensor
    parallelism split it into different blocks (a replicated block is counted once)."""
    groups = []
    if fsdp_param is not None and fsdp_param.shard_size > 1:
        groups.append((fsdp_param.mesh_info.shard_group, "shard"))
    if layout is not None and layout.placement.is_shard() and layout.mesh.size() > 1:
        groups.append((layout.mesh.get_group(0), layout.mesh_dim_name))
    return groups


def _combined(platform: Platform, norms: list, norm_type: float) -> float:
    """The norm of several tensors from their norms, read on the host."""
    if not norms:
        return 0.0
    flat = platform.cat([platform.reshape(n, (1,)) for n in norms], 0)
    return float(platform.to_numpy(platform.vector_norm(flat, norm_type)))


def _combined_floats(norms: list, norm_type: float) -> float:
    if math.isinf(norm_type):
        return max(norms)
    return math.fsum(n ** norm_type for n in norms) ** (1.0 / norm_type)


def _without_padding(platform: Platform, fsdp_param: FSDPParam, grad: Any) -> Any:
    """This rank's real rows of a shard gradient (None if it owns none): a padded local
    shard's trailing rows are not the parameter's."""
    if fsdp_param.local_rows == 0:
        return None
    if platform.shape(grad)[fsdp_param.shard_dim] == fsdp_param.local_rows:
        return grad
    return platform.narrow(grad, fsdp_param.shard_dim, 0, fsdp_param.local_rows)


def _local(platform: Platform, param: Any, grad: Any) -> Any:
    """This rank's part of a managed parameter's gradient (torch: a DTensor's local tensor,
    which writes reach); any other gradient as it is."""
    return grad if fsdp_param_of(param) is None else platform.local_tensor(grad)


def _numel(platform: Platform, tensor: Any) -> int:
    return math.prod(platform.shape(tensor))


def _checked_numbers(max_norm: Any, norm_type: Any) -> tuple:
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__} "
                            f"{value!r}")
    max_norm, norm_type = float(max_norm), float(norm_type)
    if math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm must be a non-negative number, got {max_norm}")
    if math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"norm_type must be positive (2.0 for the Euclidean norm, "
                         f"float('inf') for the largest absolute value), got {norm_type}")
    return max_norm, norm_type


def _as_list(platform: Platform, values: Any, what: str, allow_none: bool = False) -> list:
    """One tensor or an iterable of them, as a list (a generator is read once)."""
    if platform.is_tensor(values):
        return [values]
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"{what} must be a tensor or an iterable of tensors, got "
                        f"{type(values).__name__}") from None
    for i, item in enumerate(items):
        if not platform.is_tensor(item) and not (allow_none and item is None):
            raise TypeError(f"{what}[{i}] is a {type(item).__name__}, not a tensor")
    return items
