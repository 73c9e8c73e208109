"""Platform conformance suite: every platform passes the same checks (tests/platform/checks_*.py,
one file per group of the contract; the harness is tests/platform/conformance.py).

Design note
-----------
A launch costs seconds (MindSpore's start-up most of all), so each (backend, world size) is
launched once: the 2-rank launch runs the single-process checks and the collective checks,
the 4-rank launch the collective checks and the 2-D mesh ones. The per-rank results are
cached for the module and one test per check reads them, so a failure names its check and
shows the failing rank's traceback. A launch that fails as a whole (a hang, a crash) fails
every test that reads it, each with the launcher's report.

``KNOWN_BUGS`` marks a (backend, check) as a strict xfail while a platform bug is open: the
test starts failing loudly (XPASS) the day the bug is fixed, so the entry gets removed.

Checks of one launch share a process: on MindSpore a kernel error can make later, unrelated
operations of that process fail too, so read the first failing check of a launch first.

A new platform: add its name to BACKENDS, a ``_<Name>Side`` in conformance.py (model, grads)
and, if it composes collectives, its wire function in ``conformance.COMPOSED_WIRE``
(docs/adding-a-platform.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

from hyper_parallel.platform.base import Platform
from hyper_parallel.platform.cp_support import ContextParallelSupport
from hyper_parallel.platform.state_io import StateIO
from hyper_parallel.platform.storage_release import StorageRelease
from hyper_parallel.platform.tp_support import TensorParallelSupport
from tests.multirank import run_ranks
from tests.platform import conformance as C

BACKENDS = ["torch", "mindspore"]
WORLD_SIZES = [2, 4]
LAUNCH_TIMEOUT_S = 150
TEST_TIMEOUT_S = LAUNCH_TIMEOUT_S + 30  # the first test of a launch pays for it

KNOWN_BUGS: dict = {}

_LAUNCHES: dict = {}


def _installed(backend: str) -> bool:
    return importlib.util.find_spec(backend) is not None


def _launch(backend: str, world_size: int) -> list:
    """Per-rank results of the one launch of (backend, world_size), cached for the module."""
    key = (backend, world_size)
    if key not in _LAUNCHES:
        names = (C.local_check_names() if world_size == 2 else []) + \
            C.collective_check_names(world_size)
        try:
            _LAUNCHES[key] = run_ranks("tests.platform.conformance:run_checks", world_size,
                                       backend, names, timeout_s=LAUNCH_TIMEOUT_S)
        except AssertionError as failure:  # RankFailure: the launch as a whole failed
            _LAUNCHES[key] = f"the {backend} launch on {world_size} ranks failed:\n{failure}"
    return _LAUNCHES[key]


def _assert_check(backend: str, world_size: int, check: str) -> None:
    if not _installed(backend):
        pytest.skip(f"{backend} is not installed")
    per_rank = _launch(backend, world_size)
    if isinstance(per_rank, str):
        pytest.fail(per_rank, pytrace=False)
    failures, skips = [], set()
    for rank, results in enumerate(per_rank):
        result = results[check]
        if result["status"] == "fail":
            failures.append(f"--- rank {rank} of {world_size} ---\n{result['detail']}")
        elif result["status"] == "skip":
            skips.add(result["detail"])
    if failures:
        pytest.fail(f"{backend}: check {check!r} failed\n" + "\n".join(failures), pytrace=False)
    if skips:
        pytest.skip("; ".join(sorted(skips)))


def _marks(backend: str, check: str) -> list:
    if (backend, check) in KNOWN_BUGS:
        return [pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[backend, check])]
    return []


LOCAL_PARAMS = [pytest.param(backend, check, id=f"{backend}-{check}", marks=_marks(backend, check))
                for backend in BACKENDS for check in C.local_check_names()]
COLLECTIVE_PARAMS = [
    pytest.param(backend, world_size, check, id=f"{backend}-w{world_size}-{check}",
                 marks=_marks(backend, check))
    for backend in BACKENDS for world_size in WORLD_SIZES
    for check in C.collective_check_names(world_size)]


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("backend, check", LOCAL_PARAMS)
def test_local(backend, check):
    """Single-process tensor, module and autograd behaviour (run in the 2-rank launch)."""
    _assert_check(backend, 2, check)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("backend, world_size, check", COLLECTIVE_PARAMS)
def test_collective(backend, world_size, check):
    """Collectives, groups, meshes and CommStats on real ranks."""
    _assert_check(backend, world_size, check)


CONTRACT = (Platform, StorageRelease, StateIO, TensorParallelSupport, ContextParallelSupport)
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "adding-a-platform.md"


def _contract_methods() -> dict:
    """``{method: how a check calls it}`` for every public method (defaults included) and
    every abstract one of the contract's classes; a platform's own collective
    (``_all_gather``) is called through its entry point (``all_gather``)."""
    names = {name for cls in CONTRACT for name, _ in inspect.getmembers(cls, inspect.isfunction)
             if not name.startswith("_")}
    names |= {name for cls in CONTRACT for name in cls.__abstractmethods__}
    return {name: f".{name.removeprefix('_')}" + ("" if name == "capabilities" else "(")
            for name in names}


@pytest.mark.timeout(30)
def test_every_platform_method_is_checked():
    """A new method of the contract needs a conformance check: each must be called somewhere
    in the harness or the checks (init/destroy_process_group: by the harness of every
    launch)."""
    source = inspect.getsource(C) + "".join(
        inspect.getsource(importlib.import_module(f"tests.platform.{name}"))
        for name in C.CHECK_MODULES)
    by_harness = {"init_process_group", "destroy_process_group"}
    missing = sorted(name for name, call in _contract_methods().items()
                     if name not in by_harness and call not in source)
    assert not missing, f"contract methods without a conformance check: {missing}"


@pytest.mark.timeout(30)
def test_the_guide_names_the_required_contract():
    """docs/adding-a-platform.md lists what a platform must implement: every abstract
    method of Platform, StorageRelease and StateIO, and the number of Platform's."""
    guide = GUIDE.read_text()
    abstract = sorted(name for cls in CONTRACT for name in cls.__abstractmethods__)
    missing = [name for name in abstract if f"`{name}`" not in guide]
    assert not missing, f"{GUIDE.name} does not name the abstract methods {missing}"
    count = len(Platform.__abstractmethods__)
    assert f"{count} abstract methods" in guide, \
        f"{GUIDE.name} does not say Platform has {count} abstract methods"


@pytest.mark.timeout(30)
def test_known_bugs_name_real_checks():
    """A KNOWN_BUGS entry for a renamed or removed check would silently mark nothing."""
    names = set(C.local_check_names()) | set(C.COLLECTIVE_CHECKS)
    stale = sorted(key for key in KNOWN_BUGS if key[0] not in BACKENDS or key[1] not in names)
    assert not stale, f"KNOWN_BUGS entries that match no check: {stale}"
