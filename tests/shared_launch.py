"""One launch per (backend, world size) for the rank-side jobs of several test modules.

Design note
-----------
Most of a small multi-rank job's cost is the launch: a MindSpore rank takes seconds to
start and its first steps warm up kernels. So a test module that needs the results of a
rank-side function registers it as a job when it is imported (``register``), and reads
them with ``results``. pytest imports every collected module before the first test runs,
so the first read for a (backend, world size) finds every job registered for it and runs
them all in one ``run_ranks`` launch, in registration order. Only the jobs of modules with
a test selected in this session run there (tests/conftest.py tells ``select``), so a
module imported but deselected costs nothing; a job registered ``slow`` (cases kept out
of the default run, ``-m slow``) runs only where a slow test of its module is selected.
Each job is one call of its target, with its own ``env`` set in the ranks' environment
while it runs.

MindSpore ranks of a shared launch run ``launch_blocking()`` and jit-decorated functions op
by op (``FAST_MINDSPORE``, tests/multirank.py); ``launch_blocking()``, as
docs/platforms.md recommends for CPU runs with about one core per rank: on 2 cores the
2-rank launch takes ~50 s instead of ~140 s in the default asynchronous pipeline, which
other launches keep covering (tests/multirank.py).

A job shares the process with the jobs before it, so it must not depend on starting in
a fresh process (a job that needs that, or that ends the group, keeps its own launch).

Time limits. A launch runs inside the test that first reads one of its jobs, but its time is
not that test's (nor that of the first reader of a launch wrapped in ``once``, the
others several tests share): while it runs, the test's pytest-timeout timer is stopped (tests/conftest.py
hands ``set_test_timer`` a way to stop it through pytest-timeout's own hooks), and it starts
again in full when the launch ends. The launch's own ``run_ranks`` timeout, the sum of its
jobs' ``timeout_s``, covers what it runs; a test's limit covers what the test does.

Failures. Each rank records, in a directory of the launch, when a job starts, its return
value when it ends, and that it raised if it did (the rank then exits as before, so a peer
waiting in the job's collectives is ended by ``run_ranks`` at once, not at the timeout).
When a launch ends early (a rank failed, the timeout passed), each job's reads get:

- its results, if it ended on every rank;
- the launch's RankFailure (the failed rank's traceback and log tail), if it started on any
  rank and did not end: the job that raised, and a job a peer had started when the launch
  ended; a started job never runs again in the session, so nothing it left half-written
  (files in its ``directory``) meets a second attempt;
- a fresh launch, if it had not started anywhere: the jobs after a failing one still run.

A failure outside every job (joining or leaving the group) is kept for every job of the
launch. An interruption (KeyboardInterrupt, any exception that is not the launch's
RankFailure) is kept for every job that had not ended, and the launch is not run again in
the session.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tests.multirank import FAST_MINDSPORE, RankFailure, run_ranks


@dataclass(frozen=True)
class Job:
    owner: str                        # the registering module's __name__
    key: str
    world_size: int
    target: str                       # "module:function", importable from the repo root
    args: Callable[[str], tuple]      # backend -> the target's arguments
    backends: tuple
    env: dict                         # added to the ranks' environment while it runs
    timeout_s: float
    slow: bool                        # runs only where a slow test of its module is selected


_JOBS: dict[str, Job] = {}
_DONE: dict[tuple, object] = {}  # (backend, key) -> per-rank results, or the RankFailure
_SELECTED: set = set()  # modules with a selected test; empty: every module's jobs run
_SELECTED_SLOW: set = set()  # modules with a selected test marked slow
_TEST_TIMER: list = [None]  # stops the running test's time limit (tests/conftest.py), or None


def register(owner: str, key: str, world_size: int, target: str,
             args: Callable[[str], tuple] = lambda backend: (),
             backends: tuple = ("torch", "mindspore"), env: dict | None = None,
             timeout_s: float = 240, slow: bool = False) -> None:
    """Declare job ``key`` of module ``owner``: ``target(*args(backend))`` on ``world_size``
    ranks, with ``env`` added to the ranks' environment while it runs. A ``slow`` job runs
    only in a session that selects one of ``owner``'s tests marked slow (``-m slow``)."""
    known = _JOBS.get(key)
    if known is not None and (known.owner, known.target) != (owner, target):
        raise ValueError(f"shared_launch: job {key!r} is registered by {known.owner} already")
    _JOBS.setdefault(key, Job(owner, key, world_size, target, args, tuple(backends),
                              dict(env or {}), timeout_s, slow))


@functools.lru_cache(maxsize=None)
def directory(name: str) -> str:
    """A directory for the files a job writes: the same for ``name`` all session, as a
    launch may run before the test that reads it; removed when the test process exits."""
    path = tempfile.mkdtemp(prefix=f"hp-{name}-")
    atexit.register(shutil.rmtree, path, True)
    return path


def select(modules: set, slow_modules: set) -> None:
    """Only jobs of ``modules`` (and any job read) run in the shared launches; slow jobs
    only those of ``slow_modules``."""
    _SELECTED.clear()
    _SELECTED.update(modules)
    _SELECTED_SLOW.clear()
    _SELECTED_SLOW.update(slow_modules)


