"""Desync detection (HP_DEBUG=collectives): ranks that disagree about what to run raise a
clear error instead of hanging or reducing mismatched tensors, and a run whose ranks agree
trains exactly as without the check.

Two ranks per launch (tests/desync_scenarios.py); a short collective timeout bounds the case
where a rank's peers issue nothing more.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.multirank import REPO_ROOT, RankFailure, run_ranks

BACKENDS = ["torch", "mindspore"]
TIMEOUT_S = 8  # MindSpore's first collective on a loaded 2-core machine can take ~3 s
DEBUG_ENV = {"HP_DEBUG": "collectives", "HP_TIMEOUT_S": str(TIMEOUT_S)}
ATOL = 1e-5


def _failure(backend: str, target: str, *args) -> str:
    with pytest.raises(RankFailure) as failed:
        run_ranks(f"tests.desync_scenarios:{target}", 2, backend, *args, timeout_s=90,
                  env=DEBUG_ENV)
    return str(failed.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_skipping_a_unit_raises_naming_both_ranks(backend):
    """Rank 1 skips block 1 in step 1 (the forward prefetch is on by then): both ranks raise
    at the next all-gather, with both versions in the message."""
    text = _failure(backend, "run_skipping", 1, 1)
    assert "CollectiveDesyncError" in text, text[-3000:]
    assert ("unit 'blocks.1''s forward ran on rank 0 but rank 1 issued all_gather of unit "
            "'blocks.2' in forward") in text, text[-3000:]
    for rank, last in ((0, "blocks.1"), (1, "blocks.2")):
        assert re.search(rf"rank {rank}, its collective #\d+: all_gather of unit 'blocks.2' in "
                         rf"forward \(.*\), after 3 unit forward\(s\) this iteration, the last "
                         rf"'{last}'", text), text[-3000:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_running_one_step_more_meets_the_final_barrier(backend):
    """Rank 1 starts a step its peer never runs; the peer's destroy_distributed cross-checks
    its final barrier, so both raise instead of hanging."""
    text = _failure(backend, "run_extra_step", 1, "leave")
    assert ("unit 'root''s forward ran on rank 1 but rank 0 issued destroy_distributed's "
            "final barrier") in text, text[-3000:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_whose_peers_stay_idle_names_the_cross_checked_collective(backend):
    """Rank 1 starts a step while rank 0 stays idle: rank 1's watchdog (or gloo's own
    timeout, which the check turns into the same description) names what it cross-checked."""
    text = _failure(backend, "run_extra_step", 1, "idle")
    assert re.search(r"rank 1 of 2: the cross-check \(HP_DEBUG=collectives\) of all_gather of "
                     r"unit 'root' in forward over the 'shard' mesh dimension's group (did not "
                     rf"finish within {TIMEOUT_S} s|failed)", text), text[-3000:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_under_the_check_matches_the_reference(backend):
    """Every collective is cross-checked, its exchange is not counted as traffic, and the
    training matches the single-process reference."""
    per_rank = run_ranks("tests.desync_scenarios:run_parity", 2, backend, timeout_s=200,
                         env=DEBUG_ENV)
    mean_losses = np.mean([r["losses"] for r in per_rank], axis=0)
    np.testing.assert_allclose(mean_losses, per_rank[0]["ref_losses"], atol=ATOL, rtol=0)
    for r in per_rank:
        assert r["param_diff"] <= ATOL
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
