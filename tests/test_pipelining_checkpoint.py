"""Checkpoints of pipelined runs (``hp.save_checkpoint`` / ``hp.load_checkpoint`` with
``pp_mesh``), on both frameworks, against the whole model trained in one process.

Rank side: tests/pipelining_checkpoint_scenarios.py, a job of the shared 2-rank launch
(pp 2); the interleaved resume a slow job of the same launch. In this process: the pp 2
checkpoint resumed without pipelining, by the framework that wrote it and by the other.
Every resumed run's losses after the save are the uninterrupted reference's
(tests/tolerance.py's AdamW tolerance). Slow: pp 2 x dp 2 x tp 2 checkpoints (8 ranks)
resumed as the other framework's 8-rank run.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests import shared_launch
from tests.multirank import FAST_MINDSPORE, run_ranks
from tests.tolerance import ADAMW_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
TARGET = "tests.pipelining_checkpoint_scenarios:run"


def _directory(backend: str) -> str:
    return shared_launch.directory(f"pp-checkpoint-{backend}")


shared_launch.register(__name__, "pipelining_checkpoint", 2, TARGET,
                       lambda backend: (_directory(backend),), timeout_s=300)
shared_launch.register(__name__, "pipelining_checkpoint_interleaved", 2, TARGET,
                       lambda backend: (_directory(backend), True), timeout_s=400, slow=True)


def _last(per_rank: list, key: str) -> list:
    from tests.pipelining_checkpoint_scenarios import SAVE_AT

    losses = [r[key] for r in per_rank if r[key][-1] is not None]
    assert len(losses) == 1, "one rank holds the last stage"
    return losses[0][SAVE_AT:] if key == "pipelined" else losses[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pp2_saves_and_resumes_from_the_whole_models_checkpoint(backend):
    """The pp 2 run trains on after its save as without it; a pp 2 run of another model
    loads the whole model's checkpoint and continues as the reference does."""
    from tests.pipelining_checkpoint_scenarios import SAVE_AT

    per_rank = shared_launch.results("pipelining_checkpoint", backend)
    reference = per_rank[0]["ref_losses"]
    assert_close(_last(per_rank, "pipelined"), reference[SAVE_AT:], ADAMW_RTOL)
    assert_close(_last(per_rank, "from_whole"), reference[SAVE_AT:], ADAMW_RTOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stage_errors_are_named_on_every_rank(backend):
    per_rank = shared_launch.results("pipelining_checkpoint", backend)
    for rank, r in enumerate(per_rank):
        assert "no rank loads head.weight" in r["uncovered"], f"rank {rank}: {r['uncovered']}"
        assert r["unchanged"], f"rank {rank}: a refused load changed the stage"
        assert "pipeline stages given pp_mesh" in r["save_without_pp_mesh"], \
            f"rank {rank}: {r['save_without_pp_mesh']}"
        assert "pass pp_mesh=mesh['pp']" in r["load_without_pp_mesh"], \
            f"rank {rank}: {r['load_without_pp_mesh']}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("writer,reader", [(w, r) for w in BACKENDS for r in BACKENDS])
def test_pp2_checkpoint_resumes_in_one_process(monkeypatch, writer, reader):
    """``writer``'s pp 2 checkpoint loaded into the whole model and its optimizer by
    ``reader`` in this process: its next losses are ``reader``'s uninterrupted run's."""
    from tests.pipelining_checkpoint_scenarios import SAVE_AT

    written = shared_launch.results("pipelining_checkpoint", writer)
    reference = shared_launch.results("pipelining_checkpoint", reader)[0]["ref_losses"]
    monkeypatch.setenv("HP_BACKEND", reader)
    from tests.pipelining_checkpoint_scenarios import resume_whole

    assert written  # the job ended on every rank: its checkpoint is published
    assert_close(resume_whole(_directory(writer)), reference[SAVE_AT:], ADAMW_RTOL)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pp2_checkpoint_resumes_interleaved(backend):
    """The pp 2 (1F1B) checkpoint loaded into four stages, two per rank (a list of model
    parts, one optimizer each), trained on under ``ScheduleInterleaved1F1B``."""
    from tests.pipelining_checkpoint_scenarios import SAVE_AT

    shared_launch.results("pipelining_checkpoint", backend)  # wrote the checkpoint
    per_rank = shared_launch.results("pipelining_checkpoint_interleaved", backend)
    reference = per_rank[0]["ref_losses"]
    assert_close(_last(per_rank, "interleaved"), reference[SAVE_AT:], ADAMW_RTOL)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("saver,resumer", [("torch", "mindspore"), ("mindspore", "torch")])
def test_pp2_checkpoint_resumes_at_pp2_on_the_other_framework(saver, resumer):
    """``saver``'s pp 2 checkpoint (its shared launch's) resumed by a pp 2 run of
    ``resumer`` in a launch of its own, started after the saver's job ended."""
    from tests.pipelining_checkpoint_scenarios import SAVE_AT

    shared_launch.results("pipelining_checkpoint", saver)
    per_rank = run_ranks("tests.pipelining_checkpoint_scenarios:resume_pp2", 2, resumer,
                         _directory(saver), timeout_s=600,
                         env=FAST_MINDSPORE)
    assert_close(_last(per_rank, "crossed"), per_rank[0]["ref_losses"][SAVE_AT:], ADAMW_RTOL)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_process_checkpoint_resumes_at_pp2(monkeypatch, backend, tmp_path):
    """The whole model trained and saved in this process, resumed by a pp 2 run."""
    from tests.pipelining_checkpoint_scenarios import SAVE_AT

    monkeypatch.setenv("HP_BACKEND", backend)
    from tests.pipelining_checkpoint_scenarios import save_whole

    save_whole(str(tmp_path))
    per_rank = run_ranks("tests.pipelining_checkpoint_scenarios:resume_pp2", 2, backend,
                         str(tmp_path), timeout_s=600, env=FAST_MINDSPORE)
    assert_close(_last(per_rank, "crossed"), per_rank[0]["ref_losses"][SAVE_AT:], ADAMW_RTOL)


# pp 2 x dp 2 x tp 2 (tests/pipelining_3d_scenarios.py): torch saves, MindSpore resumes it
# and saves its own, torch resumes that; three 8-rank launches in this order
THREE_D = "tests.pipelining_3d_scenarios:run"


def _three_d(backend: str, *calls) -> list:
    return run_ranks("tests.shared_launch:run_jobs", 8, backend,
                     [(name, THREE_D, args, {}) for name, args in calls], timeout_s=900,
                     env=FAST_MINDSPORE)


def _three_d_dir(backend: str) -> str:
    return os.path.join(shared_launch.directory("pp-checkpoint-3d"), backend)


@shared_launch.once
def _torch_saves() -> list:
    return _three_d("torch", ("save", ("torch", 2, False, _three_d_dir("torch"))))


@shared_launch.once
def _mindspore_crosses() -> list:
    _torch_saves()
    return _three_d("mindspore", ("save", ("mindspore", 2, False, _three_d_dir("mindspore"))),
                    ("resume", ("mindspore", 2, False, None, _three_d_dir("torch"))))


@shared_launch.once
def _torch_resumes() -> list:
    _mindspore_crosses()
    return _three_d("torch", ("resume", ("torch", 2, False, None, _three_d_dir("mindspore"))))


@pytest.mark.slow
@pytest.mark.timeout(2700)
@pytest.mark.parametrize("saver,resumer", [("torch", "mindspore"), ("mindspore", "torch")])
def test_three_d_checkpoint_resumes_on_the_other_framework(saver, resumer):
    """``saver``'s pp 2 x dp 2 x tp 2 run saves after 2 steps (each stage's units and
    tensor-parallel blocks); ``resumer``'s pp 2 x dp 2 x tp 2 run of a model built with
    other values loads it and trains on: its losses are its own uninterrupted
    reference's."""
    from tests.pipelining_3d_scenarios import SAVE_AT

    per_rank = [r["resume"] for r in
                (_mindspore_crosses() if resumer == "mindspore" else _torch_resumes())]
    losses = np.mean([r["losses"] for r in per_rank if r["pp_rank"] == 1], axis=0)
    assert_close(losses, per_rank[0]["ref_losses"][SAVE_AT:], ADAMW_RTOL)
    for rank, r in enumerate(per_rank):
        assert r["param_rel_diff"] <= ADAMW_RTOL, \
            f"rank {rank}: parameters differ by {r['param_rel_diff']} relative"
