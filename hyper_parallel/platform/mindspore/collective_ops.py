"""The collectives of MindSporePlatform, where MindSpore's CPU kernels fall short.

[Note: what MindSpore CPU lacks]
- No reduce-scatter kernel on CPU (nor all-to-all, send/recv or reduce), so it is composed
  from what there is. Over two ranks: an exchange, one all-gather (see below) of the
  chunk the peer owns, plus the own chunk; each rank sends half its input, as a native
  reduce-scatter would, where an all-reduce sends all of it (docs/platforms.md has the
  timings). Over n ranks an all-gather exchange would send (n-1)²/n of the input against
  an all-reduce's 2(n-1)/n, so from three ranks on it is an all-reduce (SUM) of the whole
  input, then this rank's chunk. The counter records what went on the wire. On Ascend
  the native ``reduce_scatter_tensor`` is used.
- No ``all_gather_into_tensor`` kernel on CPU. Over the world group mccl's ``ops.AllGather``
  primitive returns the gathered flat tensor (what ``all_gather_into_tensor`` writes), and
  costs less than the list form plus a concatenation (docs/platforms.md); it refuses any
  other group ("only support mccl_world_group on CPU") and dtypes other than float32,
  float16 and int32 (bfloat16 among them), where a list ``all_gather`` and a
  concatenation stand in. Both allocate their output: ``all_gather(out=...)`` then copies it
  into the caller's buffer. On Ascend the native kernel is used.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import mint, ops
from mindspore.communication import GlobalComm
from mindspore.mint import distributed as msdist

from hyper_parallel.platform.collectives import Gathered, Handle

# what mccl's flat all-gather (ops.AllGather) accepts on CPU; the list all_gather takes more
_FLAT_GATHER_DTYPES = (ms.float32, ms.float16, ms.int32)


def _pieces_of(flat, group_size: int, numel: int) -> list:
    """Rank r's ``numel`` elements of a flat all-gather output, read in place."""
    return [mint.narrow(flat, 0, r * numel, numel) for r in range(group_size)]


class MindSporeCollectiveOps:
    """Mixed into MindSporePlatform: its ``_all_gather``, ``_reduce_scatter``,
    ``_all_reduce`` and ``_barrier``, over the groups it makes."""

    def _all_gather(self, input, group, group_size, async_op, out):
        numel = input.shape[0]
        if not self._on_cpu:
            if out is None:
                out = mint.empty((group_size * numel,), dtype=input.dtype)
            native = msdist.all_gather_into_tensor(out, input, group=group, async_op=async_op)
            return Handle(native, result=Gathered(_pieces_of(out, group_size, numel), out))
        if group in (None, GlobalComm.WORLD_COMM_GROUP) and input.dtype in _FLAT_GATHER_DTYPES:
            if self._world_gather is None:
                self._world_gather = ops.AllGather()
            whole = self._world_gather(input)
            gathered, native, wire = Gathered(_pieces_of(whole, group_size, numel), whole), \
                None, "all_gather"
        else:
            pieces = [mint.empty(input.shape, dtype=input.dtype) for _ in range(group_size)]
            native = msdist.all_gather(pieces, input, group=group, async_op=async_op)
            gathered, wire = Gathered(pieces), "all_gather_list"
        if out is None:  # the pieces are read where the collective put them: no copy
            return Handle(native, result=gathered, wire=wire)

        def copy_out():
            self.copy_into(out, gathered.flat if gathered.flat is not None
                           else ops.cat(gathered.pieces, 0))
            return Gathered(_pieces_of(out, group_size, numel), out)

        handle = Handle(native, on_done=copy_out, wire=wire)
        if not async_op:
            handle.wait()
        return handle

    def _reduce_scatter(self, pieces, group, async_op):
        size = len(pieces)
        if self._on_cpu and size == 2:
            return self._exchange_reduce_scatter(pieces, group, async_op)
        flat = self.cat([part for parts in pieces for part in parts])  # our own copy
        chunk = flat.shape[0] // size
        if not self._on_cpu:
            output = mint.empty((chunk,), dtype=flat.dtype)
            native = msdist.reduce_scatter_tensor(output, flat, group=group, async_op=async_op)
            return Handle(native, result=output)
        native = msdist.all_reduce(flat, op="sum", group=group, async_op=async_op)
        start = self.group_rank(group) * chunk
        handle = Handle(native, on_done=lambda: mint.narrow(flat, 0, start, chunk) + 0,
                        wire="all_reduce")
        if not async_op:
            handle.wait()
        return handle

    def _exchange_reduce_scatter(self, pieces, group, async_op):
        """The reduce-scatter of a two-rank group as one all-gather: each rank sends
        only the chunk its peer owns, so each sends half its input, as a native
        reduce-scatter does, where an all-reduce sends all of it. The received chunk plus
        the own one is the result (the sum of two terms, as exact as the all-reduce's)."""
        me = self.group_rank(group)
        outgoing = self.cat(pieces[1 - me])  # a private contiguous copy of the peer's parts
        gather = self._all_gather(outgoing, group, 2, async_op, None)
        own = pieces[me][0] if len(pieces[me]) == 1 else ops.cat(pieces[me], 0)
        handle = Handle(gather, on_done=lambda: own + gather.result.pieces[1 - me],
                        wire=gather.wire)
        if not async_op:
            handle.wait()
        return handle

    def _all_reduce(self, tensor, group, op, async_op):
        native = msdist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        return Handle(native, result=tensor)

    def _barrier(self, group) -> None:
        # msdist.barrier returns before the peers arrive on CPU; reading the result of an
        # all-reduce cannot happen before every rank of the group contributed.
        self._finish_collectives(group)
