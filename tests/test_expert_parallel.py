"""Expert parallelism (hyper_parallel.expert_parallel) on both frameworks.

One shared 2-rank launch per backend (tests/ep_scenarios.py) trains the MoE model of
tests/ep_models.py (top-2 routing with softmax scores, a shared expert, the auxiliary
loss, bias-based balancing, an expert no token chooses) at ep2: the experts
split by ``hp.ExpertParallel`` and sharded by ``fully_shard`` inside the expert group, the
dense parts sharded over both ranks, each rank its own sequences; and the same model in
one process on the whole batch. Over 5 AdamW steps with ``hp.clip_grad_norm_``:

- the losses (the mean of the ranks' means) and the gradient norms (each expert counted
  once) equal the reference's within FP32_RTOL, and the whole parameters after every
  step (``get_full_state_dict``: all experts) within ADAMW_RTOL; the expert bias moves as the
  reference's (the counts summed over the ranks);
- the routing leaves experts without rows on some rank (checked, so the case is covered);
- the all-to-all bytes of a step are those the routing implies (counted by the platform);
- the checkpoint saved at ep2 loads into the plain model in one process and into the
  model under plain FSDP over both ranks: every value and the optimizer state equal;
  torch's loads into MindSpore's plain model, every value equal; ``export_full`` writes
  every expert, whole.

Under ``-m slow`` a 4-rank launch runs the same at dp2 x ep2 (two expert groups, experts
sharded over 2 ranks inside each, gradient divide factor 4), with softmax and sigmoid
scores, with the experts' forward (dispatch and combine included) recomputed in
backward, under HSDP (2 replicas: the experts on a (replicate 2, efsdp 1) mesh, the
rest on (replicate 2, shard 2)), with tensor parallelism on the dense layers (an
(efsdp 1, ep 2, tp 2) mesh: ``proj`` and the shared expert split over ``tp``, experts over
``ep``, fully_shard over the data-parallel dims), and in low precision; ep2 with gradients accumulated over 2 micro-batches; and dp2 x ep2 where one
rank's experts receive no row while another rank holding the same experts computes
(against plain FSDP on the same routing).

With the ``hf`` extra installed, transformers 5's tiny Qwen3-MoE (experts called
``experts(hidden_states, top_k_index, top_k_weights)``) trains at ep2 with fully_shard as
it does in one process (tests/ep_hf_scenarios.py; transformers' grouped GEMM kernel for
its experts, and under ``-m slow`` its loop over the experts). Bad input fails before anything changes, in the test process on a mesh without
groups.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from tests import shared_launch
from tests.multirank import RankFailure
from tests.ep_models import DIM, EMPTY, EXPERTS
from tests.tolerance import ADAMW_RTOL, FP32_RTOL, LOW_PRECISION_RTOL, assert_close

SLOW_RUNS = ("softmax", "sigmoid", "softmax-recompute", "softmax-hsdp", "softmax-tp")
EP = 2

def _ep2_args(backend: str) -> tuple:
    """The ep2 job's arguments; MindSpore's also load torch's ep2 checkpoint, once it exists
    (None without torch, or if its launch failed: the torch tests report that)."""
    directory = shared_launch.directory("ep2")
    torch_saved = None
    if backend == "mindspore" and importlib.util.find_spec("torch") is not None:
        try:
            shared_launch.results("expert_parallel_ep2", "torch")
            torch_saved = os.path.join(directory, "ep-torch-softmax")
        except RankFailure:
            torch_saved = None
    return backend, EP, directory, ("softmax",), torch_saved


shared_launch.register(__name__, "expert_parallel_ep2", EP, "tests.ep_scenarios:run_all",
                       _ep2_args, timeout_s=300)
shared_launch.register(__name__, "expert_parallel_capacity", EP, "tests.ep_scenarios:capacity",
                       lambda backend: (backend,), timeout_s=240)
if importlib.util.find_spec("transformers") is not None:  # the hf test extra
    shared_launch.register(__name__, "expert_parallel_hf_ep2", EP,
                           "tests.ep_hf_scenarios:run",
                           lambda backend: (EP, ("grouped_mm",), shared_launch.directory("hf")),
                           backends=("torch",), timeout_s=240)
    shared_launch.register(__name__, "expert_parallel_hf_ep2_eager", EP,
                           "tests.ep_hf_scenarios:run", lambda backend: (EP, ("eager",)),
                           backends=("torch",), timeout_s=240, slow=True)
shared_launch.register(__name__, "expert_parallel_dp2_ep2", 2 * EP, "tests.ep_scenarios:run_all",
                       lambda backend: (backend, EP, shared_launch.directory("dp2-ep2"),
                                        SLOW_RUNS + ("softmax-lowp",)),
                       timeout_s=600, slow=True)
shared_launch.register(__name__, "expert_parallel_starved", 2 * EP, "tests.ep_scenarios:starved",
                       lambda backend: (backend,), timeout_s=300, slow=True)
shared_launch.register(__name__, "expert_parallel_ep2_accumulate", EP, "tests.ep_scenarios:run_all",
                       lambda backend: (backend, EP, shared_launch.directory("ep2-acc"),
                                        ("softmax-accumulate",)),
                       timeout_s=300, slow=True)


def _check_parity(per_rank: list, score: str, rtol: float = FP32_RTOL) -> None:
    """Losses, norms and expert bias to ``rtol``; parameters, which AdamW moves by about
    lr * sign(grad), to ADAMW_RTOL at least (tests/tolerance.py)."""
    runs = [result[score] for result in per_rank]
    reference = runs[0]["reference"]
    losses = np.mean([run["ep"]["losses"] for run in runs], axis=0)
    assert_close(losses, reference["losses"], rtol, "losses")
    for rank, run in enumerate(runs):
        assert_close(run["ep"]["norms"], reference["norms"], rtol,
                     f"rank {rank}: gradient norms")
        if rtol == FP32_RTOL:  # low precision may route a near tie otherwise
            np.testing.assert_allclose(run["ep"]["bias"], reference["bias"], rtol=0,
                                       atol=1e-7, err_msg=f"rank {rank}: expert bias")
        for step, expected in enumerate(reference["params"]):
            got = run["ep"]["params"][step]
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                assert got[name].shape == value.shape, name  # every expert, whole
                assert_close(got[name], value, max(rtol, ADAMW_RTOL),
                             f"rank {rank}, step {step}: {name}")
    counts = [run["counts"] for run in runs]
    assert all(c[EMPTY] == 0 for c in counts), counts
    if "-" not in score:  # one forward and backward per step
        _check_all_to_all_bytes(runs, counts)


def _check_all_to_all_bytes(runs: list, counts: list) -> None:
    """What each rank sent over "ep" in one step is what the routing implies: the counts
    exchanged (int64), the rows it sends to its peers' experts and the rows its experts
    return to them, forward and again in backward (float32 rows of DIM), in 5 calls."""
    local = EXPERTS // EP
    for rank, run in enumerate(runs):
        group = range(rank - rank % EP, rank - rank % EP + EP)
        mine = range(rank % EP * local, rank % EP * local + local)
        sent = sum(n for e, n in enumerate(counts[rank]) if e not in mine)
        returned = sum(counts[peer][e] for peer in group if peer != rank for e in mine)
        expected = (EXPERTS - local) * 8 + 2 * (sent + returned) * DIM * 4
        assert run["ep"]["all_to_all"] == (5, expected), (rank, run["ep"]["all_to_all"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_ep2_matches_one_process(backend):
    _check_parity(shared_launch.results("expert_parallel_ep2", backend), "softmax")
    _print_seconds("expert_parallel_ep2", backend)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
@pytest.mark.parametrize("into", ["loaded", "loaded_fsdp"])
def test_ep2_checkpoint_loads_in_one_process_and_under_fsdp(backend, into):
    for rank, result in enumerate(shared_launch.results("expert_parallel_ep2", backend)):
        saved, loaded = result["softmax"]["saved"], result["softmax"][into]
        assert saved.keys() == loaded.keys()
        for key, value in saved.items():
            np.testing.assert_array_equal(loaded[key], value, err_msg=f"rank {rank}: {key}")


@pytest.mark.timeout(900)
def test_torchs_ep2_checkpoint_loads_on_mindspore():
    pytest.importorskip("torch")
    saved = shared_launch.results("expert_parallel_ep2", "torch")[0]["softmax"]["saved"]
    for rank, result in enumerate(shared_launch.results("expert_parallel_ep2", "mindspore")):
        crossed = result["crossed"]
        assert crossed.keys() == {k for k in saved if not k.startswith("optim")}
        for key, value in crossed.items():
            np.testing.assert_array_equal(value, saved[key], err_msg=f"rank {rank}: {key}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_ep2_export_writes_every_expert(backend):
    result = shared_launch.results("expert_parallel_ep2", backend)[0]["softmax"]
    whole = result["saved"]
    assert result["exported"].keys() == {k for k in whole if not k.startswith("optim")}
    for key, value in result["exported"].items():
        np.testing.assert_array_equal(value, whole[key], err_msg=key)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_ep2_export_in_per_expert_names_round_trips(backend):
    """Each grouped experts parameter written as one linear weight per expert (its
    ``(in, out)`` block transposed): stacked back, the whole parameter; the rest as the
    model names it."""
    result = shared_launch.results("expert_parallel_ep2", backend)[0]["softmax"]
    whole, written = result["saved"], dict(result["per_expert"])
    for name in ("moe.experts.w1", "moe.experts.w2"):
        pieces = [written.pop(f"{name.rpartition('.')[0]}.{e}.{name.rpartition('.')[2]}.weight")
                  for e in range(EXPERTS)]
        np.testing.assert_array_equal(np.stack([p.T for p in pieces]), whole[name], err_msg=name)
    assert written.keys() == {k for k in whole if not k.startswith("optim")} - {
        "moe.experts.w1", "moe.experts.w2"}
    for key, value in written.items():
        np.testing.assert_array_equal(value, whole[key], err_msg=key)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_a_split_that_does_not_cut_or_a_split_checkpoint_is_refused(backend):
    """Before anything is written: an export whose ``per_expert_keys`` names 3 experts of
    4, and a checkpoint asked to split a value (it stores each whole)."""
    for rank, result in enumerate(shared_launch.results("expert_parallel_ep2", backend)):
        refused = result["softmax"]["refused_splits"]
        error, written = refused["export"]
        assert error is not None and "splits moe.experts.w1 (4, 8, 16) along dim 0 into 3 " \
            "parts of one" in error, (rank, error)
        error, written_save = refused["save"]
        assert error is not None and "only export_full writes a value as several" in error, \
            (rank, error)
        assert not written and not written_save, rank


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("run", SLOW_RUNS)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_dp2_ep2_matches_one_process(backend, run):
    _check_parity(shared_launch.results("expert_parallel_dp2_ep2", backend), run)
    _print_seconds("expert_parallel_dp2_ep2", backend)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("implementation", [
    "grouped_mm", pytest.param("eager", marks=pytest.mark.slow)])
def test_hugging_face_experts_at_ep2_match_one_process(implementation):
    """transformers 5's Qwen3-MoE (tests/ep_hf_scenarios.py), its experts split by the
    plan ``{"model.layers.*.mlp.experts": hp.ExpertParallel()}`` and sharded by
    fully_shard, against one process: the losses and the whole parameters after each
    AdamW step. torch only: transformers' models are torch modules."""
    pytest.importorskip("transformers", reason="the hf test extra is not installed")
    key = "expert_parallel_hf_ep2" + ("" if implementation == "grouped_mm" else "_eager")
    runs = [result[implementation] for result in shared_launch.results(key, "torch")]
    reference = runs[0]["reference"]
    losses = np.mean([run["ep"]["losses"] for run in runs], axis=0)
    assert_close(losses, reference["losses"], FP32_RTOL, "losses")
    assert reference["losses"][-1] < reference["losses"][0], "the reference did not train"
    for rank, run in enumerate(runs):
        for step, expected in enumerate(reference["params"]):
            got = run["ep"]["params"][step]
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                assert got[name].shape == value.shape, name  # every expert, whole
                assert_close(got[name], value, FP32_RTOL, f"rank {rank}, step {step}: {name}")
    _print_seconds(key, "torch")


