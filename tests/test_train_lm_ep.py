"""examples/train_lm.py with a mixture of experts (``--moe``) split over the ranks
(``--ep``): the example model with experts trains at ep2 what it trains in one process,
on both frameworks.

Every run is the example's own command line (tests/test_train_lm.py's ``_train``: tiny size,
hp-run's ``--timeout``), ``STEPS`` AdamW steps with clipping and router-bias balancing.
The launches (about 1 min each for MindSpore on 2 cores) run under ``-m slow``: in the
default run tests/test_expert_parallel.py trains the same composition (experts split by
``ExpertParallel`` and sharded inside the expert group, the rest over every rank) on both
frameworks against one process. Checked:

- on each framework, the ep2 losses equal its one-process losses to 1e-5 relative;
- torch's and MindSpore's one-process runs agree to what the example's dense runs agree to
  (tests/test_train_lm.py's tolerance is measured per session; here 1e-5 relative);
- a checkpoint resumes at another expert degree and continues the uninterrupted run to
  1e-5 relative: saved at ep2 (step ``K``), resumed at ep4 on 4 ranks; saved there (step
  ``2K``), resumed at ep2; saved in one process without expert parallelism, resumed at
  ep2 (the experts' blocks are regions of the whole ``(num_experts, ...)`` value in every
  checkpoint, and the router bias travels in its extra data);
- ``--ep 2 --tp 2 --mesh 2x2`` on 8 ranks (2 replicas x 2 expert ranks x 2 tensor-parallel
  ranks: the experts split over ``ep``, sharded over ``replicate`` x ``efsdp``; the
  dense layers split over ``tp``, the mixture computed whole by each ``tp`` rank): its
  losses equal the one-process run's to 1e-5 relative over the ``STEPS`` AdamW steps;
- the ep2 run's export with ``--moe`` (each expert under its own names) holds its last
  checkpoint's values: the per-expert weights stack back into the grouped parameters;
- the command line's checks of ``--ep`` (no launch).
"""

import numpy as np
import pytest

from examples.train_lm import parse_args
from tests.test_train_lm import _losses, _rel, _train

