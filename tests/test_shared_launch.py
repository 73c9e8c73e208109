"""The suite's shared launches (tests/shared_launch.py) on real ranks: a job that raises
fails only its own reads (the jobs before it keep their results, the jobs after it run in a
fresh launch), and a launch interrupted in the test process is not launched again, so its
job never meets the directory its first attempt wrote (tests/shared_launch_scenarios.py,
one 3-rank torch launch)."""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time

import pytest

from tests import shared_launch
from tests.multirank import RankFailure

SCENARIOS = "tests.shared_launch_scenarios"
WORLD = 3
for key, function in [("harness_before", "process_id"), ("harness_raises", "raise_on_rank_1"),
                      ("harness_after", "process_id")]:
    shared_launch.register(__name__, key, WORLD, f"{SCENARIOS}:{function}",
                           backends=("torch",), timeout_s=120)
shared_launch.register(__name__, "harness_interrupted", WORLD, f"{SCENARIOS}:write_then_sleep",
                       lambda backend: (shared_launch.directory("harness"),),
                       backends=("torch",), timeout_s=120)


def _attempts() -> list:
    path = os.path.join(shared_launch.directory("harness"), "attempts")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as file:
        return file.read().split()


@pytest.fixture(scope="module")
def interrupted_launch():
    """Reads the first job: the launch runs the jobs up to the one that raises, a fresh
    launch the rest, and this process is interrupted (as Ctrl-C or a test's time limit
    would) once the last job is under way."""
    done = threading.Event()

    def interrupt_once_the_last_job_runs():
        while not done.wait(0.2):
            if len(_attempts()) == WORLD:
                _thread.interrupt_main()
                return

    # interrupt_main() acts through Python's SIGINT handler, and a suite started in the
    # background by a shell without job control (`make test &` in a script) inherits SIGINT
    # ignored, which Python keeps: Ctrl-C's own handler for this read
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    watcher = threading.Thread(target=interrupt_once_the_last_job_runs, daemon=True)
    watcher.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            shared_launch.results("harness_before", "torch")
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGINT, previous)


@pytest.mark.timeout(600)
def test_a_job_that_raises_fails_only_its_own_reads(interrupted_launch):
    before = shared_launch.results("harness_before", "torch")
    after = shared_launch.results("harness_after", "torch")
    assert len(set(before)) == WORLD and len(set(after)) == WORLD
    assert not set(before) & set(after)  # the jobs after the one that raised: a fresh launch
    with pytest.raises(RankFailure) as failure:
        shared_launch.results("harness_raises", "torch")
    assert "job 'harness_raises' raised on ranks [" in str(failure.value)  # a waiting peer may too
    assert "ValueError: raised on purpose on rank 1" in str(failure.value)


@pytest.mark.timeout(600)
def test_an_interrupted_launch_is_not_launched_again(interrupted_launch):
    for _ in range(2):
        start = time.monotonic()
        with pytest.raises(RankFailure) as failure:
            shared_launch.results("harness_interrupted", "torch")
        assert time.monotonic() - start < 1  # no launch
        message = str(failure.value)
        assert "job 'harness_interrupted' had not ended when the launch did" in message
        assert "interrupted (KeyboardInterrupt" in message
    assert sorted(_attempts()) == ["0", "1", "2"]  # one attempt on each rank
