"""Bounded failure: a collective that does not finish within the timeout ends the process.

Design note
-----------
A collective whose peer died or stopped calling collectives blocks forever on some
frameworks (MindSpore's CPU collectives ignore the group's timeout), and where the
framework does raise (torch gloo), its error names neither the collective nor the unit.
So every process that ``init_distributed`` joins runs one watchdog thread, as NCCL's
watchdog does for CUDA:

* The platform tells it each collective it issues (``issued``, called by
  ``Platform._issuing``, called by every collective entry point, barriers included): one
  attribute store.
* The thread samples the issuing thread's stack every ``poll_s``. Blocked means "inside
  the platform's code", not only inside a collective call: MindSpore's pipeline makes a
  rank wait for a collective's result at the next kernel that needs it (a cast, the
  unshard cell), wherever in the platform that is. Checkpoint I/O (``state_io``) is the
  one long platform call that waits for the disk, not for peers, and is never taken for
  a hang. Seen blocked at every sample
  for longer than ``timeout_s`` with no new collective issued, the thread prints the error
  to stderr and ends the process with ``EXIT_CODE`` (a thread stuck in native code cannot
  be unwound by an exception from another thread). Short platform calls between samples
  never look blocked for long, so no end-of-collective hook is needed.
* The unit (its module path under the root, as ``named_modules()`` names it; ``root``
  for the root) is read from the blocked stack only when the error is written.
* An exception escaping the process while a collective is open (gloo's "connection closed
  by peer") gets the same description printed first, through ``sys.excepthook``.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_CODE = 75
#: why a cross-check (collective_check.py) waits: its peers issued nothing
PEERS_SILENT = ("no peer rank issued a collective there; one ran fewer steps or skipped this "
                "unit, died, or stopped calling collectives (see its log)")


class Watchdog:
    """Watches the collective this process is blocked in; one instance per process."""

    def __init__(self, timeout_s: float, rank: int, world_size: int):
        self.timeout_s = float(timeout_s)
        self.poll_s = min(self.timeout_s / 10, 2.0)
        self.rank, self.world_size = rank, world_size
        self._issued = None  # (op, dim, thread id, checking) of the collective issued last
        self._stop = threading.Event()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        self._thread = threading.Thread(target=self._watch, name="hp-watchdog", daemon=True)
        self._thread.start()

    def issued(self, op: str, dim: str, checking: str | None = None) -> None:
        """Called by the platform as it issues a collective; ``checking``: the collective
        whose cross-check (collective_check.py) this exchange is."""
        self._issued = (op, dim, threading.get_ident(), checking)

    def forget(self) -> None:
        """Nothing is in flight any more: an exception raised now is no peer's fault."""
        self._issued = None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook

    def _watch(self) -> None:
        seen, since = None, 0.0  # the record seen blocked at every sample, and from when
        while not self._stop.wait(self.poll_s):
            record = self._issued
            frames = list(frames_of(sys._current_frames().get(record[2]))) if record else []
            if not _waits_on_peers(frames):
                seen = None
            elif record is not seen:
                seen, since = record, time.monotonic()
            elif time.monotonic() - since > self.timeout_s:
                sys.stderr.write(self._describe(record, frames, "did not finish within "
                                                f"{self.timeout_s:g} s") + "\n")
                sys.stderr.flush()
                os._exit(EXIT_CODE)
            frames = None  # held until the next sample, they would keep the frames' locals alive

    def _describe(self, record, frames, what: str) -> str:
        op, dim, _, checking = record
        group = f"the {dim!r} mesh dimension's group" if dim else "the default group"
        if checking is not None:
            return (f"hyper_parallel: rank {self.rank} of {self.world_size}: the cross-check "
                    f"(HP_DEBUG=collectives) of {checking} over {group} {what}: {PEERS_SILENT}")
        unit = unit_of(frames) or "(outside any fully_shard unit)"
        return (f"hyper_parallel: rank {self.rank} of {self.world_size}: {op} of unit "
                f"{unit!r} over {group} {what}: a peer rank died or stopped "
                "calling collectives (see its log); if the step is only slow, raise "
                "init_distributed(timeout_s=...)")

    def _excepthook(self, kind, value, tb) -> None:
        record, frames, step = self._issued, [], tb
        while step is not None:
            frames.append(step.tb_frame)
            step = step.tb_next
        frames.reverse()  # innermost first
        if record is not None and _waits_on_peers(frames):
            sys.stderr.write(self._describe(record, frames, f"failed ({kind.__name__})") + "\n")
        self._previous_hook(kind, value, tb)


_PLATFORM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "platform") + os.sep


def _waits_on_peers(frames) -> bool:
    """Whether a stack is in the platform's code, other than its checkpoint I/O."""
    files = [frame.f_code.co_filename for frame in frames]
    return (any(name.startswith(_PLATFORM_DIR) for name in files)
            and not any(name.startswith(_PLATFORM_DIR) and os.path.basename(name) == "state_io.py"
                        for name in files))


def frames_of(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def unit_of(frames) -> str | None:
    """Module path of the innermost fully_shard unit on the stack (innermost frame first):
    a unit's own hooks, or the reduction of its gradients (which a later unit's backward
    may drive)."""
    for frame in frames:
        owner = frame.f_locals.get("self")
        if type(owner).__name__ in ("FSDPState", "UnitReduction"):
            return owner.path
    return None


_ACTIVE: list = []  # the process's watchdog, once init_distributed started it


def start(timeout_s: float, rank: int, world_size: int) -> Watchdog:
    stop()
    _ACTIVE.append(Watchdog(timeout_s, rank, world_size))
    return _ACTIVE[0]


def stop() -> None:
    while _ACTIVE:
        _ACTIVE.pop().stop()


def active() -> Watchdog | None:
    return _ACTIVE[0] if _ACTIVE else None
