"""A backend-agnostic DeviceMesh over platform process groups, shared by every parallelism
(fully_shard, tensor parallelism, ...): ``init_device_mesh``, slices by dim name, and a
framework's own mesh wrapped (``as_device_mesh``).

[Note: layout]
Ranks are laid out row-major over ``mesh_shape``: on a (R, S) mesh rank = r * S + s. The
group along dim i joins the ranks that differ only in coordinate i. On torch the mesh wraps
a torch DeviceMesh (``native``), which sharded DTensor parameters need; a torch DeviceMesh
given by the user is wrapped the same way.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

from hyper_parallel.device_names import check_device_type
from hyper_parallel.launcher_job import require_joined_job
from hyper_parallel.platform import get_platform


class DeviceMesh:
    """Process groups of an N-D grid of ranks, with optional dim names."""

    def __init__(self, device_type: str, mesh_shape: Sequence[int], mesh_dim_names: Sequence[str],
                 groups: Sequence[Any], native: Any = None, ranks: Sequence[int] | None = None):
        self.device_type = device_type
        self.shape = tuple(int(s) for s in mesh_shape)
        self.mesh_dim_names = tuple(mesh_dim_names)
        self._groups = list(groups)
        self.native = native
        # the global rank at each position, row-major (a mesh made here covers the world)
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(math.prod(self.shape)))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | str | None = None) -> int:
        if dim is None:
            return math.prod(self.shape)
        return self.shape[self._dim_index(dim)]

    def get_group(self, dim: int | str = 0) -> Any:
        return self._groups[self._dim_index(dim)]

    def get_local_rank(self, dim: int | str = 0) -> int:
        index = self._dim_index(dim)
        if self.shape[index] == 1:
            return 0
        return get_platform().group_rank(self._groups[index])

    def _dim_index(self, dim: int | str) -> int:
        if isinstance(dim, str):
            if dim not in self.mesh_dim_names:
                raise KeyError(f"mesh has no dim named {dim!r}; its dims are {self.mesh_dim_names}")
            return self.mesh_dim_names.index(dim)
        return dim

    def __getitem__(self, names: str | tuple) -> DeviceMesh:
        """The sub-mesh of this rank along the named dims (torch's ``mesh["dp"]``,
        ``mesh["dp", "cp"]``): those dims' groups, and the ranks that share this rank's
        coordinates on every other dim. Names must follow the mesh's order."""
        wanted = (names,) if isinstance(names, str) else names if isinstance(names, tuple) else ()
        if not wanted or any(n not in self.mesh_dim_names for n in wanted):
            raise KeyError(f"a sub-mesh is taken by dim names, of {self.mesh_dim_names}; "
                           f"got {names!r}")
        dims = [self.mesh_dim_names.index(n) for n in wanted]
        if dims != sorted(set(dims)):
            raise ValueError(f"sub-mesh dims {wanted} must be distinct and in the mesh's order "
                             f"{self.mesh_dim_names}")
        if self.native is not None:  # the framework's own sub-mesh, with its own bookkeeping
            return as_device_mesh(self.native[wanted[0] if len(wanted) == 1 else wanted])
        position = self.ranks.index(get_platform().rank())
        strides = self._strides()
        base = position - sum((position // strides[d]) % self.shape[d] * strides[d] for d in dims)
        return DeviceMesh(self.device_type, [self.shape[d] for d in dims], wanted,
                          [self._groups[d] for d in dims],
                          ranks=[self.ranks[base + step] for step in self._offsets(dims)])

    def _strides(self) -> list:
        return [math.prod(self.shape[d + 1:]) for d in range(self.ndim)]

    def _offsets(self, dims: Sequence[int]) -> list:
        """Offsets into ``ranks`` of every combination of coordinates along ``dims``
        (row-major; one offset, 0, for no dims)."""
        strides = self._strides()
        return [sum(c * strides[d] for c, d in zip(coord, dims))
                for coord in itertools.product(*(range(self.shape[d]) for d in dims))]

    def _lines(self, dims: Sequence[int]) -> list:
        """Every set of ranks that differ only along ``dims``, ranks ascending, in an order
        every rank computes alike (no dims: each rank alone)."""
        others = [d for d in range(self.ndim) if d not in dims]
        steps = self._offsets(dims)
        return [tuple(sorted(self.ranks[base + step] for step in steps))
                for base in self._offsets(others)]

    def __repr__(self) -> str:
        return f"DeviceMesh({self.device_type!r}, shape={self.shape}, dims={self.mesh_dim_names})"

    def __getattr__(self, name: str):
        """Reached only for a name this mesh lacks, typically a framework's own function
        given it in place of the framework's mesh (torch's ``parallelize_module`` asks for
        ``get_coordinate``): the error says which mesh such a function takes."""
        if name.startswith("__") or name == "native":
            raise AttributeError(name)
        raise AttributeError(
            f"hyper_parallel's DeviceMesh has no attribute {name!r}: a framework's own "
            f"function (torch's parallelize_module, DTensor, ...) takes the framework's "
            f"mesh; pass it mesh.native (torch's DeviceMesh), or use hp.parallelize_module, "
            f"which takes either")


def _validate(mesh_shape, mesh_dim_names, world_size) -> tuple:
    shape = tuple(mesh_shape) if isinstance(mesh_shape, (tuple, list)) else (mesh_shape,)
    if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"mesh_shape must be positive ints, got {mesh_shape!r}")
    if math.prod(shape) != world_size:
        raise ValueError(
            f"mesh_shape {shape} holds {math.prod(shape)} ranks but the world has {world_size}; "
            f"choose a shape whose product is {world_size}")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else tuple(f"dim{i}" for i in range(len(shape)))
    if len(names) != len(shape):
        raise ValueError(f"mesh_dim_names {names} must name each of the {len(shape)} dims of {shape}")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names {names} has duplicates; give each dim its own name")
    return shape, names


def init_device_mesh(device_type: str, mesh_shape: Sequence[int] | int, *,
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """Create a mesh over all ranks of the job (call on every rank, in the same order)."""
    platform = get_platform()
    require_joined_job("init_device_mesh", platform)
    check_device_type(platform, device_type)
    shape, names = _validate(mesh_shape, mesh_dim_names, platform.world_size())
    groups, native = platform.new_mesh_groups(device_type, shape, names)
    return DeviceMesh(device_type, shape, names, groups, native)


def as_device_mesh(mesh: Any) -> DeviceMesh:
    """Our DeviceMesh for ``mesh``: ours unchanged, or a framework mesh wrapped; None -> 1-D world."""
    platform = get_platform()
    if mesh is None:
        return init_device_mesh(platform.device_type(), (platform.world_size(),), mesh_dim_names=("shard",))
    if isinstance(mesh, DeviceMesh):
        return mesh
    described = platform.mesh_from_native(mesh)
    if described is None:
        raise TypeError(f"mesh must be a hyper_parallel DeviceMesh (hp.init_device_mesh) or, on "
                        f"torch, a torch DeviceMesh; got {type(mesh).__name__}")
    return DeviceMesh(described.device_type, described.shape, described.dim_names,
                      described.groups, mesh, ranks=flattened(described.rank_grid))


def flattened(nested) -> list:
    """The elements of nested lists (a mesh's rank grid), in order."""
    return [r for item in nested for r in flattened(item)] if isinstance(nested, list) else [nested]
