"""The launches of the checkpoint suite, shared by tests/test_checkpoint.py and
tests/test_checkpoint_safety.py: torch at 2 ranks saves, MindSpore at 2 ranks crosses,
torch at 2 ranks crashes mid-save (twice), torch at 1 rank resumes. Each launch runs the
jobs of both test modules (rank side: tests/checkpoint_scenarios.py and the checkpoint_*_scenarios.py files
beside it), once per session, so a test of either module
reads the results of a launch the other may already have paid for. A job that leaves an
asynchronous save pending for ``hp.destroy_distributed()`` (tests/_rank_entry.py calls it
after the last job) is the last of its launch.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import tempfile

import pytest

from tests import shared_launch
from tests.multirank import FAST_MINDSPORE, RankFailure, run_ranks

SAFETY = "tests.checkpoint_safety_scenarios"
BN = "tests.checkpoint_bn_scenarios"
OPTIMIZERS = "tests.checkpoint_optimizer_scenarios"


@functools.lru_cache(maxsize=None)
def workdir() -> str:
    path = tempfile.mkdtemp(prefix="hp-ckpt-")
    atexit.register(shutil.rmtree, path, True)
    return path


def checkpoint_dir(name: str) -> str:
    return os.path.join(workdir(), name)


def jobs(world_size: int, backend: str, *calls, timeout_s: float) -> list:
    """Several rank-side functions in one launch: per rank, ``{name: return value}``."""
    return run_ranks("tests.shared_launch:run_jobs", world_size, backend,
                     [(name, target if ":" in target else f"tests.checkpoint_scenarios:{target}",
                       args, {}) for name, target, args in calls], timeout_s=timeout_s,
                     env=FAST_MINDSPORE)


def _at(*names) -> tuple:
    return tuple(checkpoint_dir(name) for name in names)


@shared_launch.once
def launch_saving() -> list:
    return jobs(2, "torch", ("lm", "save_run", _at("A")),
                ("bn", f"{BN}:bn_save_run", _at("bn-A", "bn-native")),
                ("sgd", "save_run", (*_at("sgd-A"), "sgd")),
                ("optimizers", f"{OPTIMIZERS}:optimizer_round_trips", _at("optimizers-torch")),
                ("moves", f"{OPTIMIZERS}:state_across_frameworks", _at("moves-torch", "none")),
                ("pending", f"{SAFETY}:pending_at_destroy", _at("pending-torch")),  # last
                timeout_s=300)


@shared_launch.once
def launch_crossing() -> list:
    if importlib.util.find_spec("mindspore") is None:  # every test that reads it skips
        pytest.skip("the checkpoint chain crosses to MindSpore (tests/checkpoint_launches.py), "
                    "which is not installed")
    launch_saving()
    return jobs(2, "mindspore", ("lm", "cross_run", _at("A", "B")),
                ("bn", f"{BN}:bn_cross_run", _at("bn-A", "bn-B")),
                ("sgd", "cross_run", (*_at("sgd-A", "sgd-B"), "sgd")),
                ("optimizers", f"{OPTIMIZERS}:optimizer_round_trips", _at("optimizers-mindspore")),
                ("moves", f"{OPTIMIZERS}:state_across_frameworks",
                 _at("moves-mindspore", "moves-torch")),
                ("checks", f"{SAFETY}:error_checks_run", _at("A", "checks-mindspore")),
                ("pending", f"{SAFETY}:pending_at_destroy", _at("pending-mindspore")),  # last
                timeout_s=660)


@shared_launch.once
def crashed(target: str = "crash_run", directory: str = "C") -> str:
    """The message of the save that lost rank 1 midway."""
    with pytest.raises(RankFailure) as failure:
        run_ranks(f"tests.checkpoint_scenarios:{target}", 2, "torch", checkpoint_dir(directory),
                  timeout_s=60)
    return str(failure.value)


@shared_launch.once
def launch_resuming() -> dict:
    launch_crossing()
    crashed()
    crashed("crash_async_run", "C-async")
    os.makedirs(checkpoint_dir("checks"), exist_ok=True)
    a, b, checks, c = _at("A", "B", "checks", "C")
    return jobs(1, "torch", ("lm", "resume_run", (a, (1,), b, checks, c)),
                ("bn", f"{BN}:bn_resume_run", _at("bn-A", "bn-native", "bn-B")),
                ("sgd", "resume_run", (*_at("sgd-A"), (1,), *_at("sgd-B"), None, None, "sgd")),
                ("crashed_async", "crashed_checkpoint_loads", _at("C-async")),
                ("moves", f"{OPTIMIZERS}:state_across_frameworks",
                 _at("moves-torch-1", "moves-mindspore")),
                ("checks", f"{SAFETY}:error_checks_run", (a, checks)),
                *((f"pending_{backend}", f"{SAFETY}:loaded_state", _at(f"pending-{backend}"))
                  for backend in ("torch", "mindspore")),
                timeout_s=240)[0]
