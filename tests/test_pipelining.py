"""hp.pipelining (PipelineStage, ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B) on
both frameworks, against the same model trained whole in one process.

Rank side: tests/pipelining_scenarios.py. One shared 2-rank launch per backend (pp 2, plain
stages: GPipe and 1F1B over two stages, interleaved 1F1B over four, two per rank, and a
shape mismatch between the stages) and one 4-rank launch (pp 2 x dp 2, every block and
stage a unit over ``mesh["dp"]``). Checked: the mean of the last
stage's per-micro-batch losses of each step and every stage's parameters after 3 SGD steps
against the reference (tests/tolerance.py), and at dp 2 one reduce-scatter per unit per
step under every schedule (the schedule syncs gradients in each step's last backward only).
Bad arguments fail before anything runs, in the test process, on a one-rank mesh without
groups.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.pipelining_3d_scenarios import MAX_NORM
from tests.pipelining_scenarios import LOW, MICRO_BATCHES, STEPS
from tests.tolerance import ADAMW_RTOL, FP32_RTOL, LOW_PRECISION_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
TARGET = "tests.pipelining_scenarios:run_cases"
CASES = {2: ["gpipe", "1f1b", "interleaved", "bad_shapes"],
         4: ["gpipe", "1f1b", "interleaved", "1f1b_mixed", "1f1b_hsdp"]}
#: what the default run trains; the rest runs under ``-m slow``. MindSpore's schedules cost
#: 5-8 s each on 2 shared cores: GPipe (every older forward recomputed) and the shape check
#: at pp 2, 1F1B with units at pp 2 x dp 2 (and in docs/pipelining.md's block at pp 2); its
#: interleaved runs reuse the message order torch's default runs check
DEFAULT = {(2, "torch"): CASES[2] + ["1f1b_torch_mesh"], (2, "mindspore"): ["gpipe", "bad_shapes"],
           (4, "torch"): CASES[4][:3], (4, "mindspore"): ["1f1b"]}
KEYS = {2: "pipelining", 4: "pipelining_dp"}

for _world, _key in KEYS.items():
    shared_launch.register(__name__, _key, _world, TARGET,
                           lambda backend, w=_world: (DEFAULT[(w, backend)], w // 2),
                           timeout_s=400)
    shared_launch.register(__name__, _key + "_slow", _world, TARGET,
                           lambda backend, w=_world: (
                               [c for c in CASES[w] if c not in DEFAULT[(w, backend)]], w // 2),
                           timeout_s=600, slow=True)
# the overlapped gradient pipeline (what Ascend runs) under the schedules
shared_launch.register(__name__, "pipelining_dp_overlapped", 4, TARGET,
                       lambda backend: (CASES[4][:3], 2), backends=("mindspore",),
                       env={"HP_SYNC_COLLECTIVES": "0"}, timeout_s=600, slow=True)


# 3-D: the one_script transformer at (pp 2, dp, tp 2), Schedule1F1B, 5 AdamW steps
# (tests/pipelining_3d_scenarios.py); pp 2 x tp 2 on torch in the default run, built
# deferred (each rank materialises its stage only); the 8-rank runs built eagerly
THREE_D = "tests.pipelining_3d_scenarios:run"
shared_launch.register(__name__, "pipelining_tp", 4, THREE_D, lambda backend: (backend, 1, True),
                       backends=("torch",), timeout_s=300)
shared_launch.register(__name__, "pipelining_tp_slow", 4, THREE_D,
                       lambda backend: (backend, 1, True), backends=("mindspore",),
                       timeout_s=600, slow=True)
shared_launch.register(__name__, "pipelining_3d", 8, THREE_D, lambda backend: (backend, 2),
                       timeout_s=900, slow=True)


def _per_rank(world: int, backend: str, case: str, overlapped: bool = False) -> list:
    if overlapped:
        key = "pipelining_dp_overlapped"
    else:
        key = KEYS[world] + ("" if case in DEFAULT[(world, backend)] else "_slow")
    return [r[case] for r in shared_launch.results(key, backend)]


def _cases(world: int, names: list, overlapped: tuple = ()):
    for backend in BACKENDS:
        for case in names:
            slow = case not in DEFAULT[(world, backend)]
            yield pytest.param(backend, case, False, marks=[pytest.mark.slow] if slow else [])
    for case in overlapped:
        yield pytest.param("mindspore", case, True, marks=[pytest.mark.slow])


def _check_parity(per_rank: list, world: int, rtol: float = FP32_RTOL) -> None:
    dp = world // 2
    assert [r["pp_rank"] for r in per_rank] == [0] * dp + [1] * dp
    last = [r for r in per_rank if r["pp_rank"] == 1]
    # each last-stage rank's losses are its share of the batch: their mean is the batch's
    mean_losses = np.mean([r["losses"] for r in last], axis=0)
    assert len(mean_losses) == STEPS >= 3
    assert_close(mean_losses, per_rank[0]["ref_losses"], rtol)
    # schedule.eval on a held-out batch after training: the trained reference's loss
    assert_close(np.mean([r["eval_loss"] for r in last]), per_rank[0]["ref_eval_loss"], rtol)
    for rank, r in enumerate(per_rank):
        assert r["names_match"], f"rank {rank}: parameter names differ from the reference's"
        assert r["param_diff"] <= rtol, \
            f"rank {rank} (pp rank {r['pp_rank']}): parameters differ by {r['param_diff']}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend,schedule,_", list(_cases(2, CASES[2][:3])))
def test_two_ranks_match_single_process(backend, schedule, _):
    """pp 2: two stages, or four (two per rank) under the interleaved schedule."""
    _check_parity(_per_rank(2, backend, schedule), 2)


@pytest.mark.timeout(600)
def test_torch_device_mesh_as_group():
    """On torch, a stage given torch's own 1-D DeviceMesh (``init_device_mesh(...)["pp"]``)
    trains as with hp's."""
    _check_parity(_per_rank(2, "torch", "1f1b_torch_mesh"), 2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend,schedule,_", list(_cases(2, ["gpipe", "1f1b"])))
def test_micro_batches_alive_per_stage(backend, schedule, _):
    """Micro-batches whose backward is pending on a stage at once (their activations, or
    on MindSpore their recomputed forwards' inputs, are alive): GPipe all of them, 1F1B
    at most ``num_stages - stage`` (torch's warm-up)."""
    expected = {"gpipe": {0: MICRO_BATCHES, 1: MICRO_BATCHES}, "1f1b": {0: 2, 1: 1}}[schedule]
    for r in _per_rank(2, backend, schedule):
        assert r["peak_pending"] == {r["pp_rank"]: expected[r["pp_rank"]]}, \
            f"pp rank {r['pp_rank']}: {r['peak_pending']}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend,schedule,overlapped", list(_cases(4, CASES[4], CASES[4][:3])))
