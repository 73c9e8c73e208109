"""hp.pipelining.pipeline_module_split and generate_llm_fqn_per_model_part (torchtitan's),
in one process on both frameworks, on examples/one_script's transformer with four blocks.

On a one-rank pp mesh an interleaved schedule puts every stage on this rank: the parts,
run in turn, give the whole model's loss and gradients, under the whole model's names.
The multi-rank runs train split models against one process (tests/test_pipelining.py's
3-D runs, docs/pipelining.md's usage block). Deferred: only the parts materialised get values. Bad input is named
before anything changes.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from tests.tolerance import FP32_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
NAMES = dict(input_modules=("embed",), layers="blocks", output_modules=("norm", "head"))


def _setup(monkeypatch, backend):
    monkeypatch.setenv("HP_BACKEND", backend)
    import hyper_parallel as hp
    from examples.one_script import train as script

    monkeypatch.setitem(script.SIZES, "layers", 4)
    framework = importlib.import_module(f"examples.one_script.model_{backend}")
    mesh = hp.DeviceMesh("cpu", (1,), ("pp",), [None])  # one rank: no group, no collective
    return hp, script, framework, mesh


def _params(hp, module) -> dict:
    """``{whole-model name: parameter}``."""
    p = hp.get_platform()
    return {f"{m}.{a}" if m else a: q for m, sub in p.named_modules(module)
            for a, q in p.direct_params(sub)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_parts_keep_the_whole_models_names_and_train_as_it(monkeypatch, backend):
    hp, script, framework, mesh = _setup(monkeypatch, backend)
    p = hp.get_platform()
    whole = framework.build(script.initial_values(), **script.SIZES)
    modules_before = [n for n, _ in p.named_modules(whole)]
    names = hp.pipelining.generate_llm_fqn_per_model_part(2, 4, **NAMES)
    stages, parts = hp.pipelining.pipeline_module_split(whole, mesh, "Interleaved1F1B",
                                                        "cpu", names)
    assert [s.stage_index for s in stages] == [0, 1]
    keys = [set(_params(hp, part)) for part in parts]
    assert not keys[0] & keys[1] and keys[0] | keys[1] == set(_params(hp, whole))
    blocks = [{k.split(".")[1] for k in part_keys if k.startswith("blocks.")}
              for part_keys in keys]
    assert blocks == [{"0", "1"}, {"2", "3"}], blocks  # not renumbered
    # a stage without layers keeps an empty list of them (torchtitan's), and runs
    first, *_ = hp.pipelining.pipeline_module_split(
        whole, mesh, "Interleaved1F1B", "cpu", [["embed"], ["blocks"], ["norm", "head"]])[1]
    assert len(first.blocks) == 0 and first.head is None
    assert [n for n, _ in p.named_modules(whole)] == modules_before

    # the parts in turn compute the whole model's loss and gradients
    tokens = script.batches(1)[0]
    ids, targets = p.from_numpy(tokens[:, :-1]), p.from_numpy(tokens[:, 1:])
    vocab = script.SIZES["vocab"]
    loss, grads = _loss_and_grads(hp, backend, lambda i: parts[1](parts[0](i)),
                                  _params(hp, whole), ids, targets, vocab)
    reference = framework.build(script.initial_values(), **script.SIZES)
    ref_loss, ref_grads = _loss_and_grads(hp, backend, reference, _params(hp, reference),
                                          ids, targets, vocab)
    assert_close(loss, ref_loss, FP32_RTOL)
    assert sorted(grads) == sorted(ref_grads)
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], FP32_RTOL, err_msg=name)


def _loss_and_grads(hp, backend, forward, params: dict, ids, targets, vocab) -> tuple:
    """The cross-entropy of ``forward(ids)`` and ``{name: its gradient}`` for ``params``."""
    p = hp.get_platform()

    def loss_fn():
        return hp.cross_entropy(forward(ids).reshape(-1, vocab), targets.reshape(-1))

    if backend == "torch":
        loss = loss_fn()
        loss.backward()
        return float(loss.detach()), {k: q.grad.numpy() for k, q in params.items()}
    import mindspore as ms

    names = list(params)
    loss, grads = ms.value_and_grad(loss_fn, None, [params[k] for k in names])()
    return float(p.to_numpy(loss)), {k: p.to_numpy(g) for k, g in zip(names, grads)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_deferred_whole_model_materialises_one_part(monkeypatch, backend):
    """The whole model built without values; stage 1's part given its values: the other
    stage's parameters stay without."""
    hp, script, framework, mesh = _setup(monkeypatch, backend)
    if backend == "torch":
        import torch

        with torch.device("meta"):
            whole = framework.Transformer(**script.SIZES)
        deferred = lambda q: q.is_meta  # noqa: E731
    else:
        from mindspore.nn.utils import no_init_parameters

        with no_init_parameters():
            whole = framework.Transformer(**script.SIZES)
        deferred = lambda q: q.has_init  # noqa: E731
    names = hp.pipelining.generate_llm_fqn_per_model_part(2, 4, **NAMES)
    _, parts = hp.pipelining.pipeline_module_split(whole, mesh, "Interleaved1F1B", "cpu", names)
    if backend == "torch":
        parts[1].to_empty(device="cpu")
    else:
        parts[1].init_parameters_data()
    values = script.initial_values()
    native = hp.torch_nn_names if backend == "mindspore" else (lambda name: name)
    for key in hp.get_state_dict(parts[1]):
        hp.set_state_dict(parts[1], {key: values[native(key)]}, strict=False)
    mine = set(_params(hp, parts[1]))
    state = {k: not deferred(q) for k, q in _params(hp, whole).items()}
    assert {k for k, done in state.items() if done} == mine
    for key, q in _params(hp, parts[1]).items():
        assert np.array_equal(hp.get_platform().to_numpy(q), values[native(key)]), key


