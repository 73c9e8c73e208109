"""examples/train_lm.py under pipeline parallelism (``--pp``): the example model cut into
stages by module names (hp.pipelining.pipeline_module_split) trains what it trains in one
process, on both frameworks, alone, with activation recompute and with tensor parallelism
and fully_shard (3-D), and its checkpoints resume on the other framework, pipelined or not.

Design note
-----------
Every run is the example's own command line (tests/test_train_lm.py's pattern: tiny size,
hp-run's ``--timeout``), ``STEPS`` AdamW steps, gradients clipped over every stage
(``clip_grad_norm_(..., pp_mesh=...)``), the loss the last stage's mean over its
micro-batches. Runs:

- the one-process references, torch and MindSpore (``--nproc 1``, no recompute:
  tests/conftest.py's ``train_lm_references``, shared with the tensor- and
  context-parallel runs);
- in the default run, pp2 (2 ranks, 1F1B, 2 micro-batches) with ``--recompute`` (each
  decoder layer, a fully_shard unit, runs its forward again in backward; on MindSpore
  inside the schedule's own recomputed forwards) on each framework, with a checkpoint
  after step K: one launch covers the pipeline, recompute inside a stage and the save;
- under ``-m slow``: pp2 x dp2 x tp2 (8 ranks) on each framework with a checkpoint after
  step K, each resumed by the other framework's 3-D run; torch's pp2 checkpoint resumed
  by MindSpore in one process; pp2 under the interleaved schedule (4 stages: the first
  holds only the embedding, the last only the norm and the head) and GPipe over HSDP 2x1
  (4 ranks).

Losses and the last validation loss must equal one process's to 1e-5 relative (float32),
a resumed run's too (its first K steps are the saving run's history);
torch's and MindSpore's pipelined runs must agree to what their one-process references
agree to (twice their largest relative difference, as tests/test_train_lm_tp.py).
Options that do not compose with ``--pp`` are refused by the argument parser, in process.
"""

import pytest

from tests.test_train_lm import _losses, _rel, _train
from tests.test_train_lm_tp import _check_parity

pytest.importorskip("torch")
pytest.importorskip("mindspore")