@pytest.mark.timeout(600)
def test_hugging_face_export_in_per_expert_names_loads_with_from_pretrained():
    """The Qwen3-MoE trained at ep2, exported with ``hp.per_expert_keys`` in its
    checkpoint's per-expert names: transformers' ``from_pretrained`` (which merges them
    into its grouped parameters) loads it, and its logits are the trained model's."""
    pytest.importorskip("transformers", reason="the hf test extra is not installed")
    from tests.ep_hf_scenarios import config

    runs = shared_launch.results("expert_parallel_hf_ep2", "torch")
    exported = runs[0]["grouped_mm"]["export"]
    experts = config("eager").num_experts
    for layer in range(config("eager").num_hidden_layers):
        for e in range(experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" in exported["names"]
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in exported["names"])
    for rank, run in enumerate(runs):
        assert_close(run["grouped_mm"]["export"]["trained"], exported["loaded"], FP32_RTOL,
                     f"rank {rank}: logits")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_a_capacity_factor_drops_the_rows_its_rule_names(backend):
    """ep2 with ``capacity_factor=1``: rows were dropped (an expert got more than an even
    share of a rank's rows), and each rank's losses and the parameters equal those of the
    model dropping the same rows itself (each expert's first ``ceil(cf * rows / E)`` rows
    of a rank's call kept, the others' outputs zero) under plain FSDP."""
    from tests.ep_scenarios import CAPACITY

    for rank, result in enumerate(shared_launch.results("expert_parallel_capacity", backend)):
        counts = np.asarray(result["counts"])
        limit = int(np.ceil(CAPACITY * counts.sum() / EXPERTS))
        assert (counts > limit).any(), (rank, counts, limit)  # the case is covered
        _check_against_fsdp(rank, result["ep"], result["fsdp"])
    _print_seconds("expert_parallel_capacity", backend)


