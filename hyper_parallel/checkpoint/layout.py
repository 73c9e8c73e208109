"""What this rank holds of each parameter and buffer: the region of the whole tensor, its
stored name, and who writes it.

[Note: regions]
A value's stored shape is the whole tensor's, over tensor and data parallelism, and a
rank's region is one block of it: offsets in every dim and a shape. A managed parameter is
held as its data-parallel shard (param.py, [Note: shard layout]): rows ``[start, start +
rows)`` of its shard dim ``d``. Tensor parallelism (torch's DTensor parameters, Shard and
Replicate placements, ``Platform.tensor_parallel_block``; the core's, the ``ParamLayout``
recorded on the parameter) first gives the rank a block of the whole tensor, and the
shard's rows are rows of that block: the region is the block's offsets plus ``start`` on
dim ``d``, and the block's shape with ``rows`` on dim ``d``, whether tensor parallelism
split dim ``d`` too or another dim. A core tensor-parallel parameter no unit manages is
held as its block. The
local tensor may carry zero padding rows after the region (MindSpore). The optimizer's
moments of a parameter are laid out like its local tensor, so they share its region.
Unmanaged parameters and buffers (torch's persistent buffers, ``StateIO.buffers``) are
held whole; MindSpore keeps such state in ``requires_grad=False`` Parameters, which are
parameters here. Every rank computes its own buffers (BatchNorm's running statistics of
its own batches), and rank 0's are the ones stored.

[Note: one writer per region]
Several ranks may hold the same region: the replicas of a replicate dim, of a
tensor-parallel Replicate placement, of a mesh dim that is not data parallel, or every
rank for a whole value. Which ranks those are depends on meshes a rank may not see (a unit
given ``mesh["dp"]`` knows nothing of the ranks of other tensor-parallel indices), so
saving gathers where every rank's regions start (``written_here``), and the lowest rank
holding a region writes it. Loading needs no such agreement: a rank reads its own region
from whatever slices overlap it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hyper_parallel.checkpoint.index import DTYPES, CheckpointError
from hyper_parallel.checkpoint.names import resolve
from hyper_parallel.checkpoint.state_dict import slot_owners
from hyper_parallel.fully_shard.placement import ranks_spanned
from hyper_parallel.fully_shard.state import STATE_ATTR
from hyper_parallel.tensor_parallel.layout import tensor_parallel_layout

if TYPE_CHECKING:
    from hyper_parallel.fully_shard.param import FSDPParam
    from hyper_parallel.platform import Platform


@dataclass
class Held:
    name: str
    param: Any  # what the optimizer steps: the sharded parameter, or the parameter itself
    fsdp_param: FSDPParam | None
    dtype: str
    shape: tuple  # the whole tensor's shape (over tensor and data parallelism)
    offsets: tuple  # where this rank's region starts, in every dim
    region_shape: tuple
    dim: int = 0  # the dim the local tensor keeps ``padding`` zero rows on, after the region
    padding: int = 0
    key: str | None = None  # the stored name (names.py); the model's name when None

    def __post_init__(self):
        if self.key is None:
            self.key = self.name

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
    _check_unit_meshes(platform, model)
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


def _check_unit_meshes(platform: Platform, model: Any) -> None:
    """Parameter groups whose meshes span different numbers of ranks (a sub-mesh, as
    expert parallelism with other experts per rank builds, in one unit or in units of their
    own, unless ``ExpertParallel`` split the experts over the ranks left out:
    placement.py ``ranks_spanned``) are refused: the ranks a sub-mesh leaves out keep
    copies of their own, which may differ, and the lowest rank's would be stored for all
    (see [Note: one writer per region])."""
    groups = [(name, group) for name, sub in platform.named_modules(model)
              if (state := sub.__dict__.get(STATE_ATTR)) is not None for group in state.groups]
    sizes = ranks_spanned(fp for _, group in groups for fp in group.params)
    if sizes:
        small = next(name for name, group in groups if group.mesh_info.source.size() < sizes[-1])
        raise CheckpointError(
            f"the fully_shard unit at {small or 'the root'!r} has a parameter group whose "
            f"mesh spans {sizes[0]} of {sizes[-1]} ranks of the model's other meshes: the "
            f"ranks it leaves out hold copies of their own, which a checkpoint cannot tell "
            f"apart; give every group a mesh over the same ranks (e.g. a 2-D mesh whose "
            f"replicate dim joins the copies)")


def _held_whole(platform: Platform, name: str, param: Any, key: str) -> Held:
    """A parameter no unit manages: the whole tensor, or the block the core's tensor
    parallelism left this rank (its recorded ``ParamLayout``)."""
    if platform.param_local_values(param) is not param:
        raise CheckpointError(f"{name} is a tensor-parallel parameter outside every fully_shard "
                              f"unit; checkpoints store tensor-parallel parameters that a unit "
                              f"manages: apply fully_shard to the model's root (it takes every "
                              f"parameter no other unit does)")
    shape = tuple(platform.shape(param))
    whole, offsets = shape, (0,) * len(shape)
    layout = tensor_parallel_layout(param)
    if layout is not None:
        whole, offsets = tuple(layout.whole_shape), tuple(layout.offset)
    return Held(name, param, None, dtype_name(platform, platform.dtype_of(param)), whole,
                offsets, shape, key=key)


def _held_managed(platform: Platform, name: str, fp: FSDPParam, key: str) -> Held:
    part = tuple(fp.full_shape)  # this rank's tensor-parallel part, or the whole tensor
    shape, offsets = part, (0,) * len(part)
    if fp.tensor_parallel_layout is not None:  # the core's tensor parallelism
        shape, offsets = fp.tensor_parallel_layout.whole_shape, fp.tensor_parallel_layout.offset
    elif fp.is_tensor_parallel:
        block = platform.tensor_parallel_block(fp.sharded_param)
        if block is None:
            raise CheckpointError(
                f"{name}: this rank's tensor-parallel part is not one block of the whole tensor "
                f"(a placement that interleaves, such as torch's _StridedShard); checkpoints "
                f"store tensor-parallel parameters split by Shard and Replicate placements")
        shape, offsets = block
    # the rows of this rank's data-parallel shard, within its tensor-parallel part
    offsets = tuple(o + fp.start if d == fp.shard_dim else o for d, o in enumerate(offsets))
    region = tuple(fp.local_rows if d == fp.shard_dim else n for d, n in enumerate(part))
    return Held(name, fp.sharded_param, fp, dtype_name(platform, fp.orig_dtype), tuple(shape),
                offsets, region, fp.shard_dim, fp.stored_rows - fp.local_rows, key)


def written_here(platform: Platform, held: list, pp_rank: int | None = None) -> list:
    """The values whose region this rank writes. Of the ranks holding the same region of a
    value (replicas over a replicate dim, a tensor-parallel Replicate placement, a mesh dim
    that is not data parallel, or every rank for a whole value) the lowest writes it; an
    empty region of a non-empty value is written by none. Every rank calls it: one
    all-gather checks that every rank holds the same values (with ``pp_rank``, this rank's
    pipeline stage: the same as the ranks of its pp rank, and none another pp rank holds:
    stages.py), a second gathers where each rank's regions start."""
    signature = "\n".join(f"{h.key} {h.shape}" for h in held).encode()
    names = "\n".join(h.key for h in held).encode()
    row = np.array([pp_rank or 0, len(held), zlib.crc32(signature), len(names)], np.uint32)
    every = _gather(platform, row)
    # the names themselves only where stages may split them: without pp_mesh every rank
    # holds the same values, which the checksums already compare
    listed = ([] if pp_rank is None else [names] if len(every) == 1 else
              _gather_bytes(platform, names, max(int(r[3]) for r in every)))
    _check_stages(every, [b.decode().split("\n") if b else [] for b in listed],
                  pp_rank is not None)
    if not held:
        return []
    starts = np.zeros((max(int(r[1]) for r in every), 3), np.uint32)
    for i, h in enumerate(held):  # per value: written at all, first element
        strides = [math.prod(h.shape[d + 1:]) for d in range(len(h.shape))]
        first = sum(o * s for o, s in zip(h.offsets, strides))
        starts[i] = (math.prod(h.region_shape) > 0 or math.prod(h.shape) == 0,
                     first >> 32, first & 0xFFFFFFFF)
    gathered = _gather(platform, starts.reshape(-1))
    earlier = [g.reshape(-1, 3)[:len(held)] for r, g in enumerate(gathered[:platform.rank()])
               if every[r][0] == row[0]]  # the ranks of this pp rank hold these values
    taken = (np.any([(e == starts[:len(held)]).all(-1) for e in earlier], 0) if earlier
             else np.zeros(len(held), bool))
    return [h for i, h in enumerate(held) if starts[i, 0] and not taken[i]]


