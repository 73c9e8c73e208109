"""A backend-agnostic DeviceMesh over platform process groups.

[Note: layout]
Ranks are laid out row-major over ``mesh_shape``: on a (R, S) mesh rank = r * S + s. The
group along dim i joins the ranks that differ only in coordinate i. On torch the mesh wraps
a torch DeviceMesh (``native``), which sharded DTensor parameters need; a torch DeviceMesh
given by the user is wrapped the same way.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from hyper_parallel.platform import get_platform


class DeviceMesh:
    """Process groups of an N-D grid of ranks, with optional dim names."""

    def __init__(self, device_type: str, mesh_shape: Sequence[int], mesh_dim_names: Sequence[str],
                 groups: Sequence[Any], native: Any = None):
        self.device_type = device_type
        self.shape = tuple(int(s) for s in mesh_shape)
        self.mesh_dim_names = tuple(mesh_dim_names)
        self._groups = list(groups)
        self.native = native

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

    def __repr__(self) -> str:
        return f"DeviceMesh({self.device_type!r}, shape={self.shape}, dims={self.mesh_dim_names})"


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
    shape, names, groups, device_type, _ = described
    return DeviceMesh(device_type, shape, names, groups, mesh)


class MeshInfo:
    """The groups a unit communicates over: shard dim (all-gather, reduce-scatter) and
    replicate dim (all-reduce; size 1 for plain FSDP)."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.shard_mesh_dim = mesh.ndim - 1
        self.shard_group = mesh.get_group(self.shard_mesh_dim)
        self.shard_size = mesh.shape[self.shard_mesh_dim]
        self.shard_rank = mesh.get_local_rank(self.shard_mesh_dim)
        self.replicate_size = mesh.shape[0] if mesh.ndim == 2 else 1
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None

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
