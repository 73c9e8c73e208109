"""The collectives of the contract: one entry point per operation, each with a handle.

[Note: one entry point per collective]
``all_gather``, ``reduce_scatter``, ``all_reduce`` and ``barrier`` are implemented here,
once, for every platform: each tells the desync check and the watchdog what is about to be
issued (``_issuing``), calls the platform's own ``_all_gather``/... and counts what went on
the wire (``CommStats``). Where a device lacks a collective, the platform composes it from
what exists and names the op it really executed on the handle (``Handle.wire``); the core
never knows. Every gradient collective SUMs; scaling is the core's (reduce_op.py).
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

    def _count(self, op: str, handle: Handle, nbytes: int, dim: str) -> None:
        self.comm_stats.record(op, handle.wire or op, nbytes, dim)

    def _nbytes(self, tensor: Any) -> int:
        return int(np.prod(self.shape(tensor))) * self.element_size(self.dtype_of(tensor))

