"""State dicts, export and checkpoints of the core's tensor parallelism, and checkpoints
moved between frameworks and layouts (rank side: tests/core_tp_checkpoint_scenarios.py).

The language model of tests/core_tp_models.py under torchtitan's sequence-parallel plan,
AdamW; MindSpore's names stored as torch's (``hp.torch_nn_names``). Jobs in the
suite's shared launches:

- tp2 (2 ranks, the core's styles alone; MindSpore, and torch under ``-m slow``): the
  sharded state dict gives each value's box of the whole tensor (the recorded layout)
  and its data; it and the full state dict (model and optimizer) load into a fresh model
  bitwise; the checkpoint loads into the one-process model and ``export_full``'s file
  into it, both bitwise the full state; a checkpoint whose whole shape differs is a named
  ``CheckpointError``, the model and optimizer unchanged;
- torch (dp=2, tp=2), 4 ranks: torch's DTensor tensor parallelism under ``hp.fully_shard``
  saves a checkpoint;
- MindSpore (dp=2, tp=2), 4 ranks, the core's styles under fully_shard, the model built
  under ``no_init_parameters()``: torch's checkpoint resumed (the whole values bitwise
  torch's; the next step's loss and parameters against torch's own next step); its own
  checkpoint, resumed here on torch at 1 rank; and tp2's checkpoint resumed under FSDP
  over 4 ranks without tensor parallelism; under ``-m slow``, an eager build resuming
  torch's checkpoint bitwise as the deferred one does, and state dicts and export under
  fully_shard as at tp2.

The MindSpore job needs the other two; it starts them first (``_after``). Without
processes: a ``ShardedValue`` in a block, its box and its layout record.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from hyper_parallel.checkpoint import ShardedValue
from tests import shared_launch
from tests.multirank import RankFailure

BACKENDS = ["torch", "mindspore"]
#: a resumed step against the same framework's own next step in another layout (float32
#: sums over split dims taken in another order; measured: 8.4e-8 for the loss, 1.3e-7 for
#: the parameters), as tests/test_core_tp_fully_shard.py
SAME_FRAMEWORK_LOSS_RTOL, SAME_FRAMEWORK_PARAM_ATOL = 1e-6, 2e-6
#: against the other framework's own next step: what the two frameworks' float32 kernels
#: agree to (measured: losses 3.3e-7 relative torch -> MindSpore, 3.9e-7 MindSpore ->
#: torch; parameters 2.4e-7 and 1.2e-7)
CROSS_FRAMEWORK_LOSS_RTOL, CROSS_FRAMEWORK_PARAM_ATOL = 1e-6, 1e-6
DIRECTORY = "core-tp-ckpt"


def _directory() -> str:
    return shared_launch.directory(DIRECTORY)


def _after() -> tuple:
    """The MindSpore 4-rank job's arguments, once the checkpoints it resumes exist: torch's
    (None without torch, or if its launch failed: the torch tests report that) and tp2's."""
    torch_saved = None
    if importlib.util.find_spec("torch") is not None:
        try:
            shared_launch.results("core_tp_checkpoints_torch", "torch")
            torch_saved = os.path.join(_directory(), "torch-dp2-tp2")
        except RankFailure:
            torch_saved = None
    shared_launch.results("core_tp_checkpoints_tp2", "mindspore")
    return _directory(), torch_saved, os.path.join(_directory(), "tp2-mindspore")


shared_launch.register(__name__, "core_tp_checkpoints_tp2", 2,
                       "tests.core_tp_checkpoint_scenarios:tp2_run",
                       lambda backend: (backend, _directory()), backends=("mindspore",),
                       timeout_s=300)
# the core's styles on torch: the same code as MindSpore's run above
shared_launch.register(__name__, "core_tp_checkpoints_tp2_torch", 2,
                       "tests.core_tp_checkpoint_scenarios:tp2_run",
                       lambda backend: (backend, _directory()), backends=("torch",),
                       timeout_s=300, slow=True)
