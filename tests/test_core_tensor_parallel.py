"""The core's tensor parallelism (hyper_parallel.tensor_parallel) on both frameworks.

One shared 2-rank launch per backend (tests/core_tp_scenarios.py) trains the small
language model of tests/core_tp_models.py under three plans (replicated activations;
torchtitan's sequence-parallel plan with loss parallelism; the remaining layout moves) and
two optimizers (SGD, AdamW); under ``-m slow`` a 4-rank launch trains the last two over
``mesh["tp"]`` of a 2x2 (dp, tp) mesh:

- torch: the core's styles against torch's own DTensor tensor parallelism on the same
  model, init and data: losses, every gradient of the first step and every parameter after
  each step are bitwise equal (each rank's local blocks);
- MindSpore: the core's styles at tp2 against the same model trained whole in one process:
  losses within 1e-6 relative and parameters within 5e-6 (measured: at most 8.5e-8 and
  2.4e-7 after 3 steps: float32 sums over split dims taken in another order);
- on both: the layout recorded on each parameter and the collectives one step issues
  (derived from the plan below). fully_shard, clip_grad_norm_ and checkpoints over it:
  tests/test_core_tp_fully_shard.py; state dicts, export and checkpoints of the model
  split alone and under fully_shard, and checkpoints moved between frameworks and
  layouts: tests/test_core_tp_checkpoints.py.

Bad plans fail in ``parallelize_module``'s checks, before any collective, so they run here
in the test process on a mesh without groups, each shown to leave the model unchanged.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests import shared_launch
from tests.core_tp_models import DIM, HIDDEN, VOCAB

BACKENDS = ["torch", "mindspore"]
RUNS = [f"{plan}-{kind}" for plan in ("replicated", "sequence", "layouts")
        for kind in ("sgd", "adamw")]
TP = 2
LOSS_RTOL, PARAM_ATOL = 1e-6, 5e-6

shared_launch.register(__name__, "core_tensor_parallel", TP, "tests.core_tp_scenarios:run_all",
                       lambda backend: (backend,), timeout_s=400)
# the same over mesh["tp"] of a 2x2 (dp, tp) mesh: tensor-parallel groups that are not the
# world (MindSpore CPU: list all-gathers, and the two-rank reduce-scatter as an exchange)
shared_launch.register(__name__, "core_tensor_parallel_in_dp_tp", 2 * TP,
                       "tests.core_tp_scenarios:run_all",
                       lambda backend: (backend, 2, ("sequence", "layouts")),
                       timeout_s=900, slow=True)


def _runs(backend: str, run: str, key: str = "core_tensor_parallel") -> list:
    return [per_rank[run] for per_rank in shared_launch.results(key, backend)]


def _assembled(per_rank: list, step: int) -> dict:
    """The whole parameters after ``step``, from each rank's block and recorded layout."""
    whole = {}
    for name, layout in per_rank[0]["core"]["layouts"].items():
        if layout is None or layout["placement"] == "Replicate()":
            whole[name] = per_rank[0]["core"]["params"][step][name]
            continue
        values = np.full(layout["whole_shape"], np.nan, np.float32)
        for result in per_rank:
            block = result["core"]["params"][step][name]
            offset = result["core"]["layouts"][name]["offset"]
            values[tuple(slice(o, o + n) for o, n in zip(offset, block.shape))] = block
        whole[name] = values
    return whole


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", RUNS)
def test_torch_core_styles_equal_torch_dtensor_bitwise(run):
    _check_torch_against_dtensor(_runs("torch", run))


def _check_torch_against_dtensor(per_rank: list) -> None:
    for rank, result in enumerate(per_rank):
        ours, torch_tp = result["core"], result["torch"]
        assert ours["losses"] == torch_tp["losses"], f"rank {rank}: losses"
        assert ours["grads"].keys() == torch_tp["grads"].keys()
        for name, grad in torch_tp["grads"].items():
            np.testing.assert_array_equal(ours["grads"][name], grad,
                                          err_msg=f"rank {rank}: gradient of {name}")
        for step, params in enumerate(torch_tp["params"]):
            for name, value in params.items():
                np.testing.assert_array_equal(ours["params"][step][name], value,
                                              err_msg=f"rank {rank}, step {step}: {name}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", RUNS)
