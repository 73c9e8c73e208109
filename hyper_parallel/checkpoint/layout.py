"""What this rank holds of each parameter and buffer: the region of the global tensor, its
stored name, and who writes it.

A managed parameter sharded on dim ``d`` is held as rows ``[start, start + rows)`` of dim
``d`` (param.py, [Note: shard layout]); its local tensor may carry padding rows beyond
them (``stored_rows``, MindSpore). Under HSDP every replica holds the same rows, and only
replica 0 writes them; a parameter held whole (unsharded, or not managed) is written by
the first rank of its mesh (rank 0 for an unmanaged one). The optimizer's moments of a
parameter are laid out like the parameter's local tensor, so they share its region.
Buffers (torch's persistent buffers, ``StateIO.buffers``) are held whole, like unmanaged
parameters; MindSpore keeps such state in ``requires_grad=False`` Parameters, which are
parameters here. Every rank computes its own buffers (BatchNorm's running statistics of
its own batches), and rank 0's are the ones stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hyper_parallel.checkpoint.index import DTYPES, CheckpointError
from hyper_parallel.checkpoint.names import resolve
from hyper_parallel.checkpoint.state_dict import slot_owners

if TYPE_CHECKING:
    from hyper_parallel.fully_shard.param import FSDPParam
    from hyper_parallel.platform import Platform


@dataclass
class Held:
    name: str
    param: Any  # what the optimizer steps: the sharded parameter, or the parameter itself
    fsdp_param: FSDPParam | None
    dtype: str
    shape: tuple  # the global shape
    dim: int  # the dim the rows are counted on
    start: int
    rows: int
    stored_rows: int  # rows of the local tensor on ``dim`` (padding beyond ``rows``)
    writes: bool
    key: str | None = None  # the stored name (names.py); the model's name when None

    def __post_init__(self):
        if self.key is None:
            self.key = self.name

    @property
    def offsets(self) -> tuple:
        return tuple(self.start if d == self.dim else 0 for d in range(len(self.shape)))

    @property
    def region_shape(self) -> tuple:
        return tuple(self.rows if d == self.dim else n for d, n in enumerate(self.shape))

    def local(self, platform: Platform) -> Any:
        """The tensor this rank keeps (without the framework's sharded-parameter wrapper)."""
        return self.param if self.fsdp_param is None else platform.local_tensor(self.param)


def dtype_name(platform: Platform, dtype: Any) -> str:
    for name in DTYPES:
        if platform.dtype(name) == dtype:
            return name
    raise CheckpointError(f"dtype {dtype} cannot be stored; supported: {', '.join(DTYPES)}")


def held_params(platform: Platform, model: Any, key_map: Any = None,
                buffers: bool = True) -> list:
    """One ``Held`` per distinct parameter of ``model`` (and, with ``buffers``, per buffer),
    by its first qualified name, stored under what ``key_map`` makes of it (names.py); the
    values it maps to None are left out."""
    owners = slot_owners(platform, model)
    found, seen = [], set()  # found: (name, value, FSDPParam or None)
    for module_name, sub in platform.named_modules(model):
        values = platform.direct_params(sub) + (platform.buffers(sub) if buffers else [])
        for attr, value in values:
            name = f"{module_name}.{attr}" if module_name else attr
            fsdp_param = owners.get((id(sub), attr))
            identity = id(value if fsdp_param is None else fsdp_param)
            if identity in seen:  # tied: stored once, under its first name
                continue
            seen.add(identity)
            found.append((name, value, fsdp_param))
    keys = resolve(key_map, [name for name, _, _ in found])
    return [_held_managed(platform, name, fsdp_param, keys[name]) if fsdp_param is not None
            else _held_whole(platform, name, value, keys[name])
            for name, value, fsdp_param in found if name in keys]


def _held_whole(platform: Platform, name: str, param: Any, key: str) -> Held:
    shape = tuple(platform.shape(param))
    rows = shape[0] if shape else 1
    return Held(name, param, None, dtype_name(platform, platform.dtype_of(param)), shape, 0, 0,
                rows, rows, platform.rank() == 0, key)


def _held_managed(platform: Platform, name: str, fsdp_param: FSDPParam, key: str) -> Held:
    info = fsdp_param.mesh_info
    if info.data_parallel_size != platform.world_size():
        raise CheckpointError(
            f"{name}: its unit's data-parallel mesh spans {info.data_parallel_size} of "
            f"{platform.world_size()} ranks; checkpoints cover models whose every dim is data "
            f"parallel (no tensor-parallel or other model-parallel dims)")
    replica = info.mesh.get_local_rank(0) if info.mesh.ndim == 2 else 0
    shard_rank = info.shard_rank if fsdp_param.is_sharded else 0
    start = min(shard_rank * fsdp_param.chunk_rows, fsdp_param.rows)
    writes = replica == 0 and (fsdp_param.local_rows > 0 or shard_rank == 0)
    return Held(name, fsdp_param.sharded_param, fsdp_param,
                dtype_name(platform, fsdp_param.orig_dtype), tuple(fsdp_param.full_shape),
                fsdp_param.shard_dim, start, fsdp_param.local_rows, fsdp_param.stored_rows,
                writes, key)


def to_array(platform: Platform, held: Held, tensor: Any) -> np.ndarray:
    """This rank's region of a local tensor (the parameter's or a moment), as numpy;
    bfloat16 as float32 (exact)."""
    if held.dtype == "bfloat16":
        tensor = platform.cast(tensor, platform.dtype("float32"))
    array = platform.to_numpy(tensor)
    if held.stored_rows != held.rows:
        array = np.moveaxis(np.moveaxis(array, held.dim, 0)[:held.rows], 0, held.dim)
    return np.asarray(array, order="C")  # 0-dim stays 0-dim


def from_array(platform: Platform, held: Held, array: np.ndarray, like: Any) -> Any:
    """A tensor shaped and typed like the local tensor ``like``, holding ``array`` (this
    rank's region) and zeros in the padding rows."""
    if held.stored_rows != held.rows:
        moved = np.moveaxis(array, held.dim, 0)
        padding = np.zeros((held.stored_rows - held.rows, *moved.shape[1:]), moved.dtype)
        array = np.moveaxis(np.concatenate([moved, padding], 0), 0, held.dim)
    tensor = platform.from_numpy(np.asarray(array, order="C"))
    return platform.cast(tensor, platform.dtype_of(like))
