"""examples/train_lm.py under context parallelism (``--cp``): the example model trains what
it trains in one process, on both frameworks, alone and with tensor parallelism, and its
checkpoints do not depend on the context-parallel degree.

Every run is the example's own command line (tests/test_train_lm.py's pattern: tiny size,
hp-run's ``--timeout``), ``STEPS`` AdamW steps. The runs are under ``-m slow`` (bad options
are refused in the default run, before anything starts): in the default run
tests/test_context_parallel.py trains the same model under fully_shard inside
``hp.context_parallel`` at cp2 on both frameworks, and tests/test_docs_examples.py runs the
plan of docs/context-parallel.md.

- the one-process references, torch and MindSpore (``--nproc 1``, tests/conftest.py's
  ``train_lm_references``);
- cp2 on each framework (2 ranks), with a checkpoint after step K, cp2 x tp2 and HSDP
  2x1 x cp2 (4 ranks): losses and the last validation loss equal one process's to 1e-5
  relative;
- the MindSpore cp2 checkpoint resumed on torch at one rank (cp1): the history it carries
  is the cp2 run's, and the resumed steps equal the one-process run's to 1e-5.
"""

import subprocess
import sys

import pytest

from tests.multirank import REPO_ROOT
from tests.test_train_lm import _losses, _train
from tests.test_train_lm_tp import _check_parity

pytest.importorskip("torch")
pytest.importorskip("mindspore")

STEPS, K = 5, 3
BACKENDS = ["torch", "mindspore"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("train_lm_cp")


@pytest.fixture(scope="module")
def references(train_lm_references):
    return train_lm_references  # one process, STEPS steps (tests/conftest.py)


@pytest.fixture(scope="module")
def cp2(root):
    return {backend: _train(root / f"{backend}_cp2", backend, "--nproc", "2", "--cp", "2",
                            "--steps", str(STEPS), "--ckpt-every", str(K))
            for backend in BACKENDS}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cp2_trains_as_one_process(references, cp2, backend):
    run = cp2[backend]
    assert "CP 2" in run[1]
    _check_parity(run, references[backend], f"{backend} cp2")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cp2_tp2_trains_as_one_process(references, root, backend):
    run = _train(root / f"{backend}_cp2_tp2", backend, "--nproc", "4", "--cp", "2", "--tp", "2",
                 "--eager-init", "--steps", str(STEPS))
    assert "CP 2 x TP 2" in run[1]
    _check_parity(run, references[backend], f"{backend} cp2 x tp2")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_hsdp_x_cp2_trains_as_one_process(references, root, backend):
    run = _train(root / f"{backend}_hsdp_cp2", backend, "--nproc", "4", "--mesh", "2x1",
                 "--cp", "2", "--steps", str(STEPS))
    assert "HSDP 2x1 x CP 2" in run[1]
    _check_parity(run, references[backend], f"{backend} HSDP 2x1 x cp2")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_cp2_checkpoint_resumes_at_cp1_on_the_other_framework(references, cp2, root):
    checkpoint = root / "mindspore_cp2" / f"step-{K:05d}"
    resumed, out = _train(root / "torch_from_cp2", "torch", "--nproc", "1",
                          "--steps", str(STEPS), "--resume", str(checkpoint))
    assert f"resumed at step {K}" in out
    assert resumed["history"][:K] == cp2["mindspore"][0]["history"][:K]
    _check_parity((resumed, out), references["torch"], "torch cp1 resumed from MindSpore cp2")
    assert len(_losses((resumed, out))) == STEPS


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "2", "--cp", "2", "--seq", "30"], "--seq 30 must be a multiple of 2 x --cp = 4"),
    (["--nproc", "2", "--cp", "3"], "--cp 3 x --tp 1 must divide --nproc 2"),
    (["--nproc", "4", "--cp", "2", "--mesh", "2x2"], "--mesh 2x2 x --cp 2 x --tp 1 has 8 ranks"),
])
def test_bad_context_parallel_options_are_refused_before_anything_runs(tmp_path, argv, message):
    out = tmp_path / "out"
    command = [sys.executable, str(REPO_ROOT / "examples" / "train_lm.py"), "--backend", "torch",
               "--size", "tiny", "--out", str(out), *argv]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert not out.exists(), "a refused run wrote output"
