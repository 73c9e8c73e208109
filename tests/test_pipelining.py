"""hp.pipelining (PipelineStage, ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B) on
both frameworks, against the same model trained whole in one process.

Rank side: tests/pipelining_scenarios.py. One shared 2-rank launch per backend (pp 2, plain
stages: GPipe and 1F1B over two stages, interleaved 1F1B over four, two per rank, and a
shape mismatch between the stages) and one 4-rank launch (pp 2 x dp 2, every block and
stage a unit over ``mesh["dp"]``). Checked: the mean of the last
stage's per-micro-batch losses of each step and every stage's parameters after 3 SGD steps
against the reference (tests/tolerance.py), and at dp 2 one reduce-scatter per unit per
step under every schedule (the schedule syncs gradients in each step's last backward only).
Bad arguments fail before anything runs, in the test process, on a one-rank mesh without
groups.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.pipelining_scenarios import MICRO_BATCHES, STEPS
from tests.tolerance import FP32_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
TWO = ["gpipe", "1f1b", "interleaved", "bad_shapes"]
FOUR = ["gpipe", "1f1b", "interleaved"]
#: at dp 2, what the default run trains (MindSpore's GPipe and interleaved 1F1B at dp 2
#: under ``-m slow``: its 2-rank schedules and 4-rank 1F1B cover the paths they take)
FOUR_DEFAULT = {"torch": FOUR, "mindspore": ["1f1b"]}

shared_launch.register(__name__, "pipelining", 2, "tests.pipelining_scenarios:run_cases",
                       lambda backend: (TWO,), timeout_s=300)
shared_launch.register(__name__, "pipelining_dp", 4, "tests.pipelining_scenarios:run_cases",
                       lambda backend: (FOUR_DEFAULT[backend], 2), timeout_s=400)
shared_launch.register(__name__, "pipelining_dp_slow", 4, "tests.pipelining_scenarios:run_cases",
                       lambda backend: (["gpipe", "interleaved"], 2), backends=("mindspore",),
                       timeout_s=600,
                       slow=True)
# the overlapped gradient pipeline (what Ascend runs) under the schedules
shared_launch.register(__name__, "pipelining_dp_overlapped", 4,
                       "tests.pipelining_scenarios:run_cases", lambda backend: (FOUR, 2),
                       backends=("mindspore",), env={"HP_SYNC_COLLECTIVES": "0"},
                       timeout_s=600, slow=True)


def _per_rank(key: str, backend: str, case: str) -> list:
    return [r[case] for r in shared_launch.results(key, backend)]


def _check_parity(per_rank: list, world: int) -> None:
    dp = world // 2
    assert [r["pp_rank"] for r in per_rank] == [0] * dp + [1] * dp
    last = [r for r in per_rank if r["pp_rank"] == 1]
    # each last-stage rank's losses are its share of the batch: their mean is the batch's
    mean_losses = np.mean([r["losses"] for r in last], axis=0)
    assert len(mean_losses) == STEPS >= 3
    assert_close(mean_losses, per_rank[0]["ref_losses"], FP32_RTOL)
    for rank, r in enumerate(per_rank):
        assert r["names_match"], f"rank {rank}: parameter names differ from the reference's"
        assert r["param_diff"] <= FP32_RTOL, \
            f"rank {rank} (pp rank {r['pp_rank']}): parameters differ by {r['param_diff']}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_match_single_process(backend, schedule):
    """pp 2: two stages, or four (two per rank) under the interleaved schedule."""
    _check_parity(_per_rank("pipelining", backend, schedule), 2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_micro_batches_alive_per_stage(backend):
    """Micro-batches whose backward is pending on a stage at once (their activations, or
    on MindSpore their recomputed forwards' inputs, are alive): GPipe all of them, 1F1B
    at most ``num_stages - stage`` (torch's warm-up)."""
    for schedule, expected in (("gpipe", {0: MICRO_BATCHES, 1: MICRO_BATCHES}),
                               ("1f1b", {0: 2, 1: 1})):
        for r in _per_rank("pipelining", backend, schedule):
            assert r["peak_pending"] == {r["pp_rank"]: expected[r["pp_rank"]]}, \
                f"{schedule}, pp rank {r['pp_rank']}: {r['peak_pending']}"


def _four_cases():
    for backend in BACKENDS:
        for schedule in FOUR:
            slow = schedule not in FOUR_DEFAULT[backend]
            yield pytest.param(backend, schedule, "", marks=[pytest.mark.slow] if slow else [])
    for schedule in FOUR:
        yield pytest.param("mindspore", schedule, "overlapped", marks=[pytest.mark.slow])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend,schedule,variant", list(_four_cases()))
def test_units_inside_stages_match_and_reduce_once_per_step(backend, schedule, variant):
    if variant:
        key = "pipelining_dp_overlapped"
    else:
        key = "pipelining_dp" + ("" if schedule in FOUR_DEFAULT[backend] else "_slow")
    per_rank = _per_rank(key, backend, schedule)
    _check_parity(per_rank, 4)
    for rank, r in enumerate(per_rank):
        assert r["units"] >= 2, f"rank {rank}: a stage should hold nested units"
        assert r["reduce_scatters"] == [r["units"]] * STEPS, \
            f"rank {rank} (pp rank {r['pp_rank']}): reduce-scatters per step " \
            f"{r['reduce_scatters']}, expected one per unit ({r['units']})"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shape_mismatch_is_named_on_both_ranks(backend):
    messages = _per_rank("pipelining", backend, "bad_shapes")
    for rank, message in enumerate(messages):
        assert "shape mismatch between pipeline stages 0 and 1" in message, \
            f"rank {rank}: {message}"
        assert "[4, 16]" in message and "[4, 19]" in message, f"rank {rank}: {message}"


def _one_rank(monkeypatch, backend):
    monkeypatch.setenv("HP_BACKEND", backend)
    import hyper_parallel as hp
    from tests.kit import get_kit
    from tests.pipelining_scenarios import _stages

    kit = get_kit()
    module = _stages(kit)[0]
    mesh = hp.DeviceMesh("cpu", (1,), ("pp",), [None])  # one rank: no group, no collective
    return hp, kit, module, mesh


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_are_named_before_anything_runs(monkeypatch, backend):
    hp, kit, module, mesh = _one_rank(monkeypatch, backend)
    before = [kit.to_numpy(p).copy() for p in kit.params(module)]
    pipelining = hp.pipelining
    with pytest.raises(ValueError, match="dw_builder"):
        pipelining.PipelineStage(module, 0, 1, "cpu", group=mesh, dw_builder=object())
    with pytest.raises(ValueError, match=r"stage_index 2 is not in \[0, 2\)"):
        pipelining.PipelineStage(module, 2, 2, "cpu", group=mesh)
    two = pipelining.PipelineStage(module, 0, 2, "cpu", group=mesh)
    with pytest.raises(ValueError, match="2 stages on a pp mesh of 1 ranks"):
        pipelining.ScheduleGPipe(two, 2)
    stage = pipelining.PipelineStage(module, 0, 1, "cpu", group=mesh)
    with pytest.raises(ValueError, match="pass loss_fn"):
        pipelining.Schedule1F1B(stage, 2)
    sched = pipelining.ScheduleGPipe(stage, 3, loss_fn=lambda out, y: (out - y).sum())
    x = kit.tensor(np.ones((16, 37), np.float32))
    with pytest.raises(ValueError, match="16 rows on dim 0, which n_microbatches=3"):
        sched.step(x, target=x)
    with pytest.raises(ValueError, match="needs the step's target"):
        sched.step(x)
    with pytest.raises(TypeError, match="1-D hp DeviceMesh"):
        pipelining.PipelineStage(module, 0, 1, "cpu", group="pp")
    after = [kit.to_numpy(p) for p in kit.params(module)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