def _check_against_fsdp(rank: int, ep: dict, fsdp: dict) -> None:
    """One rank's losses and parameters after each step equal plain FSDP's (the parameters
    of an AdamW run to ADAMW_RTOL: the expert gradients are summed in another order)."""
    assert_close(ep["losses"], fsdp["losses"], FP32_RTOL, f"rank {rank}: losses")
    for step, expected in enumerate(fsdp["params"]):
        for name, value in expected.items():
            assert_close(ep["params"][step][name], value, ADAMW_RTOL,
                         f"rank {rank}, step {step}: {name}")


def _bad_input_model(backend: str):
    """``moe.experts`` (grouped, 4 experts), ``proj`` (a linear layer), and ``moe.listed``:
    a ModuleList / CellList of linear experts."""
    from tests.ep_models import mindspore_model, torch_model

    if backend == "torch":
        from torch import nn

        model = torch_model()
        model.moe.listed = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
        return model
    from mindspore import nn

    model = mindspore_model()
    model.moe.listed = nn.CellList([nn.Dense(4, 4) for _ in range(4)])
    return model


# (submodule, mesh size, expected error, what it says)
BAD_INPUT = {
    "experts_not_divisible": ("moe.experts", 3, ValueError,
                              "4 experts do not split evenly over the 3 ranks of mesh dim 'ep'"),
    "module_without_experts": ("proj", 2, ValueError, "it holds no grouped experts"),
    "module_list_of_experts": ("moe.listed", 2, ValueError,
                               "its experts are 4 modules of their own, the Hugging Face form"),
    "mesh_not_1d": ("moe.experts", None, ValueError, "takes a 1-D mesh"),
}


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_the_routed_form_sends_no_row_for_the_sentinel(monkeypatch, backend):
    """transformers' sentinel index (``num_experts``: a slot without expert) sends no row
    and adds nothing: with experts that return their rows, each token's output is the
    weighted sum of its other slots' rows. In the test process: no collective."""
    monkeypatch.setenv("HP_BACKEND", backend)
    import hyper_parallel as hp
    from hyper_parallel.expert_parallel.routed import from_grouped, to_grouped

    p = hp.get_platform()
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((5, 3)).astype(np.float32)
    index = np.array([[0, 2], [4, 1], [3, 4], [1, 1], [2, 0]])  # 4: the sentinel
    weights = rng.random((5, 2)).astype(np.float32)
    rows, counts, slots = to_grouped(p.from_numpy(hidden), p.from_numpy(index),
                                     p.from_numpy(weights), EXPERTS)
    assert list(p.to_numpy(counts)) == [2, 3, 2, 1]  # 8 rows: the 2 sentinel slots sent none
    out = p.to_numpy(from_grouped(rows, slots))
    expected = ((index < EXPERTS) * weights)[..., None] * hidden[:, None, :]
    np.testing.assert_allclose(out, expected.sum(1), rtol=1e-6)


