"""Portable sharded checkpoints (tests/checkpoint_scenarios.py): a run saved on torch at 2
ranks (FSDP) resumes at 1 rank on torch and at 2 ranks (HSDP 2x1) on MindSpore, and
MindSpore's checkpoint (written by the HSDP run) resumes on MindSpore FSDP and on torch at 1
rank; a rank killed mid-save leaves the previous checkpoint (corrupt, hostile and foreign
checkpoints, save targets that are not ours and pending asynchronous saves:
tests/test_checkpoint_safety.py, in the same launches). A second model, written with each
framework's own nn layers (Embedding, BatchNorm1d, LayerNorm), takes the same route through
``key_map=hp.torch_nn_names``, with its buffers and MindSpore's ``requires_grad=False``
moving statistics, and resumes on torch without the map (``num_batches_tracked`` included).
Four launches in all (torch 2, MindSpore 2, torch 2 crashing, torch 1:
tests/checkpoint_launches.py), each running both models' jobs. Regions, the rank that writes each, tensor
parallelism and meshes with a dim that is not data parallel: tests/test_checkpoint_layouts.py.

Same framework, the resumed loss curve continues the uninterrupted one to 1e-5 relative
(fp32). Across frameworks, to twice what the two frameworks' own single-process
references agree to over the same steps (measured in the run, reported on failure).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from hyper_parallel.checkpoint import CheckpointError
from tests.checkpoint_launches import checkpoint_dir, crashed, launch_crossing, \
    launch_resuming, launch_saving
from tests.checkpoint_scenarios import STEPS

SAME_FRAMEWORK_RTOL = 1e-5
BACKENDS = ["torch", "mindspore"]

def _mean(per_rank: list, key: str) -> np.ndarray:
    return np.mean([r[key] for r in per_rank], axis=0)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def _saved() -> list:
    return [r["lm"] for r in launch_saving()]


def _bn_saved() -> list:
    return [r["bn"] for r in launch_saving()]


def _crossed() -> list:
    return [r["lm"] for r in launch_crossing()]


def _bn_crossed() -> list:
    return [r["bn"] for r in launch_crossing()]


def _resumed_on_one() -> dict:
    return launch_resuming()["lm"]


def _uninterrupted_after_a() -> np.ndarray:
    return _mean(_saved(), "losses")[STEPS:]


def _cross_tolerance() -> float:
    """What torch's and MindSpore's single-process references agree to, doubled."""
    return 2 * _rel(_crossed()[0]["ref"], _saved()[0]["ref"])


@pytest.mark.timeout(600)
def test_resume_on_torch_at_one_rank():
    r = _resumed_on_one()
    assert r["extra"] == {"step": STEPS, "framework": "torch"}
    diff = _rel(r["resumed"], _uninterrupted_after_a())
    assert diff <= SAME_FRAMEWORK_RTOL, f"resumed at 1 rank differs by {diff:.2e}"


@pytest.mark.timeout(600)
def test_torch_checkpoint_resumes_on_mindspore():
    per_rank = _crossed()
    assert per_rank[0]["extra"] == {"step": STEPS, "framework": "torch"}
    tolerance = _cross_tolerance()
    diff = _rel(_mean(per_rank, "resumed"), _uninterrupted_after_a())
    assert diff <= tolerance, (f"MindSpore resumed from torch differs by {diff:.2e}; the "
                               f"references agree to {tolerance / 2:.2e}")


@pytest.mark.timeout(600)
def test_mindspore_resumes_its_own_checkpoint_resharded():
    per_rank = _crossed()
    diff = _rel(_mean(per_rank, "resumed_same"), _mean(per_rank, "after_save"))
    assert diff <= SAME_FRAMEWORK_RTOL, f"MindSpore resumed (2x1 -> 2) differs by {diff:.2e}"


@pytest.mark.timeout(600)
def test_mindspore_checkpoint_resumes_on_torch():
    tolerance = _cross_tolerance()
    diff = _rel(_resumed_on_one()["resumed_b"], _mean(_crossed(), "after_save"))
    assert diff <= tolerance, (f"torch resumed from MindSpore differs by {diff:.2e}; the "
                               f"references agree to {tolerance / 2:.2e}")


def _sgd(launch) -> list:
    return [r["sgd"] for r in launch]


@pytest.mark.timeout(600)
def test_sgd_momentum_resumes_at_one_rank_on_torch():
    """torch.optim.SGD(momentum=0.9) saved at 2 ranks, its momentum_buffer resharded to 1."""
    saved, r = _sgd(launch_saving()), launch_resuming()["sgd"]
    diff = _rel(r["resumed"], _mean(saved, "losses")[STEPS:])
    assert diff <= SAME_FRAMEWORK_RTOL, f"resumed at 1 rank differs by {diff:.2e}"


@pytest.mark.timeout(600)
def test_sgd_momentum_resumes_on_mindspore_resharded():
    per_rank = _sgd(launch_crossing())
    diff = _rel(_mean(per_rank, "resumed_same"), _mean(per_rank, "after_save"))
    assert diff <= SAME_FRAMEWORK_RTOL, f"MindSpore SGD resumed (2x1 -> 2) differs by {diff:.2e}"


@pytest.mark.timeout(600)
def test_sgd_momentum_moves_between_the_frameworks():
    """torch's momentum_buffer into MindSpore's accum (stat: stepped), and back."""
    saved, crossed = _sgd(launch_saving()), _sgd(launch_crossing())
    tolerance = 2 * _rel(crossed[0]["ref"], saved[0]["ref"])
    diff = _rel(_mean(crossed, "resumed"), _mean(saved, "losses")[STEPS:])
    assert diff <= tolerance, (f"MindSpore SGD resumed from torch differs by {diff:.2e}; the "
                               f"references agree to {tolerance / 2:.2e}")
    diff = _rel(launch_resuming()["sgd"]["resumed_b"], _mean(crossed, "after_save"))
    assert diff <= tolerance, (f"torch SGD resumed from MindSpore differs by {diff:.2e}; the "
                               f"references agree to {tolerance / 2:.2e}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("launch", ["torch", "mindspore"])
def test_any_optimizer_resumes_as_itself(launch):
    """Optimizers with other state than Adam's (torch: SGD without momentum, Adam with
    amsgrad, Adagrad, centered RMSprop with momentum; MindSpore: nn.SGD, nn.Momentum,
    nn.Adam with its own beta powers and global step, experimental Adam and Adagrad), each
    saved at 2 ranks and resumed into a fresh optimizer of its class."""
    per_rank = (launch_saving if launch == "torch" else launch_crossing)()
    curves = [r["optimizers"] for r in per_rank]
    for name in curves[0]:
        uninterrupted = np.mean([c[name][0] for c in curves], axis=0)
        resumed = np.mean([c[name][1] for c in curves], axis=0)
        diff = _rel(resumed, uninterrupted)
        assert diff <= SAME_FRAMEWORK_RTOL, f"{name} resumed differs by {diff:.2e}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("into", BACKENDS)
def test_optimizer_state_moved_across_is_the_targets_own(into):
    """Adam, AdamW (with and without amsgrad) and SGD (with and without momentum), saved on
    the other framework after STEPS steps and loaded into a fresh optimizer: its state has
    the names, dtypes, steps and options (param_groups) of the same optimizer after STEPS
    steps of its own (torch's AdamW without amsgrad gains no max_exp_avg_sq from
    MindSpore's, which keeps zeros there)."""
    per_rank = launch_crossing() if into == "mindspore" else [launch_resuming()]
    for rank, moves in enumerate(r["moves"] for r in per_rank):
        for name, state in moves.items():
            for part in ("per_param", "own", "groups"):
                assert state["loaded"][part] == state["own"][part], (
                    f"rank {rank}: {name}'s {part} loaded from the other framework: "
                    f"{state['loaded'][part][:2]}; after its own steps: {state['own'][part][:2]}")


def _bn_uninterrupted_after_a() -> np.ndarray:
    return np.asarray(_bn_saved()[0]["losses"][2 * STEPS:])  # a training and an eval loss per step


def _bn_cross_tolerance() -> float:
    return 2 * _rel(_bn_crossed()[0]["ref"], _bn_saved()[0]["ref"])


def _max_state_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float(np.max(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64))))
               for k in a)


