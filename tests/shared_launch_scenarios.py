"""Rank side of tests/test_shared_launch.py: jobs of one shared 3-rank torch launch (a
world size no other module's jobs use) that end, raise on one rank while its peers wait for
it in a barrier, or sleep until the test process is interrupted."""

from __future__ import annotations

import os
import time

import hyper_parallel as hp


def process_id() -> int:
    hp.get_platform().barrier()
    return os.getpid()


def raise_on_rank_1() -> None:
    platform = hp.get_platform()
    if platform.rank() == 1:
        raise ValueError("raised on purpose on rank 1")
    platform.barrier()  # ranks 0 and 2 wait here for rank 1, which never comes


def write_then_sleep(directory: str) -> None:
    """Makes a directory a second attempt would fail on, notes the attempt, then sleeps
    until the test process's interruption ends the launch."""
    rank = hp.get_platform().rank()
    os.makedirs(os.path.join(directory, f"made-{rank}"))
    with open(os.path.join(directory, "attempts"), "a", encoding="utf-8") as file:
        file.write(f"{rank}\n")
    time.sleep(600)