shared_launch.register(__name__, "core_tp_checkpoints_torch", 4,
                       "tests.core_tp_checkpoint_scenarios:torch_dp2_tp2_save",
                       lambda backend: (_directory(),), backends=("torch",), timeout_s=120)
shared_launch.register(__name__, "core_tp_checkpoints_mindspore", 4,
                       "tests.core_tp_checkpoint_scenarios:mindspore_dp2_tp2_run",
                       lambda backend: _after(), backends=("mindspore",), timeout_s=600)
# an eager build resuming the same checkpoint, its state dicts and export under fully_shard:
# the default run covers them at tp2 (above), in tests/test_core_tp_fully_shard.py (the
# eager build's checkpoint, full state dict and export at dp2 x tp2) and with the
# no_init_parameters build resuming torch's checkpoint
shared_launch.register(__name__, "core_tp_checkpoints_mindspore_eager", 4,
                       "tests.core_tp_checkpoint_scenarios:mindspore_dp2_tp2_eager",
                       lambda backend: _after()[:2], backends=("mindspore",), timeout_s=600,
                       slow=True)


def _mindspore(key: str = "core_tp_checkpoints_mindspore") -> list:
    if importlib.util.find_spec("mindspore") is None:
        pytest.skip("these checkpoints are MindSpore's tensor parallelism (the core's styles), "
                    "and MindSpore is not installed")
    return shared_launch.results(key, "mindspore")


def _torch_saved() -> list:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("the checkpoint crosses from torch, which is not installed")
    return shared_launch.results("core_tp_checkpoints_torch", "torch")


def _tp2(backend: str) -> list:
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    return shared_launch.results("core_tp_checkpoints_tp2" if backend == "mindspore"
                                 else "core_tp_checkpoints_tp2_torch", backend)


#: the tp2 cases on each framework; torch's under ``-m slow`` (the same core code)
TP2_BACKENDS = ["mindspore", pytest.param("torch", marks=pytest.mark.slow)]


def _equal(got: dict, expected: dict, what: str, keys=None) -> None:
    keys = sorted(expected) if keys is None else keys
    for key in keys:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{what}: {key}")


def _model_keys(values: dict) -> list:
    return sorted(k for k in values if not k.startswith("optim."))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def _check_state_dicts(per_rank: list, layouts_of) -> None:
    """Each rank's sharded values are the boxes of the whole values its layouts name, and
    both state dicts load into a fresh run bitwise."""
    for rank, result in enumerate(per_rank):
        state = result["state_dicts"]
        full = state["full"]
        assert any(k.startswith("optim.") for k in full), sorted(full)
        assert any(not np.array_equal(state["fresh_before"][k], full[k]) for k in full), \
            f"rank {rank}: the fresh run is not fresh"
        for source in ("from_sharded", "from_full"):
            assert sorted(state[source]) == sorted(full)
            _equal(state[source], full, f"rank {rank}, {source}")
        for key, ((offsets, shape), data) in state["boxes"].items():
            np.testing.assert_array_equal(
                data, full[key][tuple(slice(o, o + n) for o, n in zip(offsets, shape))],
                err_msg=f"rank {rank}: the box of {key}")
        for name, expected in layouts_of(rank).items():
            offsets, shape = state["boxes"][name][0]
            assert shape == expected["shape"] and offsets == expected["offset"], \
                f"rank {rank}: {name} at {offsets} {shape}, expected {expected}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", TP2_BACKENDS)