def test_mindspore_tp2_matches_one_process(run):
    _check_mindspore_against_one_process(_runs("mindspore", run))


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("run", [r for r in RUNS if not r.startswith("replicated")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_over_the_tp_dim_of_a_dp_tp_mesh(backend, run):
    """mesh["tp"] of a 2x2 mesh: each tensor-parallel pair (ranks 0-1, 2-3) trains as the
    2-rank world does: bitwise equal to torch's DTensor TP, within the tolerances of
    MindSpore's one-process reference."""
    per_rank = _runs(backend, run, "core_tensor_parallel_in_dp_tp")
    for pair in (per_rank[:TP], per_rank[TP:]):
        if backend == "torch":
            _check_torch_against_dtensor(pair)
        else:
            _check_mindspore_against_one_process(pair)


def _check_mindspore_against_one_process(per_rank: list) -> None:
    reference = per_rank[0]["reference"]
    for rank, result in enumerate(per_rank):
        np.testing.assert_allclose(result["core"]["losses"], reference["losses"],
                                   rtol=LOSS_RTOL, atol=0, err_msg=f"rank {rank}")
    for step, expected in enumerate(reference["params"]):
        whole = _assembled(per_rank, step)
        assert whole.keys() == expected.keys()
        for name, value in expected.items():
            np.testing.assert_allclose(whole[name], value, rtol=0, atol=PARAM_ATOL,
                                       err_msg=f"step {step}: {name}")


def _expected_layouts(backend: str, plan: str, rank: int) -> dict:
    """Each parameter's recorded layout under ``plan`` on ``rank`` (None: not recorded)."""
    def shard(dim, shape):
        offset = [0] * len(shape)
        offset[dim] = rank * shape[dim] // TP
        return {"placement": f"Shard(dim={dim})", "whole_shape": shape, "offset": tuple(offset)}

    def replicate(shape):
        return {"placement": "Replicate()", "whole_shape": shape, "offset": (0,) * len(shape)}

    # column-wise under the layouts plan on torch, vocabulary-parallel everywhere else
    embed_dim = 1 if plan == "layouts" and backend == "torch" else 0
    expected = {"embed.weight": shard(embed_dim, (VOCAB, DIM)),
                "head.weight": shard(0, (VOCAB, DIM)),
                "attn.wk.weight": shard(0, (DIM, DIM)), "attn.wo.weight": shard(1, (DIM, DIM)),
                "attn.wo.bias": replicate((DIM,)), "ffn.w1.weight": shard(0, (HIDDEN, DIM)),
                "ffn.w1.bias": shard(0, (HIDDEN,)), "ffn.w2.weight": shard(1, (DIM, HIDDEN)),
                "ffn.w2.bias": replicate((DIM,))}
    for name in ("wq", "wv"):
        expected[f"attn.{name}.weight"] = shard(0, (DIM, DIM))
        expected[f"attn.{name}.bias"] = shard(0, (DIM,))
    for norm in ("attn_norm", "ffn_norm", "norm"):
        for attr in ("weight", "bias"):
            expected[f"{norm}.{attr}"] = replicate((DIM,)) if plan == "sequence" else None
    return expected


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_parameter_records_its_layout(backend, run):
    for rank, result in enumerate(_runs(backend, run)):
        layouts = {name: (None if layout is None else dict(layout, whole_shape=tuple(
            layout["whole_shape"]), offset=tuple(layout["offset"])))
            for name, layout in result["core"]["layouts"].items()}
        assert layouts == _expected_layouts(backend, run.split("-")[0], rank), f"rank {rank}"


# The collectives of one training step (forward and backward) over the tensor-parallel dim,
# from the plan (tests/core_tp_models.py):
_REPLICATED_STEP = {
    # a column-wise layer's replicated input sums its gradient in backward (wq, wk, wv,
    # w1, head); a row-wise output is all-reduced (embed, wo, w2)
    "all_reduce": len(["wq", "wk", "wv", "w1", "head"]) + len(["embed", "wo", "w2"]),
    "all_gather": len(["head output gathered on the class dim"]),
    "reduce_scatter": 0,
}
_SEQUENCE_STEP = {
    # forward: inputs gathered on the sequence (attn, ffn; head on its rows); backward:
    # the row-wise outputs' gradients gathered back (embed, wo, w2)
    "all_gather": len(["attn", "ffn", "head"]) + len(["embed", "wo", "w2"]),
    # forward: row-wise outputs scattered on the sequence; backward: the gathered inputs'
    # partial gradients
    "reduce_scatter": len(["embed", "wo", "w2"]) + len(["attn", "ffn", "head"]),
    # backward: each norm parameter's gradient summed; the loss: max, sum of
    # exponentials, target log-probability
    "all_reduce": 2 * len(["attn_norm", "ffn_norm", "norm"]) + 3,
}


_LAYOUTS_STEP = {
    # forward: the embedding's and the head's outputs gathered on the class dim, the
    # split sequence gathered for w1, the batch-split rows for the head; backward: the
    # ffn's and the norm's splits gathered back
    "all_gather": len(["embed", "head output", "w1 input", "head input"])
    + len(["ffn input", "norm output"]),
    # backward: the partial gradients of the inputs gathered for w1 and the head
    "reduce_scatter": len(["w1 input", "head input"]),
    # forward: wo and w2 reduced; backward: the attention's replicated input, and wo's
    # replicated output kept as a layout tensor (its consumers' gradients are partial)
    "all_reduce": len(["wo", "w2"]) + len(["attn input", "wo output"]),
}
# MindSpore's layouts plan keeps the embedding vocabulary-parallel: reduced, not gathered
_LAYOUTS_STEP_MINDSPORE = dict(_LAYOUTS_STEP, all_gather=_LAYOUTS_STEP["all_gather"] - 1,
                               all_reduce=_LAYOUTS_STEP["all_reduce"] + 1)
_STEPS = {"replicated": _REPLICATED_STEP, "sequence": _SEQUENCE_STEP, "layouts": _LAYOUTS_STEP}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_step_issues_the_collectives_the_plan_implies(backend, run):
    expected = _STEPS[run.split("-")[0]]
    if backend == "mindspore" and run.startswith("layouts"):
        expected = _LAYOUTS_STEP_MINDSPORE
    for rank, result in enumerate(_runs(backend, run)):
        assert result["core"]["calls"] == expected, f"rank {rank}"


# (plan, expected error, what it names); every plan starts with a valid entry ("fc"), which
# must not have been applied either
BAD_PLANS = {
    "key_matching_no_submodule": (lambda tp: {"fc": tp.ColwiseParallel(),
                                              "blocks.*.fc": tp.ColwiseParallel()},
                                  KeyError, "plan key 'blocks.*.fc' matches no submodule"),
    "convolution": (lambda tp: {"fc": tp.ColwiseParallel(), "conv": tp.RowwiseParallel()},
                    NotImplementedError, "splits linear and embedding layers only"),
    "layer_without_weight": (lambda tp: {"fc": tp.ColwiseParallel(), "act": tp.ColwiseParallel()},
                             NotImplementedError, "splits linear and embedding layers only"),
    "uneven_split": (lambda tp: {"fc": tp.ColwiseParallel(), "odd": tp.ColwiseParallel()},
                     ValueError, "does not split evenly over 2 ranks"),
    "sharded_ids": (lambda tp: {"fc": tp.ColwiseParallel(),
                                "embed": tp.RowwiseParallel(input_layouts=tp.Shard(0))},
                    NotImplementedError, "on an embedding takes replicated ids"),
    "one_module_two_styles": (lambda tp: {"fc": tp.ColwiseParallel(), "f*": tp.RowwiseParallel()},
                              ValueError, "is named by plan keys 'fc' and 'f*'"),
    "mesh_not_1d": (lambda tp: {"fc": tp.ColwiseParallel()}, ValueError, "takes a 1-D mesh"),
    "tied_weight": (lambda tp: {"fc": tp.ColwiseParallel(),
                                "embed": tp.RowwiseParallel(input_layouts=tp.Replicate()),
                                "head": tp.ColwiseParallel()},
                    ValueError, "a parameter shared by ["),
    # its activation would act on a row-wise split's partial sums; the error says so
    "dense_with_activation_mindspore": (
        lambda tp: {"fc": tp.ColwiseParallel(), "dense_relu": tp.RowwiseParallel()},
        NotImplementedError, "its activation (ReLU) runs inside the layer"),
    # MindSpore's nn.Embedding reshapes its output by the embedding size it stored
    "embedding_dim_split_mindspore": (
        lambda tp: {"fc": tp.ColwiseParallel(), "embed": tp.ColwiseParallel()},
        NotImplementedError, "its forward computes only with dims (0,) split"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(BAD_PLANS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_plan_is_a_named_error_and_changes_nothing(monkeypatch, backend, case):
    if case.endswith("_mindspore") and backend != "mindspore":
        pytest.skip("a MindSpore layer's own limit: torch's nn.Embedding computes with either "
                    "dim split, and torch's nn.Linear has no activation inside")
    monkeypatch.setenv("HP_BACKEND", backend)
    import hyper_parallel as hp
    from hyper_parallel import tensor_parallel as tp
    from tests.core_tp_models import bad_input_model, forward_hook_count

    platform = hp.get_platform()
    model = bad_input_model(backend)
    shape, names = ((2, 1), ("tp", "dp")) if case == "mesh_not_1d" else ((2,), ("tp",))
    mesh = hp.DeviceMesh("cpu", shape, names, [None] * len(shape))  # no groups: no collective

    def state():
        return [(name, attr, id(param), platform.to_numpy(param).tobytes(),
                 tp.tensor_parallel_layout(param), forward_hook_count(backend, sub))
                for name, sub in platform.named_modules(model)
                for attr, param in platform.direct_params(sub)]

    before = state()
    make_plan, error, message = BAD_PLANS[case]
    with pytest.raises(error) as raised:
        tp.parallelize_module(model, mesh, make_plan(tp))
    assert message in str(raised.value)
    assert state() == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_public_names_are_the_cores_on_every_framework(monkeypatch, backend):
    """One surface: hp's tensor-parallel names are the same objects whatever HP_BACKEND
    says, so a script written with them moves between the frameworks."""
    import hyper_parallel as hp
    from hyper_parallel import tensor_parallel as core_tp

    monkeypatch.setenv("HP_BACKEND", backend)
    for name in ("parallelize_module", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
                 "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput",
                 "loss_parallel", "cross_entropy", "Shard", "Replicate"):
        assert getattr(hp, name) is getattr(core_tp, name), name
        assert name in hp.__all__, name


def test_the_core_package_imports_no_framework():
    from pathlib import Path

    import hyper_parallel.tensor_parallel as core_tp

    for path in Path(core_tp.__file__).parent.glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            assert not (words[:1] in (["import"], ["from"]) and len(words) > 1 and
                        words[1].split(".")[0] in ("torch", "mindspore")), f"{path.name}: {line}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layout_tensor_has_the_whole_shape_and_its_gradient_convention(monkeypatch, backend):
    """``shape`` is the whole tensor's; ``to_local()`` of a replicated LayoutTensor hands
    its producer a partial gradient (the whole one / n, summed back over the ranks), of a
    sharded one the gradient as it is. Neither needs a collective."""
    monkeypatch.setenv("HP_BACKEND", backend)
    import hyper_parallel as hp
    from hyper_parallel import tensor_parallel as tp

    platform = hp.get_platform()
    mesh = hp.DeviceMesh("cpu", (TP,), ("tp",), [None])
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert tp.LayoutTensor(platform.from_numpy(values), tp.Shard(1), mesh).shape == (2, 6)
    assert tp.LayoutTensor(platform.from_numpy(values), tp.Replicate(), mesh).shape == (2, 3)
    for placement, expected in ((tp.Replicate(), 1.0 / TP), (tp.Shard(0), 1.0)):
        def local_sum(x):
            return tp.LayoutTensor(x, placement, mesh).to_local().sum()

        if backend == "torch":
            import torch

            x = torch.from_numpy(values).requires_grad_(True)
            local_sum(x).backward()
            grad = x.grad.numpy()
        else:
            import mindspore as ms

            grad = ms.grad(local_sum)(ms.Tensor(values)).asnumpy()
        np.testing.assert_array_equal(grad, np.full_like(values, expected), err_msg=repr(placement))