def once(launch: Callable) -> Callable:
    """``launch`` (of hashable arguments), whose results several tests read, runs once per
    session like a shared launch: outside the reading test's time limit, and what it
    returned, or the exception it ended with, is what every later call gets (a second run
    would start over in the directories the first one wrote)."""
    outcomes: dict = {}

    @functools.wraps(launch)
    def once_per_session(*args):
        if args not in outcomes:
            with _outside_the_test_limit():
                try:
                    outcomes[args] = (True, launch(*args))
                except BaseException as error:
                    outcomes[args] = (False, error)
                    raise
        returned, outcome = outcomes[args]
        if returned:
            return outcome
        if isinstance(outcome, RankFailure):
            raise RankFailure(f"{launch.__name__}{args} failed earlier in this session:\n"
                              f"{outcome}")
        raise outcome.with_traceback(None)

    return once_per_session


def set_test_timer(stopped: Callable[[], contextlib.AbstractContextManager] | None) -> None:
    """``stopped()``: a context in which the running test's time limit is stopped (None: the
    test has none); a shared launch runs in it (see the note)."""
    _TEST_TIMER[0] = stopped


def _outside_the_test_limit() -> contextlib.AbstractContextManager:
    stopped = _TEST_TIMER[0]
    return stopped() if stopped is not None else contextlib.nullcontext()


def results(key: str, backend: str) -> list:
    """Per-rank return values of job ``key`` on ``backend`` (index = rank); the first read
    of a (backend, world size) runs every job registered for it that has not run yet."""
    job = _JOBS[key]
    if backend not in job.backends:
        raise ValueError(f"shared_launch: job {key!r} does not run on {backend}")
    if (backend, key) not in _DONE:
        _launch(backend, job)
    done = _DONE[(backend, key)]
    if isinstance(done, RankFailure):
        raise RankFailure(f"the shared launch of job {key!r} failed:\n{done}")
    return done


def _launch(backend: str, wanted: Job) -> None:
    jobs = [j for j in _JOBS.values()
            if j.world_size == wanted.world_size and backend in j.backends
            and (backend, j.key) not in _DONE
            and (j is wanted or not _SELECTED or j.owner in _SELECTED)
            and (j is wanted or not j.slow or j.owner in _SELECTED_SLOW)]
    with _outside_the_test_limit():
        while jobs:  # each pass runs fewer jobs: one that started is never run again
            jobs = _run(backend, wanted.world_size, jobs)


def _run(backend: str, world_size: int, jobs: list) -> list:
    """One launch of ``jobs``; records each job's outcome in ``_DONE`` and returns those to
    launch again (see the note)."""
    with tempfile.TemporaryDirectory(prefix="hp-jobs-") as progress:
        calls = [(j.key, j.target, j.args(backend), j.env) for j in jobs]
        try:
            run_ranks("tests.shared_launch:run_jobs", world_size, backend, calls, progress,
                      timeout_s=sum(j.timeout_s for j in jobs),
                      env=FAST_MINDSPORE)
            failure = None
        except RankFailure as caught:
            failure = caught
        except BaseException as interruption:
            _record(backend, world_size, jobs, Path(progress), RankFailure(
                f"the shared launch was interrupted ({type(interruption).__name__}: "
                f"{interruption}); it is not launched again in this session"), again=False)
            raise
        return _record(backend, world_size, jobs, Path(progress), failure, again=True)


def _record(backend: str, world_size: int, jobs: list, progress: Path,
            failure: RankFailure | None, again: bool) -> list:
    ranks = range(world_size)
    ended = {j.key for j in jobs if all((progress / f"{j.key}.{r}.pkl").exists() for r in ranks)}
    started = {j.key for j in jobs if any((progress / f"{j.key}.{r}.started").exists()
                                           for r in ranks)}
    outside = failure is not None and again and not started - ended  # joining or leaving
    rest = []
    for j in jobs:
        if j.key in ended and not outside:
            _DONE[(backend, j.key)] = [_load(progress / f"{j.key}.{r}.pkl") for r in ranks]
        elif again and not outside and j.key not in started:
            rest.append(j)
        else:
            raised = [r for r in ranks if (progress / f"{j.key}.{r}.failed").exists()]
            # each raising rank's own error: the rank the launch saw fail first may be a
            # peer that was waiting for it, whose error says only that the peer left
            errors = "".join(f"\n  rank {r}: {(progress / f'{j.key}.{r}.failed').read_text()}"
                             for r in raised)
            how = (f"raised on ranks {raised}{errors}\n" if raised else
                   "had not ended when the launch did" if j.key in started - ended else
                   "shared a launch that failed outside every job" if outside else
                   "did not run")
            _DONE[(backend, j.key)] = RankFailure(
                f"job {j.key!r} {how}:\n{failure or 'the launch returned no result for it'}")
    return rest


def _load(path: Path):
    with open(path, "rb") as file:
        return pickle.load(file)


def run_jobs(calls: list, progress: str | None = None) -> dict:
    """Rank side: each (key, target, args, env) in order; {key: the target's return value}.
    With ``progress`` (a shared launch), each job's start, return value (pickled) or failure
    is written there as it happens, so a launch that ends early still tells them apart."""
    rank = os.environ["RANK"]
    out = {}
    for key, target, args, env in calls:
        mark = os.path.join(progress, f"{key}.{rank}") if progress is not None else None
        if mark is not None:
            open(f"{mark}.started", "wb").close()
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            module_name, function_name = target.split(":")
            out[key] = getattr(importlib.import_module(module_name), function_name)(*args)
        except BaseException as error:
            if mark is not None:  # what it raised, for the job's own failure
                with open(f"{mark}.failed", "w", encoding="utf-8") as file:
                    file.write(f"{type(error).__name__}: {error}")
            raise
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        if mark is not None:
            with open(f"{mark}.pkl.partial", "wb") as file:
                pickle.dump(out.pop(key), file)
            os.replace(f"{mark}.pkl.partial", f"{mark}.pkl")  # never a truncated result
    return out