def test_tp2_state_dicts_give_boxes_of_the_whole_and_load_back(backend):
    per_rank = _tp2(backend)

    def layouts_of(rank):
        return {name: {"offset": layout["offset"],
                       "shape": per_rank[rank]["state_dicts"]["boxes"][name][1].shape}
                for name, layout in per_rank[rank]["layouts"].items() if layout is not None}

    _check_state_dicts(per_rank, layouts_of)
    head = per_rank[1]["layouts"]["head.weight"]
    assert head["whole_shape"] == (16, 8) and head["offset"] == (8, 0), head


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", TP2_BACKENDS)
def test_tp2_checkpoint_and_export_load_into_one_process(backend):
    per_rank = _tp2(backend)
    saved = per_rank[0]["saved"]
    for rank, result in enumerate(per_rank):
        _equal(result["saved"], saved, f"rank {rank}: the full state differs between ranks")
        assert sorted(result["plain_loaded"]) == sorted(saved)
        _equal(result["plain_loaded"], saved, f"rank {rank}: checkpoint into one process")
    exported = per_rank[0]["export"]
    assert sorted(exported) == _model_keys(saved)
    _equal(exported, saved, "export_full", _model_keys(saved))
    _equal(per_rank[0]["export_in_plain"], exported, "the export in one process's model")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", TP2_BACKENDS)
def test_a_checkpoint_of_another_whole_shape_is_refused_unchanged(backend):
    for rank, result in enumerate(_tp2(backend)):
        refused = result["other_whole_shape"]
        error = refused["error"] or ""
        assert "'head.weight' has shape (32, 8)" in error and "(16, 8)" in error, \
            f"rank {rank}: {refused}"
        assert refused["unchanged"], f"rank {rank}: the model or optimizer changed"


@pytest.mark.timeout(900)
def test_torch_dp2_tp2_checkpoint_resumes_on_mindspore_dp2_tp2():
    """Into the core's styles under fully_shard, the model built under
    ``no_init_parameters()``."""
    torch_runs = _torch_saved()
    per_rank = _mindspore()
    assert per_rank[1]["from_torch"]["loss"] == per_rank[0]["from_torch"]["loss"]  # a tp pair
    moved = {"loaded": per_rank[0]["from_torch"]["loaded"],
             "loss": np.mean([per_rank[r]["from_torch"]["loss"] for r in (0, 2)]),  # dp rows
             "after": per_rank[0]["from_torch"]["after"]}
    _check_moved(moved, torch_runs, "torch's checkpoint on MindSpore", cross_framework=True)
    for rank, result in enumerate(per_rank[1:], start=1):
        _equal(result["from_torch"]["loaded"], torch_runs[0]["saved"], f"rank {rank}: loaded")


