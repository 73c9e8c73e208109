"""The collectives of the contract: one entry point per operation, each with a handle.

[Note: one entry point per collective]
``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all`` and ``barrier`` are
implemented here, once, for every platform: each tells the desync check and the watchdog
what is about to be issued (``_issuing``), calls the platform's own ``_all_gather``/... and
counts what went on the wire (``CommStats``). Where a device lacks a collective, the
platform composes it from what exists and names the op it really executed on the handle
(``Handle.wire``); the core never knows. Every gradient collective SUMs; scaling is the
core's (reduce_op.py).

[Note: point to point]
``send`` and ``recv`` are asynchronous: a caller issues every send and receive of an
exchange, then waits, so two ranks sending to each other never wait on each other. They
tell the watchdog (a peer that never sends ends the waiting rank within its timeout) but
are not cross-checked under HP_DEBUG=collectives: only the two ranks of the pair take
part, and the check's exchange runs over the whole group.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from hyper_parallel import watchdog


class Handle:
    """A collective in flight. ``wait()`` blocks until it finished and returns its result
    (``all_gather``: a ``Gathered``; ``reduce_scatter``: this rank's chunk; ``all_reduce``:
    the tensor reduced in place)."""

    def __init__(self, native: Any = None, on_done: Callable[[], Any] | None = None,
                 result: Any = None, wire: str = ""):
        self._native = native
        self._on_done = on_done  # computes the result once the native work finished
        self._done = False
        self.result = result
        self.wire = wire  # what the framework executed, where it differs from the op

    def wait(self) -> Any:
        if not self._done:
            if self._native is not None:
                self._native.wait()
            self._done = True
            if self._on_done is not None:
                on_done, self._on_done, self._native = self._on_done, None, None
                self.result = on_done()  # dropped first: a closure over this handle is no cycle
        return self.result


@dataclass
class Gathered:
    """An all-gather's output: ``pieces[r]`` (1-D, read-only) is rank r's input; ``flat``
    the rank-major buffer the pieces are slices of, or None where the framework delivers
    separate tensors (MindSpore CPU's list all-gather: no copy into one buffer)."""

    pieces: list
    flat: Any = None


class Collectives(abc.ABC):
    """The collective entry points of a Platform (mixed into it, see base.py)."""

    def all_gather(self, input: Any, group: Any, async_op: bool = False, dim: str = "",
                   out: Any = None) -> Handle:
        """Gather every rank's 1-D ``input``; the handle's result is a ``Gathered``.
        ``out``: a 1-D buffer of ``group size * numel`` elements to gather into (its
        ``flat``); without it the output is new memory. ``dim`` names the mesh dimension
        for the counters and error messages."""
        size = self.group_size(group)
        if self._issuing("all_gather", dim, group, input):
            return self._all_gather(input, group, size, async_op, out)
        handle = self._all_gather(input, group, size, async_op, out)
        self._count("all_gather", handle, size * self._nbytes(input), dim)
        return handle

    def reduce_scatter(self, pieces: Sequence[Sequence[Any]], group: Any,
                       async_op: bool = False, dim: str = "") -> Handle:
        """SUM-reduce over ``group``; the result is this rank's chunk, in new memory the
        caller owns. ``pieces[r]`` lists the 1-D tensors whose concatenation rank r
        receives the sum of (equal totals per rank): views of a gradient and zeros for its
        padding go in as they are, and the platform concatenates only what its collective
        needs, at most once. The parts are left as they were."""
        sample = pieces[0][0]
        self._issuing("reduce_scatter", dim, group, sample)
        handle = self._reduce_scatter(pieces, group, async_op)
        numel = sum(int(np.prod(self.shape(t))) for parts in pieces for t in parts)
        self._count("reduce_scatter", handle, numel * self.element_size(self.dtype_of(sample)), dim)
        return handle

    def all_reduce(self, tensor: Any, group: Any, op: str = "sum", async_op: bool = False,
                   dim: str = "") -> Handle:
        """Reduce ``tensor`` in place over ``group`` ("sum", "avg", "max", "min")."""
        self._issuing("all_reduce", dim, group, tensor)
        handle = self._all_reduce(tensor, group, op, async_op)
        self._count("all_reduce", handle, self._nbytes(tensor), dim)
        return handle

    def all_to_all(self, input: Any, input_splits: Sequence[int], output_splits: Sequence[int],
                   group: Any, dim: str = "") -> Handle:
        """Exchange slices of the 1-D ``input``: its ``input_splits[r]`` elements (in rank
        order) go to rank r, and the result, a new 1-D tensor, holds the
        ``output_splits[r]`` elements rank r sent this one, in rank order. Splits may be
        uneven and zero. Synchronous: the handle is done."""
        input_splits, output_splits = [int(n) for n in input_splits], [int(n) for n in output_splits]
        size = self.group_size(group)
        if len(input_splits) != size or len(output_splits) != size:
            raise ValueError(f"hyper_parallel: all_to_all over {size} ranks needs {size} input "
                             f"and output splits, got {len(input_splits)} and {len(output_splits)}")
        if sum(input_splits) != int(np.prod(self.shape(input))):
            raise ValueError(f"hyper_parallel: all_to_all's input splits {input_splits} do not "
                             f"add up to the input's {int(np.prod(self.shape(input)))} elements")
        # the sizes differ by rank, so the cross-check compares the op, not what is sent
        self._issuing("all_to_all", dim, group, None)
        handle = self._all_to_all(input, input_splits, output_splits, group)
        sent = sum(input_splits) - input_splits[self.group_rank(group)]
        self._count("all_to_all", handle, sent * self.element_size(self.dtype_of(input)), dim)
        return handle

    def send(self, tensor: Any, peer: int, group: Any, dim: str = "") -> Handle:
        """Start sending ``tensor`` to rank ``peer`` of ``group``; ``wait()`` before changing
        it. The peer receives it with ``recv`` of the same shape and dtype."""
        self._check_peer("send", peer, group)
        self._p2p_issuing("send", dim)
        handle = self._send(self.contiguous(tensor), peer, group)
        self._count("send", handle, self._nbytes(tensor), dim)
        return handle

    def recv(self, shape: Sequence[int], dtype: Any, peer: int, group: Any,
             dim: str = "") -> Handle:
        """Start receiving a tensor of ``shape`` and ``dtype`` from rank ``peer`` of
        ``group``; the handle's result is that tensor."""
        self._check_peer("recv", peer, group)
        self._p2p_issuing("recv", dim)
        return self._recv(tuple(int(n) for n in shape), dtype, peer, group)

    def barrier(self, group: Any = None) -> None:
        """Block until every rank of ``group`` (default: every rank) arrives."""
        self._issuing("barrier", "", group, None)
        self._barrier(group)

    @abc.abstractmethod
    def _all_gather(self, input: Any, group: Any, group_size: int, async_op: bool,
                    out: Any) -> Handle:
        """``all_gather``'s collective (the caller counts and checks it)."""

    @abc.abstractmethod
    def _reduce_scatter(self, pieces: Sequence[Sequence[Any]], group: Any,
                        async_op: bool) -> Handle:
        """``reduce_scatter``'s collective (the caller counts and checks it)."""

    @abc.abstractmethod
    def _all_reduce(self, tensor: Any, group: Any, op: str, async_op: bool) -> Handle:
        """``all_reduce``'s collective (the caller counts and checks it)."""

    @abc.abstractmethod
    def _all_to_all(self, input: Any, input_splits: list, output_splits: list,
                    group: Any) -> Handle:
        """``all_to_all``'s collective, finished (the caller counts and checks it)."""

    @abc.abstractmethod
    def _send(self, tensor: Any, peer: int, group: Any) -> Handle:
        """Start sending a contiguous ``tensor`` to group rank ``peer``."""

    @abc.abstractmethod
    def _recv(self, shape: tuple, dtype: Any, peer: int, group: Any) -> Handle:
        """Start receiving from group rank ``peer``; the handle's result is the tensor."""

    @abc.abstractmethod
    def _barrier(self, group: Any) -> None:
        """``barrier``'s collective: returns once every rank of ``group`` arrived."""

    def _issuing(self, op: str, dim: str, group: Any, tensor: Any) -> bool:
        """A collective over ``group`` is about to be issued (``tensor``: what this rank
        sends): cross-check it under HP_DEBUG=collectives and tell the watchdog. True for
        the check's own exchange (collective_check.py), which is neither checked nor
        counted."""
        if self.collective_check is not None and self.collective_check.intercept(
                op, dim, group, tensor):
            return True
        watch = watchdog.active()
        if watch is not None:
            watch.issued(op, dim)
        return False

    def _check_peer(self, op: str, peer: int, group: Any) -> None:
        size, me = self.group_size(group), self.group_rank(group)
        if not 0 <= int(peer) < size or int(peer) == me:
            raise ValueError(f"hyper_parallel: {op} to or from rank {peer} of a group of {size} "
                             f"where this rank is {me}: the peer must be another rank of the group")

    def _p2p_issuing(self, op: str, dim: str) -> None:
        watch = watchdog.active()
        if watch is not None:
            watch.issued(op, dim)

    def _count(self, op: str, handle: Handle, nbytes: int, dim: str) -> None:
        self.comm_stats.record(op, handle.wire or op, nbytes, dim)

    def _nbytes(self, tensor: Any) -> int:
        return int(np.prod(self.shape(tensor))) * self.element_size(self.dtype_of(tensor))

