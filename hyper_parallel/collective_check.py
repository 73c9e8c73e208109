"""Desync detection (``HP_DEBUG=collectives``): the ranks of a group compare each collective
before any of them issues it.

Design note
-----------
Ranks that disagree about what to run (one skips a unit through data-dependent control
flow, one runs a step more) hang in mismatched collectives or, worse, reduce tensors that do
not belong together. Under this opt-in check ``Platform._issuing``, the one place every
collective passes just before it is issued, hands each one to ``CollectiveCheck.intercept``,
which

* describes it (``Issued``): op, mesh dim, the unit (its module path) and whether
  a forward or a backward issues it, the shape and dtype this rank sends, and the units
  whose forward ran this iteration (their number, the last one, a digest of the order);
* all-gathers the description, encoded in a fixed-size int32 buffer, over the collective's
  own group with the platform's own all-gather (``intercept`` lets that exchange through
  unchecked and uncounted, so ``comm_stats`` shows the same traffic either way);
* raises ``CollectiveDesyncError`` when any rank's description differs, with both
  versions. Every rank received every description, so every rank of the group raises;
  none is left waiting.

While the exchange waits, the watchdog knows which collective it cross-checks: a rank whose
peers issue nothing more (a peer ran one step fewer and waits elsewhere) ends with an error
naming it, and so does an exchange the framework itself fails (torch gloo's timeout).
``destroy_distributed`` cross-checks its final barrier the same way, so a rank
that ran a step more meets its peers' "final barrier" and raises instead of hanging.

Off (the default) the whole cost is ``_issuing``'s ``collective_check is not None`` test.
"""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass, fields

import numpy as np

from hyper_parallel import watchdog

_WORDS = 128  # int32 words per rank: 4 of header (rank, count, digest, length), then text
_TEXT_BYTES = (_WORDS - 4) * 4
_SEP = "\x1f"
ADVICE = ("every rank of a group must issue the same collectives in the same order: run the "
          "same fully_shard units (no data-dependent skipping of a unit on some ranks) and "
          "the same number of steps")


class CollectiveDesyncError(RuntimeError):
    """The ranks of a group were about to issue different collectives, or this rank's peers
    issued none where it was about to issue one."""


@dataclass(frozen=True)
class Issued:
    """What one rank is about to issue, as its peers compare it."""

    op: str
    dim: str = ""
    unit: str = ""          # module path of the unit, "" outside any
    phase: str = ""         # "forward", "backward", or "" outside any unit
    sends: str = ""         # dtype and shape of what this rank sends
    forwards: int = 0       # units whose forward ran this iteration
    last_forward: str = ""  # the last of them
    order: int = 0          # digest of their order

    def encode(self) -> str:
        return _SEP.join(str(getattr(self, f.name)) for f in fields(self))

    @classmethod
    def decode(cls, text: str) -> Issued | None:
        parts = text.split(_SEP)
        if len(parts) != len(fields(cls)):
            return None  # truncated: shown as raw text
        *head, forwards, last, order = parts
        return cls(*head, int(forwards), last, int(order))

    def short(self) -> str:
        """The collective and where it is issued, e.g. "all_gather of unit 'root' in forward"."""
        where = f" of unit {self.unit!r}" if self.unit else ""
        return self.op + where + (f" in {self.phase}" if self.phase else "")

    def __str__(self) -> str:
        sends = f" (sends {self.sends})" if self.sends else ""
        ran = (f"after {self.forwards} unit forward(s) this iteration, the last "
               f"{self.last_forward!r}" if self.forwards else "before any unit's forward this "
               "iteration")
        return f"{self.short()}{sends}, {ran}"


