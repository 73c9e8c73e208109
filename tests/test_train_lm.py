"""examples/train_lm.py end to end, and its cross-framework story: a run started on one
framework and resumed from its checkpoint on the other continues the uninterrupted run.

Design note
-----------
Every run is the example's own command line (tiny size, a few steps), launched by hp-run
with its ``--timeout``, which ends the ranks by pid well before the subprocess limit. Runs:

- torch and MindSpore uninterrupted, 2 ranks, FSDP, ``2K`` steps, a checkpoint at step K;
- MindSpore at 1 rank resumed from torch's checkpoint, K more steps;
- torch on an HSDP 2x1 mesh resumed from MindSpore's checkpoint, K more steps;
- torch with eager init, K steps (the deferred init gives the same values).

The resumed curve must continue the uninterrupted one of the framework that wrote the
checkpoint to what the two frameworks' own uninterrupted runs agree to (twice the largest
relative difference between their curves, as tests/test_checkpoint.py), since after the
load the other framework's arithmetic runs the steps.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.multirank import REPO_ROOT

pytest.importorskip("torch")
pytest.importorskip("mindspore")

K = 3  # steps before the checkpoint, and after it
COMMON = ["--size", "tiny", "--batch", "4", "--seq", "32", "--eval-batches", "1"]


def _train(out, backend, *extra, timeout_s: float = 240):
    """``timeout_s``: hp-run's limit on the job (the subprocess's is a minute more)."""
    command = [sys.executable, str(REPO_ROOT / "examples" / "train_lm.py"), "--backend", backend,
               "--out", str(out), "--timeout", str(timeout_s), *COMMON, *extra]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=timeout_s + 60)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    with open(out / "metrics.json") as file:
        return json.load(file), result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_lm")
    out = {}
    for backend in ("torch", "mindspore"):
        out[backend] = _train(root / backend, backend, "--nproc", "2", "--steps", str(2 * K),
                              "--ckpt-every", str(K), "--keep", "2")
    checkpoint = f"step-{K:05d}"
    out["torch_then_mindspore"] = _train(
        root / "t2m", "mindspore", "--nproc", "1", "--steps", str(2 * K),
        "--resume", str(root / "torch" / checkpoint))
    out["mindspore_then_torch"] = _train(
        root / "m2t", "torch", "--nproc", "2", "--mesh", "2x1", "--steps", str(2 * K),
        "--resume", str(root / "mindspore" / checkpoint))
    out["torch_eager"] = _train(root / "eager", "torch", "--nproc", "2", "--steps", str(K),
                                "--eager-init")
    out["root"] = root
    return out


def _losses(run) -> np.ndarray:
    return np.array([r["loss"] for r in run[0]["history"]])


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b) / np.abs(b)))


def _tolerance(runs) -> float:
    return 2 * _rel(_losses(runs["mindspore"]), _losses(runs["torch"]))


def test_uninterrupted_runs_train_and_report(runs):
    for backend in ("torch", "mindspore"):
        metrics, stdout = runs[backend]
        history = metrics["history"]
        assert [r["step"] for r in history] == list(range(1, 2 * K + 1))
        assert {r["backend"] for r in history} == {backend}
        assert history[-1]["loss"] < history[0]["loss"], "the loss did not go down"
        assert [v["step"] for v in metrics["validation"]] == [K, 2 * K]
        assert all(np.isfinite(r["grad_norm"]) and r["tokens_per_s"] > 0 for r in history)
        assert stdout.count("tok/s") == 2 * K, "one progress line per step"
        assert (runs["root"] / backend / "loss.png").stat().st_size > 0
        saved = sorted(p.name for p in (runs["root"] / backend).glob("step-*"))
        assert saved == [f"step-{K:05d}", f"step-{2 * K:05d}"]


@pytest.mark.parametrize("crossing, writer", [("torch_then_mindspore", "torch"),
                                              ("mindspore_then_torch", "mindspore")])
def test_resumed_on_the_other_framework_continues_the_run(runs, crossing, writer):
    resumed, uninterrupted = _losses(runs[crossing]), _losses(runs[writer])
    history = runs[crossing][0]["history"]
    reader = "mindspore" if writer == "torch" else "torch"
    assert [r["backend"] for r in history] == [writer] * K + [reader] * K
    assert np.array_equal(resumed[:K], uninterrupted[:K]), "the saved history was not kept"
    tolerance = _tolerance(runs)
    diff = _rel(resumed[K:], uninterrupted[K:])
    assert diff <= tolerance, (f"{crossing}: resumed losses {resumed[K:]} differ from the "
                               f"uninterrupted {uninterrupted[K:]} by {diff:.2e} (relative), "
                               f"more than the frameworks' own agreement x2 ({tolerance:.2e})")


def test_deferred_and_eager_init_give_the_same_model(runs):
    eager, deferred = _losses(runs["torch_eager"]), _losses(runs["torch"])[:K]
    assert _rel(eager, deferred) <= 1e-6, f"eager {eager} vs deferred {deferred}"


def test_resume_with_other_batches_is_refused(runs, tmp_path):
    command = [sys.executable, str(REPO_ROOT / "examples" / "train_lm.py"), "--backend", "torch",
               "--nproc", "1", "--out", str(tmp_path), "--timeout", "120", "--size", "tiny",
               "--batch", "2", "--seq", "32", "--steps", str(2 * K),
               "--resume", str(runs["root"] / "torch" / f"step-{K:05d}")]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    assert "it was trained with --batch 4, this run has 2" in result.stdout + result.stderr
