"""Sharded state dicts that carry their layout, on both frameworks; loading in any layout.

[Note: sharded value]
A ``ShardedValue`` is this rank's part of one model or optimizer value: ``local`` holds
rows ``[offset, offset + length)`` of dim ``shard_dim`` of its block, padding stripped
(MindSpore's sharded Parameters keep padding rows, see param.py; they never appear here).
The block is the whole tensor of ``global_shape``, or, for a parameter the core's tensor
parallelism split (its ``ParamLayout``, tensor_parallel/layout.py), this rank's
tensor-parallel block, ``block = (offsets, shape)`` within the whole tensor: fully_shard
shards that block as it shards a whole parameter. ``shard_dim=None`` is the whole block:
an unsharded parameter, a step counter. So every part is one box of the whole tensor
(``box()``), and values saved by any number of ranks can be put together again in any
other layout: loading takes, for each value, the pieces that overlap this rank's box.

Keys: a parameter's qualified name (tied parameters under each of their names, as
``state_dict()`` gives them on torch); per-parameter optimizer state as
``optim.<state>.<parameter key>`` (moments, torch's per-parameter ``step``); the
optimizer's own values as ``optim.<name>`` (MindSpore's step counters).

``set_state_dict`` accepts, per key, one ``ShardedValue``, a list of them (pieces saved by
several ranks) or a full tensor or numpy array, and checks every key, shape and the
coverage of this rank's box before it writes anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hyper_parallel.checkpoint.arguments import check_bool, check_model
from hyper_parallel.fully_shard.state import STATE_ATTR
from hyper_parallel.platform import get_platform
from hyper_parallel.tensor_parallel.layout import tensor_parallel_layout

if TYPE_CHECKING:
    from hyper_parallel.fully_shard.param import FSDPParam
    from hyper_parallel.platform.base import Platform
    from hyper_parallel.tensor_parallel.layout import ParamLayout

OPTIM_PREFIX = "optim."


@dataclass(frozen=True)
class ShardedValue:
    """This rank's rows ``[offset, offset + length)`` of dim ``shard_dim`` of its block
    (``shard_dim=None``: the whole block); the block is the whole value of ``global_shape``,
    or ``block = (offsets, shape)`` within it (a tensor-parallel block). ``local`` is a
    framework tensor or a numpy array, or None in a layout read without its data."""

    local: Any
    global_shape: tuple
    shard_dim: int | None = None
    offset: int = 0
    length: int = 0
    block: tuple | None = None

    def box(self) -> tuple:
        """``(offsets, shape)``: where this part lies in the whole value."""
        if self.block is None:
            offsets, shape = [0] * len(self.global_shape), list(self.global_shape)
        else:
            offsets, shape = list(self.block[0]), list(self.block[1])
        if self.shard_dim is not None:
            offsets[self.shard_dim] += self.offset
            shape[self.shard_dim] = self.length
        return tuple(offsets), tuple(shape)

    def layout(self) -> dict:
        """The record without the data, as plain JSON-able values."""
        return {"global_shape": list(self.global_shape), "shard_dim": self.shard_dim,
                "offset": self.offset, "length": self.length,
                "block": None if self.block is None else [list(part) for part in self.block]}

    @classmethod
    def from_layout(cls, layout: dict, local: Any = None) -> ShardedValue:
        block = layout.get("block")
        return cls(local, tuple(layout["global_shape"]), layout["shard_dim"],
                   layout["offset"], layout["length"],
                   None if block is None else tuple(tuple(part) for part in block))


@dataclass(frozen=True)
class Entry:
    """One value of a model (and optimizer): where this rank holds it and how it is laid out.
    ``tensor`` is the live local tensor a load writes (padded where the platform pads);
    ``fsdp_param`` the layout of a sharded value, None for a whole one;
    ``tensor_parallel`` the core tensor-parallel layout of a value in a block of its own."""

    key: str
    tensor: Any
    fsdp_param: FSDPParam | None
    tensor_parallel: ParamLayout | None = None

    def target(self, platform: Platform) -> ShardedValue:
        """This rank's part, as a layout (no data)."""
        fp, tp = self.fsdp_param, self.tensor_parallel
        block_shape = tuple(platform.shape(self.tensor)) if fp is None else tuple(fp.full_shape)
        whole, block = block_shape, None
        if tp is not None:
            whole, block = tuple(tp.whole_shape), (tuple(tp.offset), block_shape)
        if fp is None:
            return ShardedValue(None, whole, None, 0, block_shape[0] if block_shape else 0,
                                block)
        offset = min(fp.mesh_info.shard_rank * fp.chunk_rows, fp.rows)
        return ShardedValue(None, whole, fp.shard_dim, offset, fp.local_rows, block)

    def read(self, platform: Platform) -> ShardedValue:
        """This rank's part with its data, padding stripped."""
        local, fp = self.tensor, self.fsdp_param
        if fp is not None and fp.stored_rows != fp.local_rows:
            local = platform.narrow(local, fp.shard_dim, 0, fp.local_rows)
        target = self.target(platform)
        return ShardedValue(local, target.global_shape, target.shard_dim, target.offset,
                            target.length, target.block)