def _check_moved(moved: dict, saving_runs: list, what: str, cross_framework: bool,
                 model_only: bool = False) -> None:
    """A checkpoint moved to another layout or framework: ``moved["loaded"]`` holds the
    saved values exactly; the next step's loss (mean over the saving run's dp rows, ranks 0
    and 2) and parameters are within the measured tolerances of the saving run's own.
    ``model_only``: the loaded values are the model's (no optimizer state)."""
    saved = saving_runs[0]["saved"]
    keys = _model_keys(saved) if model_only else sorted(saved)
    assert sorted(moved["loaded"]) == keys, what
    _equal(moved["loaded"], saved, f"{what}: loaded", keys)
    rtol, atol = ((CROSS_FRAMEWORK_LOSS_RTOL, CROSS_FRAMEWORK_PARAM_ATOL) if cross_framework
                  else (SAME_FRAMEWORK_LOSS_RTOL, SAME_FRAMEWORK_PARAM_ATOL))
    rows = [saving_runs[r]["next_loss"] for r in (0, 2) if r < len(saving_runs)]
    diff = _rel(moved["loss"], np.mean(rows))
    assert diff <= rtol, f"{what}: the next loss against the saving run's own: {diff:.2e}"
    for key in sorted(saving_runs[0]["after_next"]):
        np.testing.assert_allclose(moved["after"][key], saving_runs[0]["after_next"][key],
                                   rtol=0, atol=atol, err_msg=f"{what}: after the step: {key}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_no_init_parameters_build_resumes_as_the_eager_build():
    """The default run resumes torch's checkpoint into a model built under
    ``no_init_parameters()``; an eager build resumes it bitwise the same."""
    lazy_runs = _mindspore()
    for rank, eager in enumerate(_mindspore("core_tp_checkpoints_mindspore_eager")):
        lazy, eager = lazy_runs[rank]["from_torch"], eager["from_torch"]
        _equal(lazy["loaded"], eager["loaded"], f"rank {rank}: loaded")
        assert lazy["loss"] == eager["loss"], f"rank {rank}"
        _equal(lazy["after"], eager["after"], f"rank {rank}: after one step")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mindspore_dp2_tp2_state_dicts_under_fully_shard():
    per_rank = _mindspore("core_tp_checkpoints_mindspore_eager")
    layouts = _tp2("mindspore")

    def layouts_of(rank):
        """The dp shard's rows (dim 0) inside the tp block of ``rank``'s tp index."""
        dp, tp = divmod(rank, 2)
        out = {}
        for name, layout in layouts[tp]["layouts"].items():
            if layout is None:
                continue
            shape = list(layouts[tp]["state_dicts"]["boxes"][name][1].shape)
            rows = shape[0] // 2
            offset = list(layout["offset"])
            offset[0] += dp * rows
            out[name] = {"offset": tuple(offset), "shape": (rows, *shape[1:])}
        return out

    _check_state_dicts(per_rank, layouts_of)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mindspore_dp2_tp2_export_loads_into_one_process():
    per_rank = _mindspore("core_tp_checkpoints_mindspore_eager")
    full = per_rank[0]["state_dicts"]["full"]
    exported = per_rank[0]["export"]
    assert sorted(exported) == _model_keys(full)
    _equal(exported, full, "export_full", _model_keys(full))
    _equal(per_rank[0]["export_in_plain"], exported, "the export in one process's model")


@pytest.mark.timeout(900)
def test_mindspore_tp2_checkpoint_resumes_under_fsdp_over_4_ranks():
    tp2 = _tp2("mindspore")
    for rank, result in enumerate(_mindspore()):
        _check_moved(result["fsdp4_from_tp2"], tp2, f"rank {rank}", cross_framework=False)


@pytest.mark.timeout(900)
def test_mindspore_dp2_tp2_checkpoint_resumes_on_torch_at_one_rank(monkeypatch):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    per_rank = _mindspore()
    monkeypatch.setenv("HP_BACKEND", "torch")
    import torch
    import torch.nn.functional as F

    import hyper_parallel as hp
    from tests.core_tp_checkpoint_scenarios import AFTER, KEYS
    from tests.core_tp_fsdp_scenarios import LR
    from tests.core_tp_models import targets_for, torch_model

    model = torch_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR["adamw"], foreach=False)
    hp.load_checkpoint(os.path.join(_directory(), "mindspore-dp2-tp2"), model, opt, key_map=KEYS)
    loaded = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    ids, targets = AFTER
    loss = F.cross_entropy(model(torch.from_numpy(ids)),
                           torch.from_numpy(targets_for(targets, "replicated", 2)))
    loss.backward()
    opt.step()
    moved = {"loaded": loaded, "loss": float(loss.detach()),
             "after": {n: p.detach().numpy() for n, p in model.named_parameters()}}
    _check_moved(moved, per_rank, "MindSpore's checkpoint on torch", cross_framework=True,
                 model_only=True)


def test_a_sharded_value_in_a_block_keeps_its_box_through_its_layout_record():
    """A data-parallel shard inside a tensor-parallel block: rows 2-3 of the block that
    starts at (0, 8) of a (4, 16) tensor; its JSON-able record builds it back."""
    value = ShardedValue(None, (4, 16), 0, 2, 2, ((0, 8), (4, 8)))
    assert value.box() == ((2, 8), (2, 8))
    back = ShardedValue.from_layout(json.loads(json.dumps(value.layout())))
    assert back == value and back.box() == value.box()
    whole = ShardedValue(None, (4, 16), None, 0, 4, ((0, 8), (4, 8)))
    assert whole.box() == ((0, 8), (4, 8))
