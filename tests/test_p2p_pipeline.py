"""A hand-written two-stage pipeline (point-to-point send/recv between the stages,
micro-batches, fully_shard inside each stage) against the same model in one process.

The rank side, and the pipeline itself, are in tests/p2p_pipeline_scenarios.py: 4 ranks,
(pp 2, dp 2), 3 SGD steps of 4 micro-batches, in the suite's shared 4-rank launch. Checked:
the mean of the last stage's losses and every stage's gathered parameters against the
reference (tests/tolerance.py), and the reduce-scatters of each step: one per unit when
only the last backward syncs, one per unit and micro-batch when every backward does.

MindSpore runs "accumulate" by default; its "sync_every" and the overlapped gradient
pipeline (``HP_SYNC_COLLECTIVES=0``, what Ascend runs) are under ``-m slow``: 4 MindSpore
ranks on 2 shared cores took 13-20 s a run, and "accumulate" covers the MindSpore path they add to
(torch's default run covers "sync_every"'s counts).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.p2p_pipeline_scenarios import MICRO_BATCHES, STEPS
from tests.tolerance import FP32_RTOL, assert_close

WORLD = 4
DEFAULT = {"torch": ("accumulate", "sync_every"), "mindspore": ("accumulate",)}
OVERLAPPED = "overlapped_"  # name prefix: MindSpore with HP_SYNC_COLLECTIVES=0

shared_launch.register(__name__, "p2p_pipeline", WORLD, "tests.p2p_pipeline_scenarios:run_configs",
                       lambda backend: (list(DEFAULT[backend]),), timeout_s=300)
shared_launch.register(__name__, "p2p_pipeline_slow", WORLD,
                       "tests.p2p_pipeline_scenarios:run_configs",
                       lambda backend: (["sync_every"],), backends=("mindspore",),
                       timeout_s=300, slow=True)
shared_launch.register(__name__, "p2p_pipeline_overlapped", WORLD,
                       "tests.p2p_pipeline_scenarios:run_configs",
                       lambda backend: (["accumulate", "sync_every"],), backends=("mindspore",),
                       env={"HP_SYNC_COLLECTIVES": "0"}, timeout_s=300, slow=True)


def _cases():
    for backend in ("torch", "mindspore"):
        for name in ("accumulate", "sync_every"):
            slow = name not in DEFAULT[backend]
            yield pytest.param(backend, name, marks=[pytest.mark.slow] if slow else [])
    for name in ("accumulate", "sync_every"):
        yield pytest.param("mindspore", OVERLAPPED + name, marks=[pytest.mark.slow])


def _per_rank(backend: str, case: str) -> list:
    if case.startswith(OVERLAPPED):
        key, name = "p2p_pipeline_overlapped", case.removeprefix(OVERLAPPED)
    else:
        key, name = "p2p_pipeline" + ("" if case in DEFAULT[backend] else "_slow"), case
    return [r[name] for r in shared_launch.results(key, backend)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend,case", list(_cases()))
def test_pipeline_matches_single_process(backend, case):
    per_rank = _per_rank(backend, case)
    assert [r["stage"] for r in per_rank] == [0, 0, 1, 1]
    last_stage = [r for r in per_rank if r["stage"] == 1]
    # each last-stage rank's loss is its half of the batch: their mean is the batch's loss
    mean_losses = np.mean([r["losses"] for r in last_stage], axis=0)
    assert len(mean_losses) == STEPS >= 3
    assert_close(mean_losses, per_rank[0]["ref_losses"], FP32_RTOL)
    for rank, r in enumerate(per_rank):
        assert r["names_match"], f"rank {rank}: gathered names differ from the reference's"
        assert r["param_diff"] <= FP32_RTOL, \
            f"rank {rank} (stage {r['stage']}): parameters differ by {r['param_diff']}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend,case", list(_cases()))
def test_reduce_scatters_per_step(backend, case):
    """Accumulating: one reduce-scatter per unit per step, however many micro-batches;
    syncing every backward: one per unit per micro-batch."""
    per_micro_batch = case.endswith("sync_every")
    for rank, r in enumerate(_per_rank(backend, case)):
        assert r["units"] >= 2, f"rank {rank}: a stage should have nested units"
        expected = r["units"] * (MICRO_BATCHES if per_micro_batch else 1)
        assert r["reduce_scatters"] == [expected] * STEPS, \
            f"rank {rank} (stage {r['stage']}): reduce-scatters per step {r['reduce_scatters']}, " \
            f"expected {expected} ({r['units']} units)"