@pytest.mark.timeout(600)
def test_batchnorm_buffers_resume_on_torch_at_one_rank():
    """torch's buffers (running statistics, the int64 0-dim num_batches_tracked) saved at 2
    ranks and restored at 1: the evaluation losses, which read them, continue too."""
    r = launch_resuming()["bn"]["native"]
    saved = _bn_saved()[0]
    assert sorted(r["buffers"]) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    assert int(r["buffers"]["bn.num_batches_tracked"]) == STEPS
    for name, value in saved["saved_buffers"].items():
        np.testing.assert_array_equal(r["buffers"][name], value, err_msg=name)
    diff = _rel(r["resumed"], _bn_uninterrupted_after_a())
    assert diff <= SAME_FRAMEWORK_RTOL, f"resumed at 1 rank differs by {diff:.2e}"
    assert _max_state_diff(r["final"], saved["final"]) <= 1e-6


@pytest.mark.timeout(600)
def test_batchnorm_moving_statistics_resume_on_mindspore_resharded():
    """MindSpore's requires_grad=False moving_mean/moving_variance, updated by training
    under fully_shard, saved from HSDP 2x1 and restored into FSDP 2."""
    for rank, r in enumerate(_bn_crossed()):
        diff = _rel(r["resumed_same"], r["after_save"])
        assert diff <= SAME_FRAMEWORK_RTOL, f"rank {rank}: resumed differs by {diff:.2e}"
        assert _max_state_diff(r["final_same"], r["final"]) <= 1e-6
        assert np.any(r["final"]["bn.running_mean"] != 0), "the moving mean never moved"


