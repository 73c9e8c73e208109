"""The collectives of MindSporePlatform, where MindSpore's CPU kernels fall short.

[Note: what MindSpore CPU lacks]
- No reduce-scatter kernel on CPU (nor all-to-all or reduce), so it is composed
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
- No all-to-all kernel on CPU ("DistCommAllToAllVSingle unregistered"): it is made of
  ``isend``/``irecv`` pairs, which move each element once, as a native all-to-all does
  (wire "send_recv"). ``isend`` needs the world-group workaround below.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import mint, ops
from mindspore.communication import GlobalComm
from mindspore.mint import distributed as msdist
from mindspore.mint.distributed import distributed as msdist_impl

from hyper_parallel.platform.collectives import Gathered, Handle

# what mccl's flat all-gather (ops.AllGather) accepts on CPU; the list all_gather takes more
_FLAT_GATHER_DTYPES = (ms.float32, ms.float16, ms.int32)


def _register_world_rank_for_send() -> None:
    """MindSpore 2.10's ``isend`` looks this rank up in the group "hccl_world_group" (a
    default argument fixed at import) whatever group it is given; mccl names its world group
    otherwise, so on CPU the lookup raises "The group hccl_world_group does not exist".
    Recording the rank under that name is what the lookup needs (docs/platforms.md has the
    reproducer); on Ascend the group exists and holds the same rank."""
    msdist_impl._GROUP_RANK_CACHE.setdefault("hccl_world_group", msdist.get_rank())


def _pieces_of(flat, group_size: int, numel: int) -> list:
    """Rank r's ``numel`` elements of a flat all-gather output, read in place."""
    return [mint.narrow(flat, 0, r * numel, numel) for r in range(group_size)]


class MindSporeCollectiveOps:
    """Mixed into MindSporePlatform: its ``_all_gather``, ``_reduce_scatter``,
    ``_all_reduce``, ``_all_to_all``, ``_send``, ``_recv`` and ``_barrier``, over the groups
    it makes."""

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

    def _all_to_all(self, input, input_splits, output_splits, group):
        if not self._on_cpu:
            output = mint.empty((sum(output_splits),), dtype=input.dtype)
            msdist.all_to_all_single(output, input, output_split_sizes=output_splits,
                                     input_split_sizes=input_splits, group=group)
            return Handle(result=output)
        return self._pairwise_all_to_all(input, input_splits, output_splits, group)

    def _pairwise_all_to_all(self, input, input_splits, output_splits, group):
        """All-to-all as point-to-point: at step s each rank sends to rank + s and receives
        from rank - s, every transfer started before any is waited on; empty slices are
        never sent. Each element crosses the wire once, as in a native all-to-all."""
        size, me = len(input_splits), self.group_rank(group)
        starts = [sum(input_splits[:r]) for r in range(size)]
        received = [None] * size
        received[me] = mint.narrow(input, 0, starts[me], input_splits[me])
        pending = []
        for step in range(1, size):
            dst, src = (me + step) % size, (me - step) % size
            if input_splits[dst]:
                part = mint.narrow(input, 0, starts[dst], input_splits[dst]).contiguous()
                pending.append(self._send(part, dst, group))
            if output_splits[src]:
                incoming = self._recv((output_splits[src],), input.dtype, src, group)
                pending.append(incoming)
                received[src] = incoming
        for handle in pending:
            handle.wait()
        pieces = [part.result if isinstance(part, Handle) else part
                  for part in received if part is not None]
        output = ops.cat(pieces, 0) if pieces else mint.empty((0,), dtype=input.dtype)
        return Handle(result=output, wire="send_recv")

    def _send(self, tensor, peer, group):
        group = GlobalComm.WORLD_COMM_GROUP if group is None else group
        _register_world_rank_for_send()
        native = msdist.isend(tensor, dst=msdist.get_global_rank(group, peer), group=group)
        return Handle(native, result=tensor)

    def _recv(self, shape, dtype, peer, group):
        group = GlobalComm.WORLD_COMM_GROUP if group is None else group
        buffer = mint.empty(shape, dtype=dtype)
        native = msdist.irecv(buffer, src=msdist.get_global_rank(group, peer), group=group)
        return Handle(native, result=buffer)

    def _barrier(self, group) -> None:
        # msdist.barrier returns before the peers arrive on CPU; reading the result of an
        # all-reduce cannot happen before every rank of the group contributed.
        self._finish_collectives(group)