def _check_stages(rows: list, names: list, pp: bool) -> None:
    """``rows[r]``: rank ``r``'s (pp rank, number of values, checksum of its names and
    shapes, length of its names); ``names[r]``: its stored names (none gathered without
    pp_mesh). The ranks of one pp rank hold the same values; no name is held at two pp
    ranks (stages.py)."""
    for rank, row in enumerate(rows):
        peer = next(r for r, other in enumerate(rows) if other[0] == row[0])
        if not np.array_equal(row, rows[peer]):
            raise CheckpointError(
                f"rank {rank} holds other parameters or shapes than rank {peer} "
                f"({row[1]} values against {rows[peer][1]}"
                f"{f', both at pp rank {row[0]}' if pp else ''}); checkpoints cover models "
                f"every rank holds whole or in parts (data and tensor parallelism), and "
                f"pipeline stages given pp_mesh=mesh['pp']")
    holder: dict = {}
    for rank, held_names in enumerate(names):
        stage = int(rows[rank][0])
        for name in held_names:
            other = holder.setdefault(name, stage)
            if other != stage:
                raise CheckpointError(f"{name!r} is held at pp ranks {other} and {stage}: "
                                      f"each value belongs to one stage (split the model "
                                      f"with hp.pipelining.pipeline_module_split)")


