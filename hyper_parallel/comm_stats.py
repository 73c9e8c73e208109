"""``comm_stats()`` and ``track_comms()``: this process's collective counters, which its
platform keeps (platform/comm_stats.py says what is counted)."""

from __future__ import annotations

import contextlib

from hyper_parallel.platform import get_platform
from hyper_parallel.platform.comm_stats import CommStats


def comm_stats() -> CommStats:
    """The live collective counters of this process (see ``track_comms`` for a window)."""
    return get_platform().comm_stats


@contextlib.contextmanager
def track_comms():
    """Yield a CommStats that, on exit, holds the collectives issued inside the block."""
    live = comm_stats()
    start = live.snapshot()
    window = CommStats()
    try:
        yield window
    finally:
        window.records = live.minus(start).records
