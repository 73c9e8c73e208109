"""What memory a fully_shard unit keeps alive through references of its own.

[Note: why walk the unit's objects]
Between a resharded unit's forward and its backward, the unit should hold the memory of
its shards and nothing more: its full parameters are released (their tensor objects stay,
at 0 bytes, for autograd), and whatever its forward made on the way (all-gather outputs, a
gather codec's bytes, tensor-parallel views, a kept set's aliases, pending gathers) is
gone. A step's memory per block rests on it on every framework and machine, where the
allocators' figures (benchmarks/step_memory.py) vary by machine and version.
``held_beyond_shards`` follows every Python reference from the unit's state (its param
groups, legs, FSDPParams, full parameters, pending gathers and the closures they keep),
stopping at modules, other units, the shared iteration context, the mesh and the platform,
and sums the memory of the tensors it reaches that are none of the unit's shards, each
storage once. Memory that only the framework's autograd holds is not reachable this way:
the full parameters' own storages cover it (run_memory in scenarios.py reads them too).
"""

from __future__ import annotations

import gc
import types

from hyper_parallel.fully_shard.iteration import IterationContext
from hyper_parallel.fully_shard.mesh import MeshInfo
from hyper_parallel.fully_shard.state import STATE_ATTR, FSDPState
from hyper_parallel.platform import Platform

# not followed: shared by every unit (the iteration, the platform, the mesh with its rank
# table), or no part of any (classes, code)
_NOT_FOLLOWED = (IterationContext, Platform, MeshInfo, type, types.ModuleType, types.CodeType)


def _storage(tensor):
    """``(data pointer, bytes)`` of the memory behind ``tensor`` (torch: a DTensor's local)."""
    local = getattr(tensor, "_local_tensor", tensor)
    storage = local.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def held_beyond_shards(platform, state: FSDPState) -> int:
    """Bytes of the memory reachable from ``state`` that is not one of its shards (see the
    note at the top)."""
    shards = set()
    for fsdp_param in state.params:
        for tensor in (fsdp_param.sharded_param, fsdp_param.padded_shard):
            if tensor is not None:
                shards.add(_storage(tensor)[0])
    seen, held, stack = {id(state)}, {}, [state]
    while stack:
        for ref in gc.get_referents(stack.pop()):
            if id(ref) in seen:
                continue
            seen.add(id(ref))
            if platform.is_tensor(ref):
                ptr, nbytes = _storage(ref)
                if ptr not in shards:
                    held[ptr] = max(held.get(ptr, 0), nbytes)
            elif not (isinstance(ref, _NOT_FOLLOWED) or isinstance(ref, FSDPState)
                      or STATE_ATTR in getattr(ref, "__dict__", ())
                      or _is_module(platform, ref)):
                stack.append(ref)
    return sum(held.values())


def _is_module(platform, obj) -> bool:
    if platform.name == "torch":
        import torch

        return isinstance(obj, torch.nn.Module)
    import mindspore

    return isinstance(obj, mindspore.nn.Cell)