def _gather_bytes(platform: Platform, data: bytes, longest: int) -> list:
    """Every rank's ``data`` (at most ``longest`` bytes), by rank."""
    size = -(-longest // 4) * 4
    padded = np.zeros(size, np.uint8)
    padded[:len(data)] = np.frombuffer(data, np.uint8)
    return [piece.view(np.uint8).tobytes().rstrip(b"\0")
            for piece in _gather(platform, padded.view(np.uint32))]


def _gather(platform: Platform, values: np.ndarray) -> list:
    """Every rank's ``values`` (uint32, the same length on every rank), by rank."""
    if platform.world_size() == 1 or not platform.is_initialized():
        return [values]
    pieces = platform.all_gather(platform.from_numpy(values.view(np.int32)), None).wait().pieces
    return [np.asarray(platform.to_numpy(piece)).view(np.uint32) for piece in pieces]


def to_array(platform: Platform, held: Held, tensor: Any) -> np.ndarray:
    """This rank's region of a local tensor (the parameter's or a moment), as numpy;
    bfloat16 as float32 (exact)."""
    if held.dtype == "bfloat16":
        tensor = platform.cast(tensor, platform.dtype("float32"))
    array = platform.to_numpy(tensor)
    if held.padding:
        rows = held.region_shape[held.dim]
        array = np.moveaxis(np.moveaxis(array, held.dim, 0)[:rows], 0, held.dim)
    return np.asarray(array, order="C")  # 0-dim stays 0-dim


def from_array(platform: Platform, held: Held, array: np.ndarray, like: Any) -> Any:
    """A tensor shaped and typed like the local tensor ``like``, holding ``array`` (this
    rank's region) and zeros in the padding rows."""
    if held.padding:
        moved = np.moveaxis(array, held.dim, 0)
        padding = np.zeros((held.padding, *moved.shape[1:]), moved.dtype)
        array = np.moveaxis(np.concatenate([moved, padding], 0), 0, held.dim)
    tensor = platform.from_numpy(np.asarray(array, order="C"))
    return platform.cast(tensor, platform.dtype_of(like))
