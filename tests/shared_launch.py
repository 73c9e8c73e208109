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

MindSpore ranks of a shared launch run ``launch_blocking()`` (tests/multirank.py), as
docs/platforms.md recommends for CPU runs with about one core per rank: on 2 cores the
2-rank launch takes ~50 s instead of ~140 s in the default asynchronous pipeline, which
other launches keep covering (tests/multirank.py).

A job shares the process with the jobs before it, so it must not depend on starting in
a fresh process (a job that needs that, or that ends the group, keeps its own launch).
A failing job fails the launch: the RankFailure, kept for every job of the launch, names
the target in the failed rank's traceback.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable

from tests.multirank import RankFailure, run_ranks


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
    calls = [(j.key, j.target, j.args(backend), j.env) for j in jobs]
    try:
        per_rank = run_ranks("tests.shared_launch:run_jobs", wanted.world_size, backend, calls,
                             timeout_s=sum(j.timeout_s for j in jobs),
                             env={"HP_TEST_MS_LAUNCH_BLOCKING": "1"})
    except RankFailure as failure:
        for j in jobs:
            _DONE[(backend, j.key)] = failure
        return
    for j in jobs:
        _DONE[(backend, j.key)] = [r[j.key] for r in per_rank]


def run_jobs(calls: list) -> dict:
    """Rank side: each (key, target, args, env) in order; {key: the target's return value}."""
    out = {}
    for key, target, args, env in calls:
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            module_name, function_name = target.split(":")
            out[key] = getattr(importlib.import_module(module_name), function_name)(*args)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return out