STEPS, K = 5, 3  # steps in all; the pp2 and 3-D runs checkpoint after K
BACKENDS = ["torch", "mindspore"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("train_lm_pp")


@pytest.fixture(scope="module")
def references(train_lm_references):
    return train_lm_references  # one process, STEPS steps (tests/conftest.py)


@pytest.fixture(scope="module")
def pp2(root):
    return {backend: _train(root / f"{backend}_pp2", backend, "--nproc", "2", "--pp", "2",
                            "--recompute", "--steps", str(STEPS), "--ckpt-every", str(K))
            for backend in BACKENDS}


def _check_agreement(runs, references, what: str) -> None:
    """torch's and MindSpore's ``runs`` agree as their one-process references do."""
    tolerance = 2 * _rel(_losses(references["mindspore"]), _losses(references["torch"]))
    diff = _rel(_losses(runs["torch"]), _losses(runs["mindspore"]))
    print(f"{what}: torch vs MindSpore {diff:.2e}, one-process references {tolerance / 2:.2e}")
    assert diff <= tolerance, (f"{what}: torch {_losses(runs['torch'])} vs MindSpore "
                               f"{_losses(runs['mindspore'])}: {diff:.2e} relative, more than "
                               f"the one-process references' agreement x2 ({tolerance:.2e})")


@pytest.mark.parametrize("backend", BACKENDS)
def test_pp2_with_recompute_trains_as_one_process(references, pp2, root, backend):
    run = pp2[backend]
    assert "PP 2 (1f1b, 2 micro-batches) x FSDP 1, recompute" in run[1]
    assert [r["step"] for r in run[0]["history"]] == list(range(1, STEPS + 1))
    _check_parity(run, references[backend], f"{backend} pp2 recompute")
    assert (root / f"{backend}_pp2" / f"step-{K:05d}" / "index.json").exists()


def test_pp2_torch_agrees_with_mindspore(references, pp2):
    _check_agreement(pp2, references, "pp2")


def _check_resumed(saved, resumed, reference, what: str) -> None:
    """``resumed`` carries ``saved``'s first K steps and trains on as one process does."""
    assert f"resumed at step {K}" in resumed[1]
    assert resumed[0]["history"][:K] == saved[0]["history"][:K], "the checkpoint lost the history"
    assert [r["step"] for r in resumed[0]["history"]] == list(range(1, STEPS + 1))
    _check_parity(resumed, reference, what)


THREE_D = ["--nproc", "8", "--pp", "2", "--tp", "2", "--steps", str(STEPS)]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_pp2_dp2_tp2_trains_as_one_process_and_resumes_on_the_other_framework(references, root):
    runs = {backend: _train(root / f"{backend}_3d", backend, *THREE_D, "--ckpt-every", str(K))
            for backend in BACKENDS}
    for backend, run in runs.items():
        assert "PP 2 (1f1b, 2 micro-batches) x FSDP 2 x TP 2" in run[1]
        _check_parity(run, references[backend], f"{backend} pp2 x dp2 x tp2")
    _check_agreement(runs, references, "pp2 x dp2 x tp2")
    for saver, resumer in (("torch", "mindspore"), ("mindspore", "torch")):
        resumed = _train(root / f"{resumer}_3d_from_{saver}", resumer, *THREE_D,
                         "--resume", str(root / f"{saver}_3d" / f"step-{K:05d}"))
        _check_resumed(runs[saver], resumed, references[resumer],
                       f"{resumer} pp2 x dp2 x tp2 resumed from {saver}'s")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pp2_checkpoint_resumes_in_one_process_on_the_other_framework(references, pp2, root):
    resumed = _train(root / "mindspore_1_from_pp2", "mindspore", "--nproc", "1",
                     "--steps", str(STEPS), "--resume", str(root / "torch_pp2" / f"step-{K:05d}"))
    _check_resumed(pp2["torch"], resumed, references["mindspore"],
                   "MindSpore in one process resumed from torch's pp2")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("argv, layout", [
    (["--nproc", "2", "--pp-schedule", "interleaved"], "PP 2 (interleaved, 2 micro-batches)"),
    (["--nproc", "4", "--pp-schedule", "gpipe", "--mesh", "2x1", "--microbatches", "1"],
     "PP 2 (gpipe, 1 micro-batches) x HSDP 2x1"),
])
def test_pp2_schedules_train_as_one_process(references, root, backend, argv, layout):
    name = f"{backend}_{argv[argv.index('--pp-schedule') + 1]}"
    run = _train(root / name, backend, "--pp", "2", *argv, "--steps", str(STEPS))
    assert layout in run[1]
    _check_parity(run, references[backend], f"{backend} {layout}")


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "4", "--pp", "2", "--cp", "2"], "--pp does not compose with --cp"),
    (["--nproc", "2", "--pp", "2", "--moe"], "--pp does not compose with --moe"),
    (["--nproc", "2", "--pp", "2", "--export", "x"], "--pp does not compose with --export"),
    (["--nproc", "2", "--pp", "3"], "--pp 3 x --tp 1 must divide --nproc 2"),
    (["--nproc", "4", "--pp", "4", "--pp-schedule", "interleaved"],
     "makes 8 stages, more than the model's 2 layers, embedding and head"),
    (["--nproc", "2", "--pp", "2", "--microbatches", "3"],
     "--microbatches 3 must divide each data-parallel rank's 4 rows"),
    (["--nproc", "2", "--microbatches", "2"], "--microbatches needs --pp"),
])
def test_bad_pipeline_options_are_refused_before_anything_runs(capsys, argv, message):
    from examples.train_lm import parse_args

    with pytest.raises(SystemExit) as refused:
        parse_args(["--backend", "torch", "--size", "tiny", "--batch", "4", *argv])
    assert refused.value.code == 2
    assert message in capsys.readouterr().err
