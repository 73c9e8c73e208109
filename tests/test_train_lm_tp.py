"""examples/train_lm.py under tensor parallelism (``--tp``): the Megatron plan of the
example model trains what the model trains in one process, on both frameworks, and its
checkpoints resume.

Design note
-----------
Every run is the example's own command line (tests/test_train_lm.py's pattern: tiny size,
hp-run's ``--timeout``), ``STEPS`` AdamW steps, one launch per layout:

- the one-process references, torch and MindSpore (``--nproc 1``, tests/conftest.py's
  ``train_lm_references``, shared with tests/test_train_lm_cp.py and test_train_lm_pp.py);
- MindSpore at tp2 (2 ranks, fully_shard over a 1-rank data-parallel mesh) and torch at
  dp2 x tp2 (torch's own tensor parallelism under hp.fully_shard), each with a checkpoint
  after step K;
- under ``-m slow``: MindSpore at dp2 x tp2 (4 ranks; tests/test_core_tp_fully_shard.py
  covers that composition in the default run), and each framework's run resumed from its
  step-K checkpoint in the same layout (in the default run tests/test_core_tp_fully_shard.py
  round-trips MindSpore's tensor-parallel checkpoints bitwise, tests/test_tensor_parallel.py
  torch's);
- under ``-m slow``, on both frameworks: tp2 with float16 parameters (``--dtype fp16``,
  2 ranks; in the default run tests/test_core_tp_fully_shard.py's mixed-precision case
  trains the core's tensor parallelism under fully_shard in float16 on MindSpore, in
  bfloat16 on torch), and HSDP x TP (``--mesh 2x1 --tp 2``, 4 ranks; in the default run
  tests/test_core_tp_hsdp.py trains the same (2, 1, 2) mesh).

MindSpore's tensor-parallel losses must equal its one-process losses to 1e-5 relative;
torch's tensor-parallel run must agree with MindSpore's to what the two frameworks'
one-process references agree to (twice their largest relative difference, as
tests/test_train_lm.py: each side adds its own rounding). A float16 run is held against
the float32 one-process reference to tests/tolerance.py's float16 tolerance (the low
precision's own rounding), and must differ from it (else the policy did not apply).
"""

import subprocess
import sys

import numpy as np
import pytest

from tests.multirank import REPO_ROOT
from tests.test_train_lm import _losses, _rel, _train
from tests.tolerance import LOW_PRECISION_RTOL

pytest.importorskip("torch")
pytest.importorskip("mindspore")

STEPS, K = 5, 3  # steps in all (the references' too); the tp2 run checkpoints after K and resumes
PARITY = 1e-5    # relative, MindSpore's tensor-parallel losses against one process
BACKENDS = ["mindspore", "torch"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("train_lm_tp")


@pytest.fixture(scope="module")
def references(train_lm_references):
    return train_lm_references


@pytest.fixture(scope="module")
def mindspore_tp2(root):
    return _train(root / "ms_tp2", "mindspore", "--nproc", "2", "--tp", "2",
                  "--steps", str(STEPS), "--ckpt-every", str(K),
                  "--export", str(root / "ms_tp2_export"))


@pytest.fixture(scope="module")
def torch_dp2_tp2(root):
    return _train(root / "torch_dp2_tp2", "torch", "--nproc", "4", "--tp", "2",
                  "--steps", str(STEPS), "--ckpt-every", str(K))


def _agreement(references) -> float:
    return _rel(_losses(references["mindspore"]), _losses(references["torch"]))


def _check_resumed(first, resumed) -> None:
    (first, _), (resumed, resumed_out) = first, resumed
    assert f"resumed at step {K}" in resumed_out
    assert [r["step"] for r in resumed["history"]] == list(range(1, STEPS + 1))
    assert resumed["history"][:K] == first["history"], "the checkpoint lost the run's history"


def _check_parity(run, reference, what: str, rtol: float = PARITY) -> float:
    """Losses and the last validation loss of ``run`` within ``rtol`` of ``reference``'s;
    the largest relative difference of the losses."""
    diff = _rel(_losses(run), _losses(reference))
    print(f"{what}: {diff:.2e} relative to one process")
    assert diff <= rtol, (f"{what}: losses {_losses(run)} vs one process "
                          f"{_losses(reference)}: {diff:.2e} relative, more than {rtol:.0e}")
    validation = run[0]["validation"][-1]["loss"]
    expected = reference[0]["validation"][-1]["loss"]
    assert abs(validation - expected) <= rtol * abs(expected), (validation, expected)
    return diff


def test_mindspore_tp2_trains_as_one_process(references, mindspore_tp2, root):
    assert "FSDP 1 x TP 2" in mindspore_tp2[1]
    _check_parity(mindspore_tp2, references["mindspore"], "MindSpore tp2")
    assert (root / "ms_tp2" / f"step-{K:05d}" / "index.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mindspore", "torch"])