class CollectiveCheck:
    """Cross-checks every collective of one process; installed by ``init_distributed``."""

    def __init__(self, platform):
        self.platform = platform
        self.checked = 0  # collectives cross-checked so far
        self._exchanging = False

    def intercept(self, op: str, dim: str, group, tensor) -> bool:
        """Cross-check a collective about to be issued; True for this check's own exchange,
        which the platform then neither counts nor reports to the watchdog."""
        if self._exchanging:
            return True
        p = self.platform
        unit, iteration = _context(sys._getframe(2))
        order = [s.path for s in iteration.forwards_run] if iteration is not None else []
        phase = "backward" if p.in_backward() else ("forward" if unit else "")
        sends = f"{p.dtype_of(tensor)} {list(p.shape(tensor))}" if tensor is not None else ""
        self.check(Issued(op, dim, unit or "", phase, sends, len(order),
                          order[-1] if order else "", zlib.crc32("\n".join(order).encode())),
                   group)
        return False

    def check(self, issued: Issued, group) -> None:
        """Exchange ``issued`` with the other ranks of ``group`` (None: every rank) and raise
        ``CollectiveDesyncError`` if any differs."""
        p = self.platform
        size = p.world_size() if group is None else p.group_size(group)
        if size == 1:
            return
        self.checked += 1
        text = issued.encode().encode()
        payload = np.zeros(_WORDS, np.int32)
        payload[:4] = (p.rank(), self.checked, np.uint32(zlib.crc32(text)).view(np.int32),
                       len(text))
        payload[4:] = np.frombuffer(text[:_TEXT_BYTES].ljust(_TEXT_BYTES, b"\0"), np.int32)
        watch = watchdog.active()
        if watch is not None:
            watch.issued(issued.op, issued.dim, checking=issued.short())
        try:
            rows = self._exchange(payload, group, size)
        except Exception as error:  # the framework gave up waiting for the peers (gloo)
            if watch is not None:
                watch.forget()
            cause = " ".join([type(error).__name__ + ":", *str(error).strip().splitlines()[:1]])
            raise CollectiveDesyncError(
                f"hyper_parallel: rank {p.rank()} of {p.world_size()}: the cross-check "
                f"(HP_DEBUG=collectives) of {issued.short()} over {_group(issued.dim)} failed "
                f"({cause}): {watchdog.PEERS_SILENT}") from error
        first = rows[0]
        for row in rows[1:]:
            if row[2] != first[2] or row[3] != first[3] or not np.array_equal(row[4:], first[4:]):
                if watch is not None:
                    watch.forget()
                raise CollectiveDesyncError(_message(first, row, issued.dim))

    def _exchange(self, payload, group, size) -> list:
        p = self.platform
        self._exchanging = True
        try:
            gathered = p.all_gather(p.from_numpy(payload), group).wait()
            return [p.to_numpy(piece) for piece in gathered.pieces]
        finally:
            self._exchanging = False


def _context(frame):
    """(module path of the innermost unit on the stack or None, its IterationContext or None)."""
    frames = list(watchdog.frames_of(frame))
    unit = watchdog.unit_of(frames)
    for f in frames:
        owner = f.f_locals.get("self")
        kind = type(owner).__name__
        if kind == "FSDPState" and owner.iteration is not None:
            return unit, owner.iteration
        if kind == "IterationContext":
            return unit, owner
    return unit, None


def _group(dim: str) -> str:
    return f"the {dim!r} mesh dimension's group" if dim else "the default group"


def _decoded(row) -> tuple:
    """(global rank, count, Issued or the raw text) of one rank's exchanged description."""
    text = row[4:].tobytes()[:min(int(row[3]), _TEXT_BYTES)].decode(errors="replace")
    return int(row[0]), int(row[1]), Issued.decode(text) or text


def _message(row_a, row_b, dim: str) -> str:
    a, b = _decoded(row_a), _decoded(row_b)
    headline = f"ranks {a[0]} and {b[0]} were about to issue different collectives"
    if isinstance(a[2], Issued) and isinstance(b[2], Issued):
        ran_a, ran_b = ((x.forwards, x.last_forward, x.order) for x in (a[2], b[2]))
        if ran_a != ran_b:
            more, other = (b, a) if ran_b[0] > ran_a[0] else (a, b)
            if more[2].forwards > other[2].forwards or ran_a[1] != ran_b[1]:
                headline = (f"unit {more[2].last_forward!r}'s forward ran on rank {more[0]} but "
                            f"rank {other[0]} issued {other[2].short()}")
            else:
                headline = f"ranks {a[0]} and {b[0]} ran different units' forwards this iteration"
    versions = "".join(f"\n  rank {rank}, its collective #{count}: {issued}"
                       for rank, count, issued in (a, b))
    return (f"hyper_parallel: collectives out of step over {_group(dim)} (HP_DEBUG=collectives): "
            f"{headline}.{versions}\n{ADVICE}")
