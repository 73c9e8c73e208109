"""One fully_shard unit's parameters and their flat communication buffers.

[Note: one collective per unit]
All of a unit's shards travel together: the all-gather input is the concatenation of every
parameter's padded flat shard (``total`` elements per rank), the output ``[shard_size, total]``
is copied out per parameter. The reduce-scatter input is every parameter's
``[shard_size, padded_numel]`` gradient block placed side by side, so row r (rank r's
chunk) of the flat input is rank r's padded shards of all parameters in order. One
all-gather and one reduce-scatter per unit per pass, never one per parameter.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.fully_shard.mesh import MeshInfo
from hyper_parallel.fully_shard.param import FSDPParam
from hyper_parallel.fully_shard.reduce_op import divide_factors, resolve_reduce_dtype
from hyper_parallel.platform import Platform


class FSDPParamGroup:
    """Gather shards into full parameters and reduce full gradients into shard gradients."""

    def __init__(self, platform: Platform, params: list[FSDPParam], mesh_info: MeshInfo,
                 param_dtype: Any, reduce_dtype: Any):
        self.platform = platform
        self.params = params
        self.mesh_info = mesh_info
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.offsets = []
        total = 0
        for fsdp_param in params:
            self.offsets.append(total)
            total += fsdp_param.padded_numel
        self.total_numel = total
        self._pending_gather = None  # (output buffer, handle) of an all-gather in flight

    def local_shards(self) -> list:
        return [self.platform.local_tensor(p.sharded_param) for p in self.params]

    def _gather_dtype(self, index: int) -> Any:
        return self.param_dtype if self.param_dtype is not None else self.params[index].orig_dtype

    # ---------------------------------------------------------------- all-gather
    def issue_gather(self, async_op: bool) -> None:
        """Start the all-gather of the current shards (no-op if one is already in flight)."""
        if self._pending_gather is not None:
            return
        p = self.platform
        with p.no_grad():
            shards = self.local_shards()
            flat = p.cat([fp.padded_flat_shard(s, self._gather_dtype(i))
                          for i, (fp, s) in enumerate(zip(self.params, shards))], 0)
            size = self.mesh_info.shard_size
            if size == 1:
                self._pending_gather = (flat, None)
                return
            out = p.zeros((size * self.total_numel,), p.dtype_of(flat))
            handle = p.all_gather_into(out, flat, self.mesh_info.shard_group, async_op=async_op,
                                       dim="shard")
            self._pending_gather = (out, handle)

    def has_pending_gather(self) -> bool:
        return self._pending_gather is not None

    def wait_gather(self, into: list | None = None) -> list:
        """Finish the all-gather; return new full tensors or refill ``into`` in place."""
        if self._pending_gather is None:
            self.issue_gather(async_op=False)
        out, handle = self._pending_gather
        self._pending_gather = None
        if handle is not None:
            handle.wait()
        p = self.platform
        gathered = p.reshape(out, (self.mesh_info.shard_size, self.total_numel))
        fulls = [fp.full_from_gathered(gathered, off) for fp, off in zip(self.params, self.offsets)]
        if into is None:
            return fulls
        for dst, src in zip(into, fulls):
            p.restore_storage(dst)
            p.copy_into(dst, src)
        return into

    # ---------------------------------------------------------------- reduce-scatter
    def reduce_grads(self, full_grads: list) -> list:
        """Sharded, averaged gradients (in each shard's dtype) for the unit's full gradients."""
        p = self.platform
        info = self.mesh_info
        dtype = resolve_reduce_dtype(self.reduce_dtype, self.param_dtype, p.dtype_of(full_grads[0]))
        pre, post = divide_factors(info.data_parallel_size,
                                   split_for_fp16=dtype == p.dtype("float16"))
        blocks = [fp.reduce_scatter_block(g, dtype) for fp, g in zip(self.params, full_grads)]
        flat = p.reshape(p.cat(blocks, 1), (info.shard_size * self.total_numel,))
        if pre != 1.0:
            flat = p.scale(flat, 1.0 / pre)
        if info.shard_size > 1:
            reduced = p.zeros((self.total_numel,), dtype)
            p.reduce_scatter(reduced, flat, info.shard_group, dim="shard")
        else:
            reduced = flat
        if info.replicate_size > 1:
            p.all_reduce(reduced, info.replicate_group, dim="replicate")
        if post != 1.0:
            reduced = p.scale(reduced, 1.0 / post)
        return [fp.sharded_grad_from(reduced, off) for fp, off in zip(self.params, self.offsets)]
