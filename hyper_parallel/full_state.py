"""Gather a sharded model's full parameters: for checkpoints, evaluation and parity checks.

Works the same on both frameworks: each managed parameter's shard is all-gathered over its
unit's shard group (padded like the unit's buffers) and trimmed, then, for a parameter
tensor parallelism split (torch DTensor), gathered over the tensor-parallel ranks too;
unmanaged parameters are returned as they are. Every rank gets the full values.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.fully_shard.state import STATE_ATTR
from hyper_parallel.platform import get_platform


def gather_full_state_dict(module: Any, as_numpy: bool = True) -> dict:
    """``{qualified parameter name: full value}`` (numpy arrays, or framework tensors)."""
    platform = get_platform()
    owners = {}  # (id(module), attribute) -> the FSDPParam registered there
    for _, sub in platform.named_modules(module):
        state = sub.__dict__.get(STATE_ATTR)
        if state is not None and state.group is not None:
            for fsdp_param in state.group.params:
                for slot_module, attr in fsdp_param.slots:
                    owners[(id(slot_module), attr)] = fsdp_param
    result = {}
    for name, sub in platform.named_modules(module):
        for attr, param in platform.direct_params(sub):
            key = f"{name}.{attr}" if name else attr
            if key in result:
                continue
            # by slot: a unit that is unsharded registers its full tensors there (torch)
            fsdp_param = owners.get((id(sub), attr))
            value = param if fsdp_param is None else _gather_one(platform, fsdp_param)
            result[key] = platform.to_numpy(value) if as_numpy else value
    return result


def _gather_one(platform, fsdp_param) -> Any:
    size = fsdp_param.shard_size
    with platform.no_grad():
        local = platform.local_tensor(fsdp_param.sharded_param)
        flat = fsdp_param.padded_flat_shard(local, fsdp_param.orig_dtype)
        pieces = [flat]
        if size > 1:
            pieces, _, handle = platform.all_gather_pieces(flat, fsdp_param.mesh_info.shard_group,
                                                           size, dim="shard")
            handle.wait()
        # new memory, never a view of a shard
        local_full = fsdp_param.full_from_pieces(pieces, [0] * len(pieces))
        return platform.full_over_tensor_parallel(fsdp_param.sharded_param, local_full)
