"""The collectives of TorchPlatform: direct calls into ``torch.distributed``.

gloo (CPU) and NCCL (CUDA) both have every collective the platform contract names, so
each method is one call; what differs is only which form of a call is cheaper where both
exist (the reduce-scatter note below). The public wrappers (counting, cross-checks, the
watchdog) are the contract's, in platform/collectives.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyper_parallel.platform.collectives import Gathered, Handle

_all_gather_flat = dist.all_gather_single
_reduce_scatter_flat = dist.reduce_scatter_single

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
}

# gloo's list reduce-scatter reads one tensor per rank (no flat input to build): ~20% faster
# than the flat one at 16 MiB (2 ranks), but a small one costs more CPU per call (4 KiB per
# rank: 1.6 ms listed, 1.0 ms flat).
_GLOO_LIST_REDUCE_SCATTER_BYTES = 1 << 20


def _uses_list_reduce_scatter(group, input_bytes: int) -> bool:
    return dist.get_backend(group) == "gloo" and input_bytes >= _GLOO_LIST_REDUCE_SCATTER_BYTES


class TorchCollectiveOps:
    """The platform's ``_all_gather`` ... ``_barrier`` (platform/collectives.py says what each
    must do); mixed into TorchPlatform."""

    def _all_gather(self, input, group, group_size, async_op, out):
        numel = input.numel()
        if out is None:
            out = self.empty((group_size * numel,), input.dtype)
        work = _all_gather_flat(out, input, group=group, async_op=async_op)
        pieces = [out.narrow(0, r * numel, numel) for r in range(group_size)]
        return Handle(work, result=Gathered(pieces, out))

    def _reduce_scatter(self, pieces, group, async_op):
        nbytes = sum(part.numel() * part.element_size() for parts in pieces for part in parts)
        if _uses_list_reduce_scatter(group, nbytes):
            # a rank's single part (a view of the gradient) is read where it is
            inputs = [parts[0] if len(parts) == 1 else torch.cat(list(parts)) for parts in pieces]
            output = torch.empty_like(inputs[0])
            work = dist.reduce_scatter(output, inputs, op=dist.ReduceOp.SUM, group=group,
                                       async_op=async_op)
            return Handle(work, result=output)
        flat = torch.cat([part for parts in pieces for part in parts])
        output = self.empty((flat.numel() // len(pieces),), flat.dtype)
        work = _reduce_scatter_flat(output, flat, op=dist.ReduceOp.SUM, group=group,
                                    async_op=async_op)
        return Handle(work, result=output)

    def _all_reduce(self, tensor, group, op, async_op):
        work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group, async_op=async_op)
        return Handle(work, result=tensor)

    def _all_to_all(self, input, input_splits, output_splits, group):
        output = self.empty((sum(output_splits),), input.dtype)
        dist.all_to_all_single(output, input.contiguous(), output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=group)
        return Handle(result=output)

    def _send(self, tensor, peer, group):
        return Handle(dist.isend(tensor, group=group, group_dst=peer), result=tensor)

    def _recv(self, shape, dtype, peer, group):
        buffer = self.empty(shape, dtype)
        return Handle(dist.irecv(buffer, group=group, group_src=peer), result=buffer)

    def _barrier(self, group) -> None:
        # A gloo worker thread releases a finished collective a moment after wait() returns
        # in the caller. If that release frees a tensor Python made, it needs the GIL, and
        # once the interpreter is finalizing, taking the GIL ends the thread inside C++ code
        # that may not unwind: the process aborts ("terminate called without an active
        # exception"; docs/platforms.md, "Leaving", has the evidence). A barrier's work holds
        # every collective still in flight when it was issued; kept referenced from Python
        # until the next barrier (or the process end), it makes the main thread, not a
        # worker, release them. destroy_distributed's final barrier is the one that matters.
        work = dist.barrier(group=group, async_op=True)
        work.wait()
        self._last_barrier = work