def test_units_inside_stages_match_and_reduce_once_per_step(backend, schedule, overlapped):
    """``1f1b_mixed``: the units' parameters in bfloat16 (torch) or float16 (MindSpore),
    reduced in float32, float32 between the stages: against the float32 reference within
    tests/tolerance.py's low-precision tolerance. ``1f1b_hsdp``: the dp ranks replicate
    (replicate 2, shard 1): one all-reduce per unit per step and no reduce-scatter."""
    per_rank = _per_rank(4, backend, schedule, overlapped)
    rtol = LOW_PRECISION_RTOL[LOW[backend]] if schedule.endswith("_mixed") else FP32_RTOL
    _check_parity(per_rank, 4, rtol)
    hsdp = schedule.endswith("_hsdp")
    for rank, r in enumerate(per_rank):
        assert r["units"] >= 2, f"rank {rank}: a stage should hold nested units"
        counts = (r["all_reduces"], r["reduce_scatters"])
        expected = ([r["units"]] * STEPS, [0] * STEPS)
        assert counts == (expected if hsdp else expected[::-1]), \
            f"rank {rank} (pp rank {r['pp_rank']}): (all-reduces, reduce-scatters) per step " \
            f"{counts}, expected one {'all-reduce' if hsdp else 'reduce-scatter'} per unit " \
            f"({r['units']})"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend,world", [
    pytest.param("torch", 4), pytest.param("mindspore", 4, marks=[pytest.mark.slow]),
    pytest.param("torch", 8, marks=[pytest.mark.slow]),
    pytest.param("mindspore", 8, marks=[pytest.mark.slow])])