def slot_owners(platform: Platform, model: Any) -> dict:
    """``{(id(module), attribute): FSDPParam}`` for every slot a unit under ``model``
    manages; looked up by slot, since an unsharded unit registers its full tensors there."""
    owners = {}
    for _, sub in platform.named_modules(model):
        state = sub.__dict__.get(STATE_ATTR)
        if state is not None:
            for fsdp_param in state.params:
                for slot_module, attr in fsdp_param.slots:
                    owners[(id(slot_module), attr)] = fsdp_param
    return owners


def state_entries(model: Any, optimizer: Any = None, tensor_parallel_parts: bool = False) -> list:
    """Every value of the model (in module order) and then of the optimizer, as ``Entry``.
    A parameter the core's tensor parallelism split is laid out by its recorded
    ``ParamLayout``. A torch DTensor tensor-parallel parameter is an error, or with
    ``tensor_parallel_parts`` its data-parallel layout over this rank's tensor-parallel
    part."""
    platform = get_platform()
    owners = slot_owners(platform, model)
    entries, keys = [], set()
    by_param = {}  # id(parameter) -> (key, its Entry, its local shape)
    for name, sub in platform.named_modules(model):
        for attr, param in platform.direct_params(sub):
            key = f"{name}.{attr}" if name else attr
            if key in keys:
                continue
            keys.add(key)
            # by slot: a unit that is unsharded registers its full tensors there (torch)
            fsdp_param = owners.get((id(sub), attr))
            if fsdp_param is not None:
                param = fsdp_param.sharded_param
                layout = fsdp_param if fsdp_param.is_sharded else None
                tensor_parallel = fsdp_param.is_tensor_parallel
            else:
                layout = None
                tensor_parallel = platform.param_local_values(param) is not param
                if tensor_parallel:  # its whole value would take a gather no unit plans
                    raise NotImplementedError(
                        f"{key} is a tensor-parallel parameter outside every fully_shard unit; "
                        f"apply fully_shard to the model's root (it takes every parameter no "
                        f"other unit does)")
            if tensor_parallel and not tensor_parallel_parts:
                raise NotImplementedError(
                    f"{key} is a DTensor of torch's own tensor parallelism: hyper_parallel's "
                    "state dicts cover data parallelism only for it (get_full_state_dict("
                    "..., tensor_parallel_parts=True) gathers it whole; hp.parallelize_module's "
                    "parameters need no flag); use hp.save_checkpoint / hp.load_checkpoint, or "
                    "model.state_dict() with torch.distributed.checkpoint, for this model")
            local = param if fsdp_param is None else platform.local_tensor(param)
            entry = Entry(key, local, layout, tensor_parallel_layout(param))
            entries.append(entry)
            by_param.setdefault(id(param), (key, entry, tuple(platform.shape(local))))
    if optimizer is not None:
        entries += _optimizer_entries(platform, optimizer, by_param)
    return entries


