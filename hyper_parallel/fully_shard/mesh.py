"""Which dims of a mesh fully_shard shards and replicates over, and the data-parallel
meshes and groups it derives from them (the mesh itself: hyper_parallel/device_mesh.py).

[Note: which dims are data parallel]
fully_shard reads a mesh as FSDP2 does, by position: a 1-D mesh is (shard,), a 2-D mesh
is (replicate, shard), whatever the dims are named. On a mesh with more dims,
``DataParallelMeshDims`` names the shard and replicate dims; the others (tensor
parallelism, ...) are not fully_shard's: parameters are replicated over them and no
gradient is reduced over them. fully_shard then works on the data-parallel mesh, a 1-D
(shard,) or 2-D (replicate, shard) mesh of this rank's data-parallel peers. A role given
several dims joins them into one group ("flattening"), whose ranks ascend, whatever order
the dims are listed in (both frameworks order a group's ranks so); that group is new, made
once per mesh and dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyper_parallel.device_mesh import DeviceMesh, flattened
from hyper_parallel.platform import get_platform


@dataclass(frozen=True)
class DataParallelMeshDims:
    """The dims of a mesh that fully_shard shards over and replicates over (see [Note:
    which dims are data parallel]). Each is a dim name, a dim position, or a tuple of them,
    joined into one group; at least one is given. Only ``replicate``: every parameter is
    replicated (DDP)."""

    shard: str | int | tuple | None = None
    replicate: str | int | tuple | None = None

    def __post_init__(self):
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs shard, replicate or both; e.g. "
                             "DataParallelMeshDims(shard='dp')")
        for role in ("shard", "replicate"):
            for dim in self.dims_of(role):
                if isinstance(dim, bool) or not isinstance(dim, (str, int)):
                    raise TypeError(f"DataParallelMeshDims.{role} takes dim names (str), dim "
                                    f"positions (int) or a tuple of them; got {dim!r}")
            if isinstance(getattr(self, role), tuple) and not self.dims_of(role):
                raise ValueError(f"DataParallelMeshDims.{role} is an empty tuple; give at least "
                                 f"one dim, or None")

    def dims_of(self, role: str) -> tuple:
        value = getattr(self, role)
        if value is None:
            return ()
        return tuple(value) if isinstance(value, tuple) else (value,)


def as_dp_mesh_dims(value: Any) -> Any:
    """``value`` as our DataParallelMeshDims where it is the framework's own (torch's
    ``torch.distributed.fsdp.DataParallelMeshDims``: the same fields, meaning the same, as
    ``Platform.option_from_native`` describes it); anything else as it is, for the caller's
    type check. A field ours lacks (a later torch's) is a TypeError naming it."""
    if value is None or isinstance(value, (DataParallelMeshDims, str, int, tuple, list)):
        return value  # ours, or a plain value no framework makes: the caller's type check
    native = get_platform().option_from_native(value)
    if native is None or native[0] != "DataParallelMeshDims":
        return value
    unknown = sorted(set(native[1]) - {"shard", "replicate"})
    if unknown:
        raise TypeError(f"dp_mesh_dims {value!r} has fields {unknown} that "
                        f"hp.DataParallelMeshDims does not have; pass a hp.DataParallelMeshDims")
    return DataParallelMeshDims(**native[1])


def data_parallel_dims(mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims | None) -> tuple:
    """``(replicate_dims, shard_dims)``: the positions in ``mesh`` of each role, ascending.
    Every mistake is a ValueError saying how to fix it."""
    dp_mesh_dims = as_dp_mesh_dims(dp_mesh_dims)
    if dp_mesh_dims is None:
        if mesh.ndim > 2:
            raise ValueError(
                f"fully_shard reads a 1-D mesh as (shard,) and a 2-D mesh as (replicate, shard); "
                f"this mesh is {mesh.ndim}-D {mesh.shape} with dims {mesh.mesh_dim_names}. Say "
                f"which dims are data parallel: fully_shard(..., "
                f"dp_mesh_dims=hp.DataParallelMeshDims(shard=..., replicate=...)); the other "
                f"dims are left to other parallelism")
        return ((0,), (1,)) if mesh.ndim == 2 else ((), (0,))
    if not isinstance(dp_mesh_dims, DataParallelMeshDims):
        raise TypeError(f"dp_mesh_dims must be a hyper_parallel DataParallelMeshDims, got "
                        f"{type(dp_mesh_dims).__name__} (on torch, "
                        f"torch.distributed.fsdp.DataParallelMeshDims is accepted too)")
    roles = {role: tuple(_position(mesh, role, dim) for dim in dp_mesh_dims.dims_of(role))
             for role in ("replicate", "shard")}
    for role, dims in roles.items():
        if len(set(dims)) != len(dims):
            raise ValueError(f"DataParallelMeshDims.{role} names a dim of the mesh twice "
                             f"({dp_mesh_dims.dims_of(role)} on dims {mesh.mesh_dim_names}); "
                             f"list each dim once")
    both = set(roles["replicate"]) & set(roles["shard"])
    if both:
        names = [mesh.mesh_dim_names[d] for d in sorted(both)]
        raise ValueError(f"DataParallelMeshDims names the dims {names} both as shard and as "
                         f"replicate; give each dim one role")
    replicate, shard = (tuple(sorted(roles[role])) for role in ("replicate", "shard"))
    if (len(shard) != 1 or len(replicate) > 1) and mesh.size() != get_platform().world_size():
        raise ValueError(f"joining dims into one group (or replicate without shard) makes new "
                         f"groups, which needs a mesh over all {get_platform().world_size()} "
                         f"ranks; this mesh holds {mesh.size()}: pass the whole mesh")
    return replicate, shard


def _position(mesh: DeviceMesh, role: str, dim: str | int) -> int:
    if isinstance(dim, str):
        if dim not in mesh.mesh_dim_names:
            raise ValueError(f"DataParallelMeshDims.{role} names dim {dim!r}, which the mesh does "
                             f"not have; its dims are {mesh.mesh_dim_names} (a name or a position "
                             f"0..{mesh.ndim - 1})")
        return mesh.mesh_dim_names.index(dim)
    if not -mesh.ndim <= dim < mesh.ndim:
        raise ValueError(f"DataParallelMeshDims.{role} gives dim position {dim}, out of range for "
                         f"the {mesh.ndim}-D mesh {mesh.shape}; use 0..{mesh.ndim - 1} (or a name "
                         f"of {mesh.mesh_dim_names})")
    return dim % mesh.ndim


# the data-parallel meshes made from a mesh, kept on the user's mesh object (its native
# mesh where it has one: a torch mesh is wrapped anew by every call) so every unit over the
# same mesh shares their groups
_DERIVED_ATTR = "_hp_data_parallel_meshes"


def data_parallel_mesh(mesh: DeviceMesh, replicate: tuple, shard: tuple) -> DeviceMesh:
    """The 1-D (shard,) or 2-D (replicate, shard) mesh of this rank's data-parallel peers
    (dims from ``data_parallel_dims``); ``mesh`` itself where it already is one. Makes
    new groups on every rank, in the same order, where a role joins several dims."""
    if len(shard) == 1 and len(replicate) <= 1 and replicate + shard == tuple(range(mesh.ndim)):
        return mesh
    owner = mesh.native if mesh.native is not None else mesh
    derived = owner.__dict__.setdefault(_DERIVED_ATTR, {})
    key = (replicate, shard)
    if key not in derived:
        derived[key] = _new_data_parallel_mesh(mesh, replicate, shard)
    return derived[key]


def _new_data_parallel_mesh(mesh: DeviceMesh, replicate: tuple, shard: tuple) -> DeviceMesh:
    platform = get_platform()
    strides = mesh._strides()
    index = mesh.ranks.index(platform.rank())
    # the position of this rank's block: its coordinates along the data-parallel dims zeroed
    base = index - sum(index // strides[d] % mesh.shape[d] * strides[d] for d in replicate + shard)
    rows = [[mesh.ranks[base + r + s] for s in mesh._offsets(shard)]
            for r in mesh._offsets(replicate)]
    groups = ([_group_along(mesh, replicate)] if replicate else []) + [_group_along(mesh, shard)]
    names = ("replicate", "shard") if replicate else ("shard",)
    grid = rows if replicate else rows[0]
    native = platform.mesh_from_groups(mesh.device_type, groups, grid, names)
    shape = (len(rows), len(rows[0])) if replicate else (len(rows[0]),)
    return DeviceMesh(mesh.device_type, shape, names, groups, native, ranks=flattened(grid))


def _group_along(mesh: DeviceMesh, dims: tuple) -> Any:
    """This rank's group over ``dims`` of ``mesh``: the mesh's own for one dim, else new."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    platform = get_platform()
    me, mine = platform.rank(), None
    for line in mesh._lines(dims):  # every rank makes every group, in the same order
        group = platform.new_group(list(line))
        if me in line:
            mine = group
    return mine


# the post-forward groups made from a mesh, kept like _DERIVED_ATTR's meshes
_POST_FORWARD_ATTR = "_hp_post_forward_groups"


def post_forward_group(mesh: DeviceMesh, shard_dims: tuple, size: int,
                       distinct: bool = False) -> Any:
    """This rank's group for ``reshard_after_forward=size``: each line of shard ranks of
    ``mesh`` (along ``shard_dims``, ranks ascending) cut into contiguous blocks of ``size``,
    as FSDP2 builds its post-forward mesh. New groups, made once per mesh, dims and size,
    by every rank in the same order: so ``mesh`` must span the whole job. ``distinct``: a
    group over every rank is a communicator of its own too (``Platform.new_group``)."""
    platform = get_platform()
    if mesh.size() != platform.world_size():
        raise ValueError(f"reshard_after_forward={size} makes new groups, which needs a mesh over "
                         f"all {platform.world_size()} ranks; this mesh holds {mesh.size()}: pass "
                         f"the whole mesh (with dp_mesh_dims), or use True or False")
    owner = mesh.native if mesh.native is not None else mesh
    made = owner.__dict__.setdefault(_POST_FORWARD_ATTR, {})
    key = (shard_dims, size, distinct)
    if key not in made:
        me = platform.rank()
        for line in mesh._lines(shard_dims):
            for start in range(0, len(line), size):
                block = list(line[start:start + size])
                group = platform.new_group(block, distinct=distinct)
                if me in block:
                    made[key] = group
    return made[key]


class MeshInfo:
    """The groups a unit communicates over, read by position from its data-parallel mesh
    (``data_parallel_mesh``): shard dim (all-gather, reduce-scatter) and replicate dim
    (all-reduce; size 1 for plain FSDP). ``source`` and ``shard_dims``: the mesh it was
    read from and the dims of it that shard, which smaller groups are cut from
    (``post_forward_group``)."""

    def __init__(self, mesh: DeviceMesh, source: DeviceMesh | None = None,
                 shard_dims: tuple = ()):
        self.mesh = mesh
        self.source = source if source is not None else mesh
        self.source_shard_dims = shard_dims if source is not None else (mesh.ndim - 1,)
        self.shard_mesh_dim = mesh.ndim - 1
        self.shard_group = mesh.get_group(self.shard_mesh_dim)
        self.shard_size = mesh.shape[self.shard_mesh_dim]
        self.shard_rank = mesh.get_local_rank(self.shard_mesh_dim)
        self.replicate_size = mesh.shape[0] if mesh.ndim == 2 else 1
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.reduce_scatter_group = self.shard_group  # set_separate_reduce_scatter_group

    def same_groups(self, other: MeshInfo) -> bool:
        """Whether ``other`` communicates over the same shard and replicate groups: its
        parameters then join this one's parameter group (placement.py)."""
        return (self.shard_size, self.replicate_size) == (other.shard_size, other.replicate_size) \
            and self.shard_group == other.shard_group \
            and self.replicate_group == other.replicate_group

    @property
    def data_parallel_size(self) -> int:
        return self.shard_size * self.replicate_size

    @property
    def data_parallel_group(self) -> Any:
        """The group of all data-parallel ranks (the mesh covers the world: None = world)."""
        if self.replicate_size == 1:
            return self.shard_group
        if self.shard_size == 1:
            return self.replicate_group
        return None

    def post_forward_group(self, size: int) -> Any:
        """The group of ``size`` shard ranks this rank reshards to after forward."""
        return post_forward_group(self.source, self.source_shard_dims, size)

    def separate_shard_group(self) -> Any:
        """A second communicator over this rank's shard ranks (made once per mesh, on every
        rank): the blocks of ``post_forward_group`` of the whole shard size."""
        return post_forward_group(self.source, self.source_shard_dims, self.shard_size,
                                  distinct=True)
