"""Full (unsharded) state dicts: gathered one value at a time, to rank 0 or to every rank.

Each sharded value is all-gathered over its unit's shard group (padded like the unit's
buffers) and trimmed; whole values (unsharded parameters, step counters) are read as they
are. A value the core's tensor parallelism split into blocks (its ``ParamLayout``) is then
all-gathered over its tensor-parallel mesh along its split dim: the whole tensor. One
value is gathered at a time, and a rank that does not keep the result drops it before the
next: no rank holds more than the full state plus one value. The inverse, a
full state dict loaded into a sharded model, is ``set_state_dict`` (state_dict.py) given
full tensors or arrays: each rank keeps its rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hyper_parallel.checkpoint.arguments import check_bool, check_model
from hyper_parallel.platform import get_platform
from hyper_parallel.checkpoint.state_dict import state_entries, to_numpy
from hyper_parallel.tensor_parallel.collectives import gather_along

if TYPE_CHECKING:
    from hyper_parallel.platform.base import Platform
    from hyper_parallel.checkpoint.state_dict import Entry


def get_full_state_dict(model: Any, optimizer: Any = None, rank0_only: bool = True,
                        as_numpy: bool = True, tensor_parallel_parts: bool = False) -> dict:
    """``{key: full value}`` of the model (and optimizer; keys as in ``get_state_dict``)
    on global rank 0, ``{}`` on the others; every rank on ``rank0_only=False``. Every rank
    must call it (each sharded value is one all-gather). Values are numpy arrays (new
    memory), or framework tensors with ``as_numpy=False``. A parameter the core's tensor
    parallelism split is gathered whole. ``tensor_parallel_parts``: a torch DTensor
    tensor-parallel parameter is gathered over its tensor-parallel ranks too (otherwise it
    is an error)."""
    platform = get_platform()
    check_model(platform, "get_full_state_dict", model, optimizer)
    for name, value in (("rank0_only", rank0_only), ("as_numpy", as_numpy),
                        ("tensor_parallel_parts", tensor_parallel_parts)):
        check_bool("get_full_state_dict", name, value)
    keep = not rank0_only or platform.rank() == 0
    result, gathered = {}, {}  # gathered: id(live tensor) -> value, for tied parameters
    with platform.no_grad():
        for entry in state_entries(model, optimizer, tensor_parallel_parts):
            value = gathered.get(id(entry.tensor))
            if value is None:
                value = _full_value(platform, entry)
                if as_numpy:
                    value = to_numpy(platform, value)
            if keep:
                result[entry.key] = value
                gathered[id(entry.tensor)] = value
    return result


def gather_full_state_dict(module: Any, as_numpy: bool = True) -> dict:
    """``{qualified parameter name: full value}`` of the model's parameters on every rank; a
    tensor-parallel parameter is gathered over its tensor-parallel ranks too."""
    return get_full_state_dict(module, rank0_only=False, as_numpy=as_numpy,
                               tensor_parallel_parts=True)


def _full_value(platform: Platform, entry: Entry) -> Any:
    """The whole value of ``entry``, in new memory (never a view of a shard)."""
    fp = entry.fsdp_param
    if fp is None:
        value = platform.clone(entry.tensor)
    else:
        moved = platform.movedim(entry.tensor, fp.shard_dim, 0)
        if fp.stored_rows != fp.local_rows:
            moved = platform.narrow(moved, 0, 0, fp.local_rows)
        if fp.chunk_rows != fp.local_rows:
            padding = platform.zeros((fp.chunk_rows - fp.local_rows, *fp.row_shape),
                                     platform.dtype_of(moved))
            moved = platform.cat([moved, padding], 0)
        flat = platform.reshape(platform.contiguous(moved), (fp.padded_numel,))
        pieces = [flat]
        if fp.shard_size > 1:
            pieces = platform.all_gather(flat, fp.mesh_info.shard_group, dim="shard").wait().pieces
        value = platform.full_over_tensor_parallel(
            fp.sharded_param, fp.full_from_pieces(pieces, [0] * len(pieces)))
    layout = entry.tensor_parallel
    if layout is None or not layout.placement.is_shard() or layout.mesh.size() == 1:
        return value
    return gather_along(value, layout.placement.dim % len(layout.whole_shape), layout.mesh)