def test_a_tensor_parallel_run_resumes_from_its_checkpoint(references, mindspore_tp2,
                                                           torch_dp2_tp2, root, backend):
    run, name, nproc = ((mindspore_tp2, "ms_tp2", "2") if backend == "mindspore"
                        else (torch_dp2_tp2, "torch_dp2_tp2", "4"))
    resumed = _train(root / f"{name}_resumed", backend, "--nproc", nproc, "--tp", "2",
                     "--steps", str(STEPS), "--resume", str(root / name / f"step-{K:05d}"))
    _check_resumed(_first_steps(run), resumed)
    _check_parity(resumed, references[backend], f"{backend} {name} resumed")


def _first_steps(run):
    """``run`` as its first K steps: the history its step-K checkpoint holds."""
    metrics, out = run
    return {**metrics, "history": metrics["history"][:K]}, out


@pytest.mark.slow
def test_mindspore_dp2_tp2_trains_as_one_process(references, root):
    run = _train(root / "ms_dp2_tp2", "mindspore", "--nproc", "4", "--tp", "2",
                 "--steps", str(STEPS))
    assert "FSDP 2 x TP 2" in run[1]
    _check_parity(run, references["mindspore"], "MindSpore dp2 x tp2")


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_tp2_trains_as_one_process_in_float32(references, root, backend):
    """float16 parameters split over 2 ranks, gradients reduced and AdamW stepped in
    float32: within the low precision's own rounding of the float32 one-process run
    (measured 2.8e-5 on MindSpore, 1.6e-5 on torch; the one-process float16 runs are
    2.4e-5 and 2.2e-5 from it)."""
    run = _train(root / f"{backend}_tp2_fp16", backend, "--nproc", "2", "--tp", "2",
                 "--dtype", "fp16", "--steps", str(STEPS))
    assert "FSDP 1 x TP 2" in run[1] and "fp16" in run[1]
    diff = _check_parity(run, references[backend], f"{backend} tp2 float16",
                         rtol=LOW_PRECISION_RTOL["float16"])
    assert diff > 0, "the float16 run is bitwise the float32 run: the policy did not apply"


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_hsdp_times_tp_trains_as_one_process(references, root, backend):
    """``--mesh 2x1 --tp 2``: a (replicate, shard, tp) mesh of 4 ranks (measured within
    9.7e-8 of one process on MindSpore, 9.2e-8 on torch)."""
    run = _train(root / f"{backend}_hsdp_tp2", backend, "--nproc", "4", "--mesh", "2x1",
                 "--tp", "2", "--steps", str(STEPS))
    assert "HSDP 2x1 x TP 2" in run[1]
    _check_parity(run, references[backend], f"{backend} HSDP 2x1 x TP 2")


def test_torch_tp_agrees_with_mindspore_tp(references, mindspore_tp2, torch_dp2_tp2):
    assert "FSDP 2 x TP 2" in torch_dp2_tp2[1]
    _check_parity(torch_dp2_tp2, references["torch"], "torch dp2 x tp2")
    torch_tp, mindspore_tp = _losses(torch_dp2_tp2), _losses(mindspore_tp2)
    tolerance = 2 * _agreement(references)
    diff = _rel(torch_tp, mindspore_tp)
    print(f"torch TP vs MindSpore TP: {diff:.2e}; one-process references: "
          f"{_agreement(references):.2e}")
    assert diff <= tolerance, (f"torch dp2 x tp2 {torch_tp} vs MindSpore tp2 {mindspore_tp}: "
                               f"{diff:.2e} relative, more than the one-process references' "
                               f"agreement x2 ({tolerance:.2e})")


def _exported(directory) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def test_mindspore_tp2_exports_whole_tensors(references, mindspore_tp2, root):
    """Built under ``no_init_parameters`` with each rank's blocks only, trained at tp2 and
    exported: the whole tensors of the one-process run's export, the same names and
    shapes, values within 1e-4 (the two runs round apart, and AdamW's normalised steps
    carry that into the parameters: measured 6.4e-6 after 3 steps)."""
    whole = _exported(references["exports"]["mindspore"])
    split = _exported(root / "ms_tp2_export")
    assert split.keys() == whole.keys() and whole
    for name, value in whole.items():
        assert split[name].shape == value.shape, name
        np.testing.assert_allclose(split[name], value, rtol=0, atol=1e-4, err_msg=name)


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
