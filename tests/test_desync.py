"""Desync detection (HP_DEBUG=collectives, or init_distributed(debug_collectives=True)):
ranks that disagree about what to run raise a clear error instead of hanging or reducing
mismatched tensors, and a run whose ranks agree trains exactly as without the check.

One 2-rank launch per backend runs every case (tests/desync_scenarios.py says in which
order and why the idle case comes last); each test checks its case on every rank. A short
collective timeout bounds the case where a rank's peers issue nothing more.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests import shared_launch
from tests.multirank import REPO_ROOT, RankFailure, run_ranks
from tests.tolerance import FP32_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
TIMEOUT_S = 8  # MindSpore's first collective on a loaded 2-core machine can take ~3 s
DEBUG_ENV = {"HP_DEBUG": "collectives", "HP_TIMEOUT_S": str(TIMEOUT_S)}


@shared_launch.once
def _launch(backend: str) -> tuple:
    """(the launch's failure text, which the idle case ends it with; per-rank results of the
    other cases)."""
    with tempfile.TemporaryDirectory(prefix="hp-desync-") as results_dir:
        with pytest.raises(RankFailure) as failed:
            run_ranks("tests.desync_scenarios:run_all", 2, backend, results_dir, timeout_s=200,
                      env=DEBUG_ENV)
        per_rank = []
        for rank in range(2):
            path = Path(results_dir) / f"rank{rank}.pkl"
            assert path.exists(), f"rank {rank} failed before the idle case:\n{failed.value}"
            per_rank.append(pickle.loads(path.read_bytes()))
    return str(failed.value), per_rank


def _raised_on_every_rank(backend: str, case: str, key: str | None = None) -> list[str]:
    """Each rank's CollectiveDesyncError message of ``case``."""
    messages = []
    for rank, results in enumerate(_launch(backend)[1]):
        raised = results[case] if key is None else results[case][key]
        assert raised is not None, f"rank {rank} did not raise in case {case!r}"
        assert raised["type"] == "CollectiveDesyncError", (rank, raised)
        messages.append(raised["message"])
    return messages


def _assert_names_both_ranks_of_the_skip(text: str) -> None:
    assert ("unit 'blocks.1''s forward ran on rank 0 but rank 1 issued all_gather of unit "
            "'blocks.2' in forward") in text, text
    for rank, last in ((0, "blocks.1"), (1, "blocks.2")):
        assert re.search(rf"rank {rank}, its collective #\d+: all_gather of unit 'blocks.2' in "
                         rf"forward \(.*\), after 3 unit forward\(s\) this iteration, the last "
                         rf"'{last}'", text), text


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_skipping_a_unit_raises_naming_both_ranks(backend):
    """Rank 1 skips block 1 in step 1 (the forward prefetch is on by then): both ranks raise
    at the next all-gather, with both versions in the message."""
    for text in _raised_on_every_rank(backend, "skipping"):
        _assert_names_both_ranks_of_the_skip(text)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_debug_collectives_argument_detects_a_skip_without_hp_debug(backend):
    """Without HP_DEBUG the check is off; init_distributed(debug_collectives=True) installs
    it, and the same skip raises the same error on both ranks."""
    for rank, results in enumerate(_launch(backend)[1]):
        assert results["argument"]["off_without"], f"rank {rank}: check on without HP_DEBUG"
        assert results["argument"]["on_with"], f"rank {rank}: debug_collectives=True ignored"
    for text in _raised_on_every_rank(backend, "argument", "skipping"):
        _assert_names_both_ranks_of_the_skip(text)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_running_one_step_more_meets_the_final_barrier(backend):
    """Rank 1 starts a step its peer never runs; the peer's destroy_distributed cross-checks
    its final barrier, so both raise instead of hanging."""
    for text in _raised_on_every_rank(backend, "extra_step"):
        assert ("unit 'root''s forward ran on rank 1 but rank 0 issued destroy_distributed's "
                "final barrier") in text, text


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_whose_peers_stay_idle_names_the_cross_checked_collective(backend):
    """Rank 1 starts a step while rank 0 stays idle: rank 1's watchdog (or gloo's own
    timeout, which the check turns into the same description) names what it cross-checked."""
    text = _launch(backend)[0]
    assert "rank 1 failed" in text, text[-3000:]
    assert re.search(r"rank 1 of 2: the cross-check \(HP_DEBUG=collectives\) of all_gather of "
                     r"unit 'root' in forward over the 'shard' mesh dimension's group (did not "
                     rf"finish within {TIMEOUT_S} s|failed)", text), text[-3000:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_under_the_check_matches_the_reference(backend):
    """Every collective is cross-checked, its exchange is not counted as traffic, and the
    training matches the single-process reference."""
    per_rank = [results["parity"] for results in _launch(backend)[1]]
    mean_losses = np.mean([r["losses"] for r in per_rank], axis=0)
    assert_close(mean_losses, per_rank[0]["ref_losses"], FP32_RTOL)
    for r in per_rank:
        assert r["param_diff"] <= FP32_RTOL
        assert r["checked"] == r["issued"] > 0


def test_an_unknown_debug_flag_is_refused_before_joining():
    code = ("import hyper_parallel as hp\n"
            "try:\n    hp.init_distributed()\nexcept ValueError as e:\n    print(e)\n"
            "print(hp.get_platform().is_initialized())\n")
    env = {**os.environ, "HP_BACKEND": "torch", "HP_DEBUG": "collective",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "HP_DEBUG lists ['collective']" in done.stdout and "valid" in done.stdout
    assert done.stdout.strip().endswith("False"), done.stdout