@pytest.mark.timeout(600)
def test_batchnorm_model_moves_from_torch_layers_to_mindspore_layers():
    """torch's nn.Embedding/BatchNorm1d/LayerNorm checkpoint, saved with
    key_map=hp.torch_nn_names, loaded into MindSpore's nn.Embedding/BatchNorm1d/LayerNorm
    (embedding_table, gamma/beta, moving_mean/moving_variance) with the same map."""
    saved, tolerance = _bn_saved()[0], _bn_cross_tolerance()
    for r in _bn_crossed():
        for name, value in r["loaded_buffers"].items():
            np.testing.assert_array_equal(value, saved["saved_buffers"][name], err_msg=name)
        diff = _rel(r["resumed"], _bn_uninterrupted_after_a())
        assert diff <= tolerance, (f"MindSpore resumed from torch differs by {diff:.2e}; the "
                                   f"references agree to {tolerance / 2:.2e}")


@pytest.mark.timeout(600)
def test_batchnorm_model_moves_from_mindspore_layers_to_torch_layers():
    r, tolerance = launch_resuming()["bn"], _bn_cross_tolerance()
    diff = _rel(r["from_mindspore"], _bn_crossed()[0]["after_save"])
    assert diff <= tolerance, (f"torch resumed from MindSpore differs by {diff:.2e}; the "
                               f"references agree to {tolerance / 2:.2e}")
    # through the map on the same framework: num_batches_tracked is left out, the rest is there
    assert int(r["mapped"]["buffers"]["bn.num_batches_tracked"]) == 0
    assert _rel(r["mapped"]["resumed"], _bn_uninterrupted_after_a()) <= SAME_FRAMEWORK_RTOL


@pytest.mark.timeout(600)
def test_crash_mid_save_leaves_previous_checkpoint():
    message = crashed()
    # rank 1 dies after writing its file; rank 0, waiting for it in the save's agreement,
    # may see the dead peer and fail first: then no rank was left to end
    assert ("rank 1 failed with exit code 17" in message
            or ("rank 0 failed" in message and "ended ranks []" in message)), message
    assert _resumed_on_one()["crashed"] == {"extra": {"checkpoint": "C"}, "initial": True}


@pytest.mark.timeout(600)
def test_rank_dying_in_an_async_write_leaves_previous_checkpoint():
    message = crashed("crash_async_run", "C-async")
    assert ("rank 1 failed with exit code 17" in message
            or ("rank 0 failed" in message and "ended ranks []" in message)), message
    assert launch_resuming()["crashed_async"] == {"extra": {"checkpoint": "C"}, "initial": True}
    assert os.path.isdir(checkpoint_dir("C-async") + ".saving")  # the unpublished write, cleared next save


@pytest.mark.timeout(600)
def test_bfloat16_stored_as_bf16_bit_for_bit():
    r = _resumed_on_one()["bf16"]
    assert r == {"equal": True, "dtypes": ["bfloat16"], "file_says_bf16": True}


def test_optimizer_state_without_counterpart_is_named():
    """A move between corresponding optimizers (torch SGD -> MindSpore SGD) converts the
    momentum and sets MindSpore's first-step flag; a state the table does not name is an
    error naming both optimizers and the state."""
    from hyper_parallel.checkpoint.optimizers import KINDS, _convert

    torch_sgd, ms_sgd = "torch.optim.sgd.SGD", "mindspore.experimental.optim.sgd.SGD"
    momentum = np.ones((3, 2), np.float32)
    values, step = _convert("index.json", torch_sgd, ms_sgd, KINDS[torch_sgd], KINDS[ms_sgd],
                            {"momentum_buffer": momentum}, {}, {"momentum": 0.9})
    assert step is None and values["stat"] == 0 and values["accum"] is momentum
    values, _ = _convert("index.json", ms_sgd, torch_sgd, KINDS[ms_sgd], KINDS[torch_sgd],
                         {"accum": momentum, "stat": np.ones((3, 2), np.float32)}, {},
                         {"momentum": 0.9})
    assert values == {}, "a MindSpore parameter that has not stepped has no torch state"
    with pytest.raises(CheckpointError, match=r"torch.optim.sgd.SGD's state 'velocity' has no "
                                              r"counterpart in mindspore.experimental"):
        _convert("index.json", torch_sgd, ms_sgd, KINDS[torch_sgd], KINDS[ms_sgd],
                 {"momentum_buffer": momentum, "velocity": momentum}, {}, {"momentum": 0.9})