STEPS = 5
K = 2  # the runs checkpoint every K steps
PARITY = 1e-5
BACKENDS = ["torch", "mindspore"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("train_lm_ep")


@pytest.fixture(scope="module")
def runs(root):
    def export(backend, nproc):  # the ep2 run: its last step checkpointed and exported too
        return [] if nproc == 1 else ["--ckpt-at-end", "--keep", "3",
                                      "--export", str(root / f"{backend}_2_export")]

    return {(backend, nproc): _train(root / f"{backend}_{nproc}", backend, "--nproc", str(nproc),
                                     "--moe", "--ep", str(nproc), "--steps", str(STEPS),
                                     "--ckpt-every", str(K), *export(backend, nproc))
            for backend in BACKENDS for nproc in (1, 2)}


@pytest.fixture(scope="module")
def resumed(root, runs):
    """Per backend: ep2's step-K checkpoint resumed at ep4; that run's step-2K checkpoint
    resumed at ep2; the one-process step-K checkpoint resumed at ep2."""
    out = {}
    for backend in BACKENDS:
        def resume(name, nproc, ep, checkpoint):
            return _train(root / f"{backend}_{name}", backend, "--nproc", str(nproc), "--moe",
                          "--ep", str(ep), "--steps", str(STEPS), "--ckpt-every", str(K),
                          "--resume", str(checkpoint))

        ep4 = resume("ep2_to_ep4", 4, 4, root / f"{backend}_2" / f"step-{K:05d}")
        out[(backend, "ep2_to_ep4")] = ep4
        out[(backend, "ep4_to_ep2")] = resume("ep4_to_ep2", 2, 2, root / f"{backend}_ep2_to_ep4"
                                              / f"step-{2 * K:05d}")
        out[(backend, "one_to_ep2")] = resume("one_to_ep2", 2, 2,
                                              root / f"{backend}_1" / f"step-{K:05d}")
    return out


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ep2_losses_equal_one_process(runs, backend):
    one, ep2 = _losses(runs[(backend, 1)]), _losses(runs[(backend, 2)])
    assert len(one) == STEPS and one[-1] < one[0], "the one-process run did not train"
    assert _rel(ep2, one) <= PARITY, (ep2, one)
    assert "MoE, EP 2" in runs[(backend, 2)][1]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_torch_and_mindspore_agree(runs):
    assert _rel(_losses(runs[("torch", 1)]), _losses(runs[("mindspore", 1)])) <= PARITY


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case, start", [("ep2_to_ep4", K), ("ep4_to_ep2", 2 * K),
                                         ("one_to_ep2", K)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_resumed_at_another_expert_degree_continues_the_run(runs, resumed, backend, case, start):
    """The resumed run's history holds the saved steps and its own: its own steps' losses
    equal the uninterrupted ep2 run's."""
    whole, got = _losses(runs[(backend, 2)]), _losses(resumed[(backend, case)])
    assert len(got) == STEPS and f"resumed at step {start}" in resumed[(backend, case)][1]
    assert _rel(got[start:], whole[start:]) <= PARITY, (case, got, whole)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ep2_export_in_per_expert_names_round_trips(monkeypatch, runs, root, backend):
    """The ep2 run's export (``--export`` with ``--moe``): each expert's linear weights,
    transposed and stacked, are the grouped parameters of its last checkpoint, loaded here
    into the torch model in one process; every other value is the checkpoint's."""
    monkeypatch.setenv("HP_BACKEND", "torch")
    import hyper_parallel as hp
    from safetensors.numpy import load_file
    from examples.lm.expert_parallel import EXPERTS
    from examples.lm.model_torch import build

    model = build("tiny", True)
    hp.load_checkpoint(str(root / f"{backend}_2" / f"step-{STEPS:05d}"), model)
    exported = load_file(str(root / f"{backend}_2_export" / "model.safetensors"))
    assert "exported, each expert under its own names" in runs[(backend, 2)][1]
    for name, param in model.named_parameters():
        value = param.detach().numpy()
        prefix, _, attr = name.rpartition(".")
        if prefix.endswith("mlp.experts"):
            value = value.transpose(0, 2, 1)
            got = np.stack([exported.pop(f"{prefix}.{e}.{attr}.weight") for e in range(EXPERTS)])
        else:
            got = exported.pop(name)
        np.testing.assert_array_equal(got, value, err_msg=name)
    assert not exported, sorted(exported)


@pytest.fixture(scope="module")
def composed(root):
    """Per backend: dp2 (HSDP 2x2's replicas x ep) x ep2 x tp2 on 8 ranks (MindSpore's 8
    ranks take about 5 minutes on 2 cores)."""
    return {backend: _train(root / f"{backend}_ep2_tp2_hsdp", backend, "--nproc", "8",
                            "--moe", "--ep", "2", "--tp", "2", "--mesh", "2x2",
                            "--steps", str(STEPS), timeout_s=540)
            for backend in BACKENDS}


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ep2_with_tp2_and_hsdp_losses_equal_one_process(runs, composed, backend):
    one, got = _losses(runs[(backend, 1)]), _losses(composed[backend])
    assert len(got) == STEPS and _rel(got, one) <= PARITY, (got, one)
    assert "HSDP 2x2, MoE, EP 2 x TP 2" in composed[backend][1]


@pytest.mark.parametrize("argv, message", [
    (["--ep", "2"], "--ep N splits the experts of --moe: add --moe"),
    (["--moe", "--ep", "3", "--nproc", "3", "--batch", "6"], "--ep 3 must divide the 4 experts"),
    (["--moe", "--ep", "2", "--nproc", "4", "--cp", "2", "--seq", "32"], "leave out --cp"),
    (["--moe", "--ep", "2", "--nproc", "4", "--tp", "2", "--mesh", "2x1", "--batch", "2"],
     "--ep 2 must divide the 1 sharding ranks of --mesh 2x1"),
])
def test_bad_expert_arguments_are_named(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