def _optimizer_entries(platform: Platform, optimizer: Any, by_param: dict) -> list:
    entries = []
    for state_name, owner, tensor in platform.optimizer_state(optimizer):
        if owner is None:
            entries.append(Entry(f"{OPTIM_PREFIX}{state_name}", tensor, None))
            continue
        if id(owner) not in by_param:
            raise ValueError(f"the optimizer's {state_name!r} state belongs to a parameter that "
                             "is not the model's: pass the optimizer built on this model's "
                             "parameters (after fully_shard)")
        key, param_entry, local_shape = by_param[id(owner)]
        state_key = f"{OPTIM_PREFIX}{state_name}.{key}"
        # state shaped like the parameter is laid out like it; other state (a per-parameter
        # step) is whole
        if tuple(platform.shape(tensor)) == local_shape:
            entries.append(Entry(state_key, tensor, param_entry.fsdp_param,
                                 param_entry.tensor_parallel))
        else:
            entries.append(Entry(state_key, tensor, None))
    return entries


def get_state_dict(model: Any, optimizer: Any = None) -> dict:
    """``{key: ShardedValue}``: this rank's part of every model (and optimizer) value with its
    global shape and layout. The local tensors are the live ones where no padding is cut
    off (as ``state_dict()`` returns parameters): copy them to keep a snapshot."""
    platform = get_platform()
    check_model(platform, "get_state_dict", model, optimizer)
    with platform.no_grad():
        return {e.key: e.read(platform) for e in state_entries(model, optimizer)}


def set_state_dict(model: Any, state: dict, optimizer: Any = None, strict: bool = True) -> None:
    """Load ``state`` into the (sharded) model and optimizer, each rank keeping its rows.
    Per key: a ``ShardedValue``, a list of them saved by any number of ranks in any layout,
    or a full tensor / numpy array (a full state dict or checkpoint). Everything is checked
    before anything is written: an error names the key and the shapes, and leaves the
    model and optimizer unchanged. ``strict=False`` loads the keys present and ignores
    unknown ones."""
    platform = get_platform()
    check_model(platform, "set_state_dict", model, optimizer)
    if not isinstance(state, dict):
        raise TypeError(f"set_state_dict(state=...) takes a dict {{key: value}}, not "
                        f"{type(state).__name__}")
    check_bool("set_state_dict", "strict", strict)
    undo = None if optimizer is None else platform.create_optimizer_state(optimizer)
    try:
        entries = state_entries(model, optimizer)
        plan = check_state(platform, entries,
                           {k: as_pieces(platform, v) for k, v in state.items()}, strict)
    except Exception:
        if undo is not None:
            undo()
        raise
    with platform.no_grad():
        for entry, pieces in plan:
            write_entry(platform, entry, assemble(platform, entry.target(platform), pieces))


def as_pieces(platform: Platform, value: Any) -> list:
    """A state dict value as a list of ``ShardedValue``."""
    if isinstance(value, ShardedValue):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, ShardedValue) for v in value):
        return list(value)
    if isinstance(value, np.ndarray) or platform.is_tensor(value):
        shape = tuple(value.shape) if isinstance(value, np.ndarray) else tuple(platform.shape(value))
        return [ShardedValue(value, shape, None, 0, shape[0] if shape else 0)]
    raise TypeError(f"a state dict value must be a ShardedValue, a list of them, a tensor or a "
                    f"numpy array, not {type(value).__name__}")


def check_state(platform: Platform, entries: list, pieces_by_key: dict, strict: bool) -> list:
    """``[(entry, pieces)]`` to write, once every key, shape and this rank's rows are found;
    otherwise a ValueError listing every problem (nothing written)."""
    known = {e.key for e in entries}
    problems, plan = [], []
    missing = [e.key for e in entries if e.key not in pieces_by_key]
    unexpected = [k for k in pieces_by_key if k not in known]
    if strict and missing:
        problems.append(f"missing key(s) {missing}: the state dict has no value for them "
                        "(strict=False loads the keys present)")
    if strict and unexpected:
        owner = "this model and optimizer have" if any(k.startswith(OPTIM_PREFIX) for k in known) \
            else "this model has"
        problems.append(f"unexpected key(s) {unexpected}: {owner} no such value (a state dict "
                        "from another model?)")
    for entry in entries:
        if entry.key not in pieces_by_key:
            continue
        problem = _coverage_problem(platform, entry.target(platform), pieces_by_key[entry.key])
        if problem:
            problems.append(f"{entry.key}: {problem}")
        else:
            plan.append((entry, pieces_by_key[entry.key]))
    if problems:
        raise ValueError("cannot load the state dict (nothing was changed):\n  "
                         + "\n  ".join(problems))
    return plan