@pytest.mark.parametrize("factor", [0, -1.0, True, "2"])
def test_a_capacity_factor_that_is_not_positive_is_a_named_error(factor):
    import hyper_parallel as hp

    with pytest.raises(ValueError, match="give a positive number"):
        hp.ExpertParallel(capacity_factor=factor)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(BAD_INPUT))
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_bad_input_is_a_named_error_and_changes_nothing(monkeypatch, backend, case):
    monkeypatch.setenv("HP_BACKEND", backend)
    import hyper_parallel as hp
    from hyper_parallel import tensor_parallel as tp
    from tests.core_tp_models import forward_hook_count

    platform = hp.get_platform()
    model = _bad_input_model(backend)
    where, size, error, message = BAD_INPUT[case]
    shape, names = ((2, 2), ("efsdp", "ep")) if size is None else ((size,), ("ep",))
    mesh = hp.DeviceMesh("cpu", shape, names, [None] * len(shape))  # no groups: no collective

    def state():
        return [(name, attr, id(param), platform.to_numpy(param).tobytes(),
                 tp.tensor_parallel_layout(param), forward_hook_count(backend, sub))
                for name, sub in platform.named_modules(model)
                for attr, param in platform.direct_params(sub)]

    before = state()
    with pytest.raises(error) as raised:
        hp.parallelize_module(model, mesh, {where: hp.ExpertParallel()})
    assert message in str(raised.value)
    assert state() == before


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_a_mesh_without_the_expert_dim_is_a_named_error(monkeypatch, backend):
    monkeypatch.setenv("HP_BACKEND", backend)
    import hyper_parallel as hp

    mesh = hp.DeviceMesh("cpu", (2,), ("dp",), [None])
    with pytest.raises(KeyError, match="mesh has no dim named 'ep'|got 'ep'"):
        mesh["ep"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_expert_parallel_after_fully_shard_is_refused(backend):
    refused = shared_launch.results("expert_parallel_ep2", backend)[0]["softmax"]["after_fully_shard"]
    assert "is managed by fully_shard already" in refused, refused


def _print_seconds(key: str, backend: str) -> None:
    """The seconds the slowest rank spent in the job (its cost in a shared launch)."""
    seconds = max(result["seconds"] for result in shared_launch.results(key, backend))
    print(f"{key} on {backend}: {seconds:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_dp2_ep2_in_low_precision_is_near_fp32(backend):
    """bfloat16 (torch) or float16 (MindSpore) parameters, fp32 reduction: within the low
    precision's own tolerance of the fp32 one-process reference, and not equal to it (else
    the policy did not apply)."""
    per_rank = shared_launch.results("expert_parallel_dp2_ep2", backend)
    dtype = "bfloat16" if backend == "torch" else "float16"
    _check_parity(per_rank, "softmax-lowp", LOW_PRECISION_RTOL[dtype])
    losses = np.mean([result["softmax-lowp"]["ep"]["losses"] for result in per_rank], axis=0)
    assert not np.allclose(losses, per_rank[0]["softmax-lowp"]["reference"]["losses"],
                           rtol=FP32_RTOL, atol=0), "the low-precision policy did not apply"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_ep2_gradient_accumulation_matches_one_process(backend):
    """2 micro-batches per step, gradient sync in the last only."""
    _check_parity(shared_launch.results("expert_parallel_ep2_accumulate", backend),
                  "softmax-accumulate")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_a_rank_whose_experts_get_no_rows_trains_as_plain_fsdp(backend):
    """dp2 x ep2, rank 0's experts without rows while rank 2's (the same experts) compute:
    no rank waits for another, and each rank's losses and the parameters equal plain FSDP's
    on the same routing."""
    for rank, result in enumerate(shared_launch.results("expert_parallel_starved", backend)):
        _check_against_fsdp(rank, result["ep"], result["fsdp"])


@pytest.mark.timeout(120)
def test_mindspore_slice_of_an_empty_tensor_has_no_gradient():
    """The MindSpore limit docs/expert-parallel.md names: the gradient of a slice of an
    empty tensor fails on CPU (the test models build an empty expert's product from
    ``mint.zeros`` instead). Fails once MindSpore fixes it, so the doc can drop the note."""
    ms = pytest.importorskip("mindspore")
    from mindspore import mint

    weight = ms.Parameter(ms.Tensor(np.ones((4, 4), np.float32)), name="weight")

    def loss(x):
        empty = mint.matmul(x, weight)[0:0]
        return (mint.matmul(empty[0:0], weight) ** 2).sum() + mint.matmul(x, weight).sum()

    with pytest.raises(RuntimeError, match="StridedSliceGrad"):
        ms.value_and_grad(loss, None, [weight])(ms.Tensor(np.ones((2, 4), np.float32)))
