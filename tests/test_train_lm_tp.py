"""examples/train_lm.py under tensor parallelism (``--tp``): the Megatron plan of the
example model trains what the model trains in one process, on both frameworks, and its
checkpoints resume.

Design note
-----------
Every run is the example's own command line (tests/test_train_lm.py's pattern: tiny size,
hp-run's ``--timeout``), ``STEPS`` AdamW steps. Runs, one launch per layout:

- the one-process references, torch and MindSpore (``--nproc 1``);
- MindSpore at tp2 (2 ranks, fully_shard over a 1-rank data-parallel mesh): steps 1-K,
  a checkpoint, and steps K+1.. resumed from it in a second launch, so the five losses
  check the training and the resume at once;
- MindSpore at dp2 x tp2 (4 ranks; ``-m slow``: the tp2 run covers the tensor-parallel
  path and tests/test_core_tp_fully_shard.py the same composition at 4 ranks);
- torch at dp2 x tp2 (torch's own tensor parallelism under hp.fully_shard).

MindSpore's tensor-parallel losses must equal its one-process losses to 1e-5 relative;
torch's tensor-parallel run must agree with MindSpore's to what the two frameworks'
one-process references agree to (twice their largest relative difference, as
tests/test_train_lm.py: each side adds its own rounding).
"""

import subprocess
import sys

import numpy as np
import pytest

from tests.multirank import REPO_ROOT
from tests.test_train_lm import _losses, _rel, _train

pytest.importorskip("torch")
pytest.importorskip("mindspore")

STEPS, K = 5, 3  # steps in all; the tp2 run checkpoints after K and resumes
PARITY = 1e-5    # relative, MindSpore's tensor-parallel losses against one process


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("train_lm_tp")


@pytest.fixture(scope="module")
def references(root):
    return {backend: _train(root / f"{backend}_1", backend, "--nproc", "1", "--steps", str(STEPS))
            for backend in ("torch", "mindspore")}


@pytest.fixture(scope="module")
def mindspore_tp2(root):
    first = _train(root / "ms_tp2", "mindspore", "--nproc", "2", "--tp", "2", "--steps", str(K),
                   "--ckpt-every", str(K))
    resumed = _train(root / "ms_tp2_resumed", "mindspore", "--nproc", "2", "--tp", "2",
                     "--steps", str(STEPS), "--resume", str(root / "ms_tp2" / f"step-{K:05d}"))
    return first, resumed


@pytest.fixture(scope="module")
def torch_dp2_tp2(root):
    return _train(root / "torch_dp2_tp2", "torch", "--nproc", "4", "--tp", "2",
                  "--steps", str(STEPS))


def _agreement(references) -> float:
    return _rel(_losses(references["mindspore"]), _losses(references["torch"]))


def test_mindspore_tp2_trains_as_one_process_and_resumes(references, mindspore_tp2):
    (first, first_out), (resumed, resumed_out) = mindspore_tp2
    assert "FSDP 1 x TP 2" in first_out
    assert f"resumed at step {K}" in resumed_out
    history = resumed["history"]
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    assert history[:K] == first["history"], "the checkpoint did not keep the run's history"
    reference = _losses(references["mindspore"])
    diff = _rel(_losses(mindspore_tp2[1]), reference)
    assert diff <= PARITY, (f"MindSpore tp2 losses {_losses(mindspore_tp2[1])} vs one process "
                            f"{reference}: {diff:.2e} relative")
    validation = resumed["validation"][-1]["loss"]
    reference_validation = references["mindspore"][0]["validation"][-1]["loss"]
    assert abs(validation - reference_validation) <= PARITY * abs(reference_validation)


@pytest.mark.slow
def test_mindspore_dp2_tp2_trains_as_one_process(references, root):
    run, out = _train(root / "ms_dp2_tp2", "mindspore", "--nproc", "4", "--tp", "2",
                      "--steps", str(STEPS))
    assert "FSDP 2 x TP 2" in out
    reference = _losses(references["mindspore"])
    diff = _rel(_losses(run), reference)
    assert diff <= PARITY, f"MindSpore dp2 x tp2 {_losses(run)} vs one process {reference}: {diff:.2e}"


def test_torch_tp_agrees_with_mindspore_tp(references, mindspore_tp2, torch_dp2_tp2):
    torch_tp, mindspore_tp = _losses(torch_dp2_tp2), _losses(mindspore_tp2[1])
    assert "FSDP 2 x TP 2" in torch_dp2_tp2[1]
    assert _rel(torch_tp, _losses(references["torch"])) <= PARITY
    tolerance = 2 * _agreement(references)
    diff = _rel(torch_tp, mindspore_tp)
    assert diff <= tolerance, (f"torch dp2 x tp2 {torch_tp} vs MindSpore tp2 {mindspore_tp}: "
                               f"{diff:.2e} relative, more than the one-process references' "
                               f"agreement x2 ({tolerance:.2e})")


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "2", "--tp", "3"], "--tp 3 must divide --nproc 2"),
    (["--nproc", "4", "--tp", "4"], "size tiny's kv heads (2) does not divide over --tp 4"),
    (["--nproc", "4", "--tp", "2", "--mesh", "2x2"], "--mesh 2x2 x --tp 2 has 8 ranks"),
])
def test_bad_tensor_parallel_options_are_refused_before_anything_runs(tmp_path, argv, message):
    out = tmp_path / "out"
    command = [sys.executable, str(REPO_ROOT / "examples" / "train_lm.py"), "--backend", "torch",
               "--size", "tiny", "--out", str(out), *argv]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert not out.exists(), "a refused run wrote output"
