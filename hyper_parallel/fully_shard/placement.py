"""Where ``shard_placement_fn`` puts each parameter: its shard dim, and the mesh it is
sharded over.

[Note: a unit over several meshes]
``shard_placement_fn(param)`` returns a dim (``Shard(d)``, an int, None for 0), which shards
the parameter over ``fully_shard``'s mesh, or a ``ShardPlacementResult``, which names a
mesh of its own too, as FSDP2's does: the experts of a mixture-of-experts layer sharded
over an expert-data-parallel mesh while the rest of the unit uses the whole data-parallel
mesh. The unit then keeps one parameter group per distinct set of process groups (api.py),
each gathering, reduce-scattering and all-reducing over its own groups. Every rank
calls the function and must place the same parameters alike (each on a mesh it belongs
to), so every rank forms the same groups in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from hyper_parallel.device_mesh import DeviceMesh, as_device_mesh
from hyper_parallel.fully_shard.mesh import DataParallelMeshDims, as_dp_mesh_dims

if TYPE_CHECKING:
    from hyper_parallel.platform import Platform


@dataclass(frozen=True)
class ShardPlacementResult:
    """A parameter's shard dim and mesh, as ``shard_placement_fn`` may return them (FSDP2's
    ``ShardPlacementResult``). ``placement``: ``Shard(d)``, an int dim or None (dim 0).
    ``mesh``: an ``hp.DeviceMesh`` (or a torch DeviceMesh), read as ``fully_shard`` reads
    its ``mesh``: 1-D shards, 2-D replicates then shards, and ``dp_mesh_dims`` names the
    data-parallel dims of any mesh (FSDP2's ``FSDPMeshInfo(mesh, shard_mesh_dim=s)`` is
    ``dp_mesh_dims=DataParallelMeshDims(shard=s)``; ``HSDPMeshInfo(mesh, shard_mesh_dim=s,
    replicate_mesh_dim=r)`` adds ``replicate=r``)."""

    placement: Any
    mesh: Any
    dp_mesh_dims: DataParallelMeshDims | None = None

    def __post_init__(self):
        dim = getattr(self.placement, "dim", self.placement)
        if self.placement is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
            raise TypeError(f"ShardPlacementResult.placement must be Shard(dim), an int dim or "
                            f"None (dim 0), got {self.placement!r}")
        if self.mesh is None:
            raise TypeError("ShardPlacementResult needs a mesh; to shard over fully_shard's own "
                            "mesh, return the dim alone (Shard(dim), an int or None)")
        object.__setattr__(self, "dp_mesh_dims", as_dp_mesh_dims(self.dp_mesh_dims))
        if self.dp_mesh_dims is not None and not isinstance(self.dp_mesh_dims,
                                                            DataParallelMeshDims):
            raise TypeError(f"ShardPlacementResult.dp_mesh_dims must be a hp.DataParallelMeshDims "
                            f"(on torch, torch.distributed.fsdp.DataParallelMeshDims too) or "
                            f"None, got {type(self.dp_mesh_dims).__name__}")


def resolve_placement(platform: Platform, param: Any, fqn: str, ndim: int,
                      shard_placement_fn: Callable | None) -> tuple:
    """``(dim, result)``: the dim to shard ``param`` on, in ``[0, ndim)``, and its
    ``ShardPlacementResult`` (None: ``fully_shard``'s mesh). A framework's own result
    (torch's) is read through ``Platform.shard_placement_from_native``."""
    if ndim == 0:
        raise ValueError(f"parameter {fqn!r} is 0-dimensional and cannot be sharded; "
                         f"pass it in ignored_params")
    chosen = shard_placement_fn(param) if shard_placement_fn is not None else None
    result = chosen if isinstance(chosen, ShardPlacementResult) else None
    described = None if chosen is None or result is not None else \
        platform.shard_placement_from_native(chosen)
    if described is not None:
        result = ShardPlacementResult(described.placement, described.mesh, DataParallelMeshDims(
            shard=described.shard_dims or None, replicate=described.replicate_dims or None))
    placement = result.placement if result is not None else chosen
    dim = 0 if placement is None else getattr(placement, "dim", placement)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"shard_placement_fn returned {chosen!r} for parameter {fqn!r} of "
                         f"{ndim} dims; return a dim in [{-ndim}, {ndim}) (or None for dim 0), "
                         f"or a hp.ShardPlacementResult(dim, mesh)")
    return dim % ndim, result


def placement_mesh(platform: Platform, result: ShardPlacementResult, fqn: str) -> DeviceMesh:
    """``result``'s mesh as a DeviceMesh, once it is known to hold only ranks of this job,
    this rank among them."""
    mesh = as_device_mesh(result.mesh)
    world, rank = platform.world_size(), platform.rank()
    if any(not 0 <= r < world for r in mesh.ranks) or len(set(mesh.ranks)) != len(mesh.ranks):
        raise ValueError(f"shard_placement_fn placed {fqn!r} on a mesh of ranks "
                         f"{list(mesh.ranks)}, which is not a mesh of this job's {world} ranks "
                         f"(each rank once, from 0 to {world - 1})")
    if rank not in mesh.ranks:
        raise ValueError(f"shard_placement_fn placed {fqn!r} on a mesh of ranks "
                         f"{list(mesh.ranks)}, which does not hold this rank ({rank}): each rank "
                         f"shards a parameter over a mesh it belongs to (a sub-mesh per group "
                         f"of ranks, or the whole mesh with dp_mesh_dims)")
    return mesh


def ranks_spanned(fsdp_params) -> list:
    """``[]``, or the two numbers of ranks ``[smallest, largest]`` that show parameters no
    rank sees whole: a parameter group sharded over a sub-mesh whose left-out ranks hold
    parameters of their own (copies that part ways), whose values and gradients no rank
    sees, so checkpoints and the total gradient norm refuse the model rather than take one
    rank's for all. A parameter the core's tensor parallelism split spans its unit's ranks
    times its tensor-parallel ranks, which hold its other blocks (expert parallelism:
    experts sharded over the data-parallel ranks inside an expert group, split over the
    expert ranks). Returns ``[smallest span, largest unit mesh]`` where a span falls short
    of another unit's mesh."""
    fsdp_params = list(fsdp_params)
    if not fsdp_params:
        return []
    meshes = {fp.mesh_info.source.size() for fp in fsdp_params}
    spans = {fp.mesh_info.source.size() * (fp.tensor_parallel_layout.mesh.size()
                                           if fp.tensor_parallel_layout is not None else 1)
             for fp in fsdp_params}
    return [min(spans), max(meshes)] if min(spans) < max(meshes) else []