def test_tensor_parallel_inside_stages(backend, world):
    """pp 2 x tp 2 (4 ranks) and pp 2 x dp 2 x tp 2 (8 ranks), gradients clipped across
    stages: the last stage's losses (their mean over its dp ranks; its tp ranks compute
    the same) to float32 rounding, every stage's gathered parameters after 5 AdamW steps
    (tests/tolerance.py), and the clipping norm, the same on every rank and above
    max_norm (it clipped). At 4 ranks the model is built deferred: no parameter of the
    other stage is ever materialised on a rank."""
    key = {(4, "torch"): "pipelining_tp", (4, "mindspore"): "pipelining_tp_slow"}.get(
        (world, backend), "pipelining_3d")
    per_rank = shared_launch.results(key, backend)
    half = world // 2
    assert [r["pp_rank"] for r in per_rank] == [0] * half + [1] * half
    if world == 4:
        for rank, r in enumerate(per_rank):
            assert r["others"] > 0 and r["others_materialised"] == 0, \
                f"rank {rank}: {r['others_materialised']} of the other stage's {r['others']} " \
                f"parameters materialised"
    mean = np.mean([r["losses"] for r in per_rank if r["pp_rank"] == 1], axis=0)
    assert len(mean) == 5
    assert_close(mean, per_rank[0]["ref_losses"], FP32_RTOL)
    for rank, r in enumerate(per_rank):
        assert_close(r["norms"], per_rank[0]["norms"], FP32_RTOL, err_msg=f"rank {rank}'s norms")
        assert min(r["norms"]) > MAX_NORM, f"rank {rank}: nothing clipped ({r['norms']})"
        assert r["names_match"], f"rank {rank}: parameter names differ from the reference's"
        assert r["param_rel_diff"] <= ADAMW_RTOL, \
            f"rank {rank}: parameters differ by {r['param_rel_diff']} relative"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shape_mismatch_is_named_on_both_ranks(backend):
    messages = _per_rank(2, backend, "bad_shapes")
    for rank, message in enumerate(messages):
        assert "shape mismatch between pipeline stages 0 and 1" in message, \
            f"rank {rank}: {message}"
        assert "[4, 16]" in message and "[4, 19]" in message, f"rank {rank}: {message}"