def test_llm_split_is_torchtitans():
    """torchtitan's spread: the input and output modules count as ``input_weight`` and
    ``output_weight`` layers, the first stages take one more where the count is uneven."""
    from hyper_parallel.pipelining import generate_llm_fqn_per_model_part as split

    layers = [f"layers.{i}" for i in range(8)]
    assert split(1, 2) == [["tok_embeddings", "layers.0", "layers.1", "norm", "output"]]
    assert split(2, 4) == [["tok_embeddings"] + layers[:2], layers[2:4] + ["norm", "output"]]
    assert split(4, 8) == [["tok_embeddings"] + layers[:2], layers[2:5], layers[5:7],
                           layers[7:8] + ["norm", "output"]]
    assert split(3, 4, input_weight=2, output_weight=0) == [
        ["tok_embeddings"], layers[:2], layers[2:4] + ["norm", "output"]]
    with pytest.raises(ValueError, match="more than the 4 layers"):
        split(5, 2)
    with pytest.raises(ValueError, match="input_weight 3 is more than the 2 layers"):
        split(3, 4, input_weight=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_split_is_named_before_anything_changes(monkeypatch, backend):
    hp, script, framework, mesh = _setup(monkeypatch, backend)
    p = hp.get_platform()
    whole = framework.build(script.initial_values(), **script.SIZES)
    before = {k: p.to_numpy(q).copy() for k, q in _params(hp, whole).items()}
    modules_before = [n for n, _ in p.named_modules(whole)]
    split = hp.pipelining.pipeline_module_split
    good = hp.pipelining.generate_llm_fqn_per_model_part(2, 4, **NAMES)
    with pytest.raises(ValueError, match="'blocks.7', which is not a module of the model"):
        split(whole, mesh, "Interleaved1F1B", "cpu", [good[0], good[1] + ["blocks.7"]])
    with pytest.raises(ValueError, match=r"'blocks' \(stage 1\) and 'blocks.0' \(stage 0\)"):
        split(whole, mesh, "Interleaved1F1B", "cpu", [good[0], good[1] + ["blocks"]])
    with pytest.raises(ValueError, match="2 lists of module names for a schedule of one "
                                         "stage per rank over a pp mesh of 1 ranks"):
        split(whole, mesh, "1F1B", "cpu", good)
    with pytest.raises(ValueError, match="1 lists of module names for an interleaved"):
        split(whole, mesh, hp.pipelining.ScheduleInterleaved1F1B, "cpu", [sum(good, [])])
    with pytest.raises(ValueError, match="pp_schedule 'ZBVZeroBubble' is not offered"):
        split(whole, mesh, "ZBVZeroBubble", "cpu", good)
    with pytest.raises(ValueError, match=r"parameters in no stage's modules: \['head"):
        split(whole, mesh, "Interleaved1F1B", "cpu", [good[0], good[1][:-1]])
    assert [n for n, _ in p.named_modules(whole)] == modules_before
    after = {k: p.to_numpy(q) for k, q in _params(hp, whole).items()}
    assert sorted(after) == sorted(before)
    assert all(np.array_equal(after[k], before[k]) for k in before)