def _coverage_problem(platform: Platform, target: ShardedValue, pieces: list) -> str:
    """Why ``pieces`` cannot give this rank's ``target`` box, or "" when they can."""
    for piece in pieces:
        if tuple(piece.global_shape) != target.global_shape:
            return (f"the state dict holds shape {tuple(piece.global_shape)}, the model's is "
                    f"{target.global_shape}")
        offsets, shape = piece.box()
        if any(o < 0 or o + n > w for o, n, w in zip(offsets, shape, piece.global_shape)):
            return (f"a piece at offsets {offsets} of shape {shape} lies outside the whole "
                    f"shape {piece.global_shape}")
        if piece.local is not None:
            local = tuple(piece.local.shape) if isinstance(piece.local, np.ndarray) \
                else tuple(platform.shape(piece.local))
            if local != shape:
                return (f"a piece of shape {local} claims the part at offsets {offsets} of "
                        f"shape {shape} of {piece.global_shape}")
    offsets, shape = target.box()
    if math.prod(shape) == 0:
        return ""  # no elements to load on this rank
    if not pieces:
        return "no piece given"
    covered = np.zeros(shape, bool)
    for piece in pieces:
        where = _overlap(piece.box(), (offsets, shape))
        if where is not None:
            covered[where[1]] = True
    if not covered.all():
        return (f"the pieces given cover {int(covered.sum())} of the {covered.size} elements "
                f"this rank needs (offsets {offsets}, shape {shape} of {target.global_shape}; "
                f"a rank's part is missing?)")
    return ""


def _overlap(source: tuple, target: tuple) -> tuple | None:
    """Where two boxes ``(offsets, shape)`` of one value meet: ``(slices into the source,
    slices into the target)``, or None where they do not."""
    into_source, into_target = [], []
    for s_off, s_len, t_off, t_len in zip(*source, *target):
        start, stop = max(s_off, t_off), min(s_off + s_len, t_off + t_len)
        if start >= stop:
            return None
        into_source.append(slice(start - s_off, stop - s_off))
        into_target.append(slice(start - t_off, stop - t_off))
    return tuple(into_source), tuple(into_target)


def to_numpy(platform: Platform, value: Any) -> np.ndarray:
    """A tensor or array as numpy (numpy has no bfloat16: those come as float32)."""
    if isinstance(value, np.ndarray):
        return value
    if platform.dtype_of(value) == platform.dtype("bfloat16"):
        value = platform.cast(value, platform.dtype("float32"))
    return platform.to_numpy(value)


def assemble(platform: Platform, target: ShardedValue, pieces: list) -> np.ndarray:
    """This rank's ``target`` box out of checked ``pieces``, as a new numpy array."""
    offsets, shape = target.box()
    out = None
    for piece in pieces:
        where = _overlap(piece.box(), (offsets, shape))
        if where is None:
            continue
        data = to_numpy(platform, piece.local)
        if out is None:
            out = np.empty(shape, data.dtype)
        out[where[1]] = data[where[0]]
    return np.empty(shape, np.float32) if out is None else out  # None: no elements here


def write_entry(platform: Platform, entry: Entry, rows: np.ndarray) -> None:
    """Write this rank's rows into the live tensor, with the padding rows it keeps (zero)."""
    fp = entry.fsdp_param
    if fp is not None and fp.stored_rows > fp.local_rows:
        pad = list(rows.shape)
        pad[fp.shard_dim] = fp.stored_rows - fp.local_rows
        rows = np.concatenate([rows, np.zeros(pad, rows.dtype)], axis=fp.shard_dim)
    value = platform.cast(platform.from_numpy(rows), platform.dtype_of(entry.tensor))
    platform.copy_into(entry.tensor, value)
