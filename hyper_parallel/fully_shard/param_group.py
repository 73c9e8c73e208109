"""One fully_shard unit's parameters and their flat communication buffers.

[Note: one collective per unit]
All of a unit's sharded parameters travel together: the all-gather input is the
concatenation of every parameter's padded flat shard (``total`` elements per rank), the
output ``[shard_size, total]`` is copied out per parameter. The reduce-scatter input is every
parameter's ``[shard_size, padded_numel]`` gradient block side by side, so row r (rank r's
chunk) of the flat input is rank r's padded shards of all parameters in order, and the
output is one flat buffer that is also the unit's all-reduce bucket (all_reduce.py).

Unsharded (small, below ``shard_threshold_bytes``) parameters skip both: each rank holds
them whole, and their gradients form the unit's second bucket, all-reduced over the whole
data-parallel group.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.fully_shard.all_reduce import FusedAllReduce
from hyper_parallel.fully_shard.mesh import MeshInfo
from hyper_parallel.fully_shard.param import FSDPParam
from hyper_parallel.platform import Platform


class Leg:
    """Parameters that share a flat gradient buffer, with their offsets in it."""

    def __init__(self, params: list, bucket: FusedAllReduce):
        self.params = params
        self.bucket = bucket
        self.offsets = []
        total = 0
        for fsdp_param in params:
            self.offsets.append(total)
            total += fsdp_param.padded_numel
        self.total_numel = total


class FSDPParamGroup:
    """Gather shards into full parameters; lay gradients out for their reduction."""

    def __init__(self, platform: Platform, params: list[FSDPParam], mesh_info: MeshInfo,
                 param_dtype: Any, reduce_dtype: Any):
        self.platform = platform
        self.params = params
        self.mesh_info = mesh_info
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        info = mesh_info
        self.sharded = Leg([p for p in params if p.is_sharded], FusedAllReduce(
            platform, info.replicate_group, info.replicate_size, "replicate"))
        self.small = Leg([p for p in params if not p.is_sharded], FusedAllReduce(
            platform, info.data_parallel_group, info.data_parallel_size, "data_parallel"))
        self._pending_gather = None  # (output buffer, handle) of an all-gather in flight

    def local_shards(self) -> list:
        return [self.platform.local_tensor(p.sharded_param) for p in self.params]

    def compute_dtype(self, fsdp_param: FSDPParam) -> Any:
        return self.param_dtype if self.param_dtype is not None else fsdp_param.orig_dtype

    # ---------------------------------------------------------------- all-gather
    def issue_gather(self, async_op: bool) -> None:
        """Start the all-gather of the current shards (no-op if one is already in flight)."""
        if self._pending_gather is not None or not self.sharded.params:
            return
        p = self.platform
        with p.no_grad():
            flat = p.cat([fp.padded_flat_shard(p.local_tensor(fp.sharded_param), self.compute_dtype(fp))
                          for fp in self.sharded.params], 0)
            size = self.mesh_info.shard_size
            if size == 1:
                self._pending_gather = (flat, None)
                return
            out = p.zeros((size * self.sharded.total_numel,), p.dtype_of(flat))
            handle = p.all_gather_into(out, flat, self.mesh_info.shard_group, async_op=async_op,
                                       dim="shard")
            self._pending_gather = (out, handle)

    def has_pending_gather(self) -> bool:
        return self._pending_gather is not None

    def discard_gather(self) -> None:
        """Drop an all-gather nobody consumed (its values may be stale by the next use)."""
        if self._pending_gather is not None:
            _, handle = self._pending_gather
            self._pending_gather = None
            if handle is not None:
                handle.wait()

    def wait_gather(self, into: list | None = None) -> list:
        """Finish the all-gather; return new full tensors (in ``params`` order) or refill
        the tensors of ``into`` in place."""
        p = self.platform
        gathered_fulls = {}
        if self.sharded.params:
            if self._pending_gather is None:
                self.issue_gather(async_op=False)
            out, handle = self._pending_gather
            self._pending_gather = None
            if handle is not None:
                handle.wait()
            gathered = p.reshape(out, (self.mesh_info.shard_size, self.sharded.total_numel))
            for fp, offset in zip(self.sharded.params, self.sharded.offsets):
                gathered_fulls[id(fp)] = fp.full_from_gathered(gathered, offset)
        fulls = [gathered_fulls[id(fp)] if fp.is_sharded else
                 fp.full_from_local(p.local_tensor(fp.sharded_param), self.compute_dtype(fp))
                 for fp in self.params]
        if into is None:
            return fulls
        for dst, src in zip(into, fulls):
            p.restore_storage(dst)
            p.copy_into(dst, src)
        return into

    # ---------------------------------------------------------------- gradient layout
    def flat_gradients(self, leg: Leg, grads_by_param: dict, dtype: Any) -> Any:
        """The leg's gradients as one flat ``[shard_size * total]`` buffer in ``dtype``."""
        p = self.platform
        blocks = [fp.reduce_scatter_block(grads_by_param[id(fp)], dtype) for fp in leg.params]
        return p.reshape(p.cat(blocks, 1), (leg.params[0].shard_size * leg.total_numel,))

    def sharded_gradients(self, leg: Leg, reduced: Any) -> list:
        """Per-parameter gradient shards (each parameter's dtype) out of a reduced buffer."""
        return [fp.sharded_grad_from(reduced, off) for fp, off in zip(leg.params, leg.offsets)]