def _one_rank(monkeypatch, backend):
    monkeypatch.setenv("HP_BACKEND", backend)
    import hyper_parallel as hp
    from tests.kit import get_kit
    from tests.pipelining_scenarios import _stages

    kit = get_kit()
    module = _stages(kit)[0]
    mesh = hp.DeviceMesh("cpu", (1,), ("pp",), [None])  # one rank: no group, no collective
    return hp, kit, module, mesh


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_are_named_before_anything_runs(monkeypatch, backend):
    hp, kit, module, mesh = _one_rank(monkeypatch, backend)
    before = [kit.to_numpy(p).copy() for p in kit.params(module)]
    pipelining = hp.pipelining
    with pytest.raises(ValueError, match="dw_builder"):
        pipelining.PipelineStage(module, 0, 1, "cpu", group=mesh, dw_builder=object())
    with pytest.raises(ValueError, match=r"stage_index 2 is not in \[0, 2\)"):
        pipelining.PipelineStage(module, 2, 2, "cpu", group=mesh)
    two = pipelining.PipelineStage(module, 0, 2, "cpu", group=mesh)
    with pytest.raises(ValueError, match="2 stages on a pp mesh of 1 ranks"):
        pipelining.ScheduleGPipe(two, 2)
    stage = pipelining.PipelineStage(module, 0, 1, "cpu", group=mesh)
    with pytest.raises(ValueError, match="pass loss_fn"):
        pipelining.Schedule1F1B(stage, 2)
    sched = pipelining.ScheduleGPipe(stage, 3, loss_fn=lambda out, y: (out - y).sum())
    x = kit.tensor(np.ones((16, 37), np.float32))
    with pytest.raises(ValueError, match="16 rows on dim 0, which n_microbatches=3"):
        sched.step(x, target=x)
    with pytest.raises(ValueError, match="needs the step's target"):
        sched.step(x)
    with pytest.raises(TypeError, match="1-D DeviceMesh"):
        pipelining.PipelineStage(module, 0, 1, "cpu", group="pp")
    after = [kit.to_numpy(p) for p in kit.params(module)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_interleaved_order_is_torchs():
    """hp's interleaved 1F1B order equals torch's own (``_get_1f1b_rank_ops``, torch
    2.13), on every rank, for 2 to 4 ranks, 2 and 3 stages per rank and several numbers
    of micro-batches."""
    pytest.importorskip("torch")
    from torch.distributed.pipelining.schedules import (
        _ComputationType, _get_1f1b_rank_ops, _get_warmup_ops,
    )

    from hyper_parallel.pipelining.schedules import interleaved_order

    compared = 0
    for ranks in (2, 3, 4):
        for local in (2, 3):
            for n in (ranks, 2 * ranks, 3 * ranks):
                per_round = n // max(1, n // ranks)
                for rank in range(ranks):
                    warmup = _get_warmup_ops(rank, local, per_round, ranks, n)
                    ops = _get_1f1b_rank_ops(
                        local, ranks, warmup, local * n - warmup, warmup, rank,
                        lambda k, r=rank: ((k // per_round) % local) * ranks + r,
                        lambda k, r=rank, w=warmup: (local - 1 - ((k - w) // per_round) % local)
                        * ranks + r)
                    torchs = [(a.stage_index,
                               "F" if a.computation_type == _ComputationType.FORWARD else "B",
                               a.microbatch_index) for a in ops if a is not None]
                    assert interleaved_order(rank, ranks, local, n) == torchs, \
                        f"{ranks} ranks, {local} stages each, {n} micro-batches, rank {rank}"
                    compared += 1
    assert compared == 2 * 3 * (2 + 3 + 4)  # (local, n) pairs x every rank of each size


def test_graphs_kept_where_only_the_latest_backward_runs():
    """The forwards that keep their graph on MindSpore (docs/pipelining.md): GPipe one in
    n (its backwards run oldest first), 1F1B's last stage all, its first stage of two
    every other one; the kept ones nest (each kept forward's backward is the latest
    pending kept one when it runs)."""
    from hyper_parallel.pipelining.schedules import (
        gpipe_order, graphs_to_keep, interleaved_order, one_f_one_b_order,
    )

    n = 4
    assert sum(graphs_to_keep(gpipe_order(0, 2, n)).values()) == 1
    assert all(graphs_to_keep(one_f_one_b_order(1, 2, n)).values())
    assert [k[1] for k, kept in graphs_to_keep(one_f_one_b_order(0, 2, n)).items()
            if kept] == [0, 2]
    for order in (gpipe_order(0, 2, n), one_f_one_b_order(0, 3, 6),
                  interleaved_order(0, 2, 2, 4), interleaved_order(1, 2, 2, 4)):
        keep, stack = graphs_to_keep(order), []
        for stage, kind, mb in order:
            if keep[(stage, mb)]:
                if kind == "F":
                    stack.append((stage, mb))
                else:
                    assert stack.pop() == (stage, mb), f"{order}: {(stage, mb)} not the latest"
        assert not stack
