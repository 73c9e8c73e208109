"""The HSDP gradient pipeline: meshes, reduce ops and scaling, mixed precision, main_grad,
gradient accumulation, small parameters, overlap vs synchronous, collective counts.

Each (backend, world size) runs its configs in the suite's shared launch
(tests/shared_launch.py, the scenarios in tests/hsdp_scenarios.py); each test reads its
config's result (MindSpore runs the configs of MINDSPORE_4_SLOW under ``-m slow``).
Reference: one process on the global batch, gradients scaled by what the config implies.
SGD with momentum (kit.py says why).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.tolerance import FP32_RTOL, LOW_PRECISION_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
LOW_PRECISION = {"torch": "bfloat16", "mindspore": "float16"}  # MindSpore CPU has no bf16 matmul

CLIP_CONFIG = "clip_grad_hsdp"
CONFIGS_4 = {
    "mesh_2x2": {"mesh": (2, 2)},
    "mesh_1x4": {"mesh": (1, 4)},
    "mesh_4x1": {"mesh": (4, 1)},
    "sum": {"mesh": (2, 2), "reduce_op": "SUM"},
    "divide_factor": {"mesh": (2, 2), "divide": 3.0},
    "scaling_factor": {"mesh": (2, 2), "scale": 0.5},
    "scaling_tensor": {"mesh": (2, 2), "scale": ("tensor", 0.125), "reduce_op": "sum"},
    "mixed_precision": {"mesh": (2, 2), "mp": "low"},
    "main_grad": {"mesh": (2, 2), "main_grad": True},
    "no_sync": {"mesh": (2, 2), "accum": "no_sync"},
    "no_all_reduce": {"mesh": (2, 2), "accum": "no_all_reduce"},
    "not_last_backward": {"mesh": (2, 2), "accum": "not_last"},
    "threshold": {"mesh": (2, 2), "threshold": 256},
    "threshold_no_all_reduce": {"mesh": (2, 2), "threshold": 256, "accum": "no_all_reduce"},
    "threshold_not_last": {"mesh": (2, 2), "threshold": 256, "accum": "not_last"},
    "own_collectives": {"mesh": (2, 2), "own": 0, "threshold": 256},
    "own_no_all_reduce": {"mesh": (2, 2), "own": 0, "accum": "no_all_reduce"},
    "own_mixed_precision": {"mesh": (2, 2), "own": 0, "mp": "low"},
    # gradient clipping on HSDP: checked by tests/test_clip_grad.py, in this launch
    CLIP_CONFIG: {"clip": True},
}
SYNC_COMPARED = ["mesh_2x2", "no_all_reduce", "threshold", "mixed_precision", "own_collectives"]
# MindSpore's 4-rank launch takes ~5 s a config on 2 cores; these add no MindSpore path the
# others lack (reduce op sum: scaling_tensor; a float scale: hsdp_2's mesh_2x1_scaled_sum;
# FSDP over 4 ranks: tests/test_parity.py; threshold and is_last_backward: each alone; the
# divide factor is the core's arithmetic, which torch runs here), so they run under -m slow
MINDSPORE_4_SLOW = ("mesh_1x4", "sum", "divide_factor", "scaling_factor", "threshold_not_last")


def _concrete(backend, config):
    if config.get("mp") == "low":
        return {**config, "mp": LOW_PRECISION[backend]}
    return config


def _slow(backend: str, name: str) -> bool:
    return backend == "mindspore" and name in MINDSPORE_4_SLOW


def _four_names(backend: str, slow: bool = False) -> tuple:
    return tuple(n for n in CONFIGS_4 if _slow(backend, n) == slow)


def _register(key: str, world_size: int, table: dict, names, sync: bool = False,
              backends: tuple = tuple(BACKENDS), slow: bool = False) -> None:
    """``names``: the configs to run, or a function of the backend giving them."""
    # "0" keeps the overlapped pipeline even where the platform would reduce synchronously
    # (MindSpore on CPU), so both paths are compared on both backends.
    of = names if callable(names) else (lambda backend: names)
    shared_launch.register(
        __name__, key, world_size, "tests.hsdp_scenarios:run_configs",
        lambda backend: ([_concrete(backend, table[n]) for n in of(backend)],),
        backends=backends, env={"HP_SYNC_COLLECTIVES": "1" if sync else "0"}, timeout_s=500,
        slow=slow)


def _run(backend: str, key: str, names: tuple) -> dict:
    per_rank = shared_launch.results(key, backend)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(names)}


_register("hsdp_4", 4, CONFIGS_4, _four_names)
_register("hsdp_4_slow", 4, CONFIGS_4, lambda backend: _four_names(backend, slow=True),
          backends=("mindspore",), slow=True)
_register("hsdp_4_sync", 4, CONFIGS_4, tuple(SYNC_COMPARED), sync=True)


def _four(backend, slow: bool = False):
    return _run(backend, "hsdp_4_slow" if slow else "hsdp_4", _four_names(backend, slow))


def _assert_parity(per_rank, tolerance=FP32_RTOL):
    mean_losses = np.mean([r["losses"] for r in per_rank], axis=0)
    assert len(mean_losses) >= 5
    assert_close(mean_losses, per_rank[0]["ref_losses"], tolerance)
    for r in per_rank:
        assert r["param_diff"] <= tolerance, f"gathered parameters differ by {r['param_diff']} ({r['worst']})"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend,name", [
    pytest.param(b, n, marks=[pytest.mark.slow] if _slow(b, n) else [])
    for b in BACKENDS for n in CONFIGS_4
    if not n.endswith("mixed_precision") and n != CLIP_CONFIG])
def test_parity_4_ranks(backend, name):
    _assert_parity(_four(backend, _slow(backend, name))[name])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_precision_gathers_in_param_dtype_and_trains(backend):
    results = _four(backend)
    low, full = results["mixed_precision"][0], results["mesh_2x2"][0]
    assert low["all_gather_bytes"] * 2 == full["all_gather_bytes"], "all-gather not in the 2-byte param_dtype"
    _assert_parity(results["mixed_precision"], LOW_PRECISION_RTOL[LOW_PRECISION[backend]])
    assert low["param_dtypes"] == ["float32"], "sharded parameters must stay in their own dtype"
    own = results["own_mixed_precision"]
    assert own[0]["all_gather_bytes"] == low["all_gather_bytes"]
    _assert_parity(own, LOW_PRECISION_RTOL[LOW_PRECISION[backend]])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_fused_all_reduce_per_unit_per_step(backend):
    """2 blocks + root on a 2x2 mesh: 3 reduce-scatters over "shard", 3 all-reduces over
    "replicate" (one per unit, never one per parameter); on (4, 1) no reduce-scatter."""
    results = _four(backend)
    (step,) = results["mesh_2x2"][0]["last_step_comms"]
    assert step[("reduce_scatter", "shard")] == 3
    assert step[("all_reduce", "replicate")] == 3
    # The shard group is half the world: on MindSpore CPU, whose flat all-gather serves only
    # the world group, both the gather and the two-rank reduce-scatter exchange use the
    # list all-gather there (docs/platforms.md)
    expected = {"torch": ["all_gather:all_gather", "reduce_scatter:reduce_scatter"],
                "mindspore": ["all_gather:all_gather_list", "reduce_scatter:all_gather_list"]}
    assert results["mesh_2x2"][0]["last_step_shard_wires"] == expected[backend]
    (replicate_only,) = results["mesh_4x1"][0]["last_step_comms"]
    assert replicate_only == {("all_reduce", "replicate"): 3}
    # the biases below the threshold: each of the three units' small bucket, one all-reduce
    (small,) = results["threshold"][0]["last_step_comms"]
    assert small[("all_reduce", "data_parallel")] == 3 and small[("reduce_scatter", "shard")] == 3
    # own_collective_bytes=0 with the biases below the threshold: each of the 5 sharded
    # weights (2 per block, 1 in the root) has its own reduce-scatter and all-reduce; the
    # biases of each unit still share one data-parallel all-reduce
    (own,) = results["own_collectives"][0]["last_step_comms"]
    assert own[("reduce_scatter", "shard")] == 5 and own[("all_reduce", "replicate")] == 5
    assert own[("all_reduce", "data_parallel")] == 3


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulation_collective_counts(backend):
    results = _four(backend)
    no_sync = results["no_sync"][0]["last_step_comms"]
    for micro in no_sync[:-1]:
        assert not any(op in ("reduce_scatter", "all_reduce") for op, _ in micro), micro
    assert no_sync[-1][("reduce_scatter", "shard")] == 3
    deferred = results["no_all_reduce"][0]["last_step_comms"]
    for micro in deferred[:-1]:
        assert micro[("reduce_scatter", "shard")] == 3 and ("all_reduce", "replicate") not in micro
    assert deferred[-1][("all_reduce", "replicate")] == 3
    own_deferred = results["own_no_all_reduce"][0]["last_step_comms"]  # 10 parameters alone
    for micro in own_deferred[:-1]:
        assert micro[("reduce_scatter", "shard")] == 10 and ("all_reduce", "replicate") not in micro
    assert own_deferred[-1][("all_reduce", "replicate")] == 10
    # small buckets deferred too, then every micro-batch's folded into each unit's all-reduce
    small_deferred = results["threshold_no_all_reduce"][0]["last_step_comms"]
    for micro in small_deferred[:-1]:
        assert ("all_reduce", "data_parallel") not in micro, micro
    assert small_deferred[-1][("all_reduce", "data_parallel")] == 3


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_is_last_backward_false_leaves_reductions_in_flight(backend):
    per_rank = _four(backend)["not_last_backward"]
    flags = per_rank[0]["pending_after_non_last"]
    assert flags and all(flags), "a backward with is_last_backward=False drained its reductions"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_small_parameters_stay_whole(backend):
    replicated = _four(backend)["threshold"][0]["replicated_params"]
    assert replicated and all(name.endswith("bias") for name in replicated)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapped_and_synchronous_collectives_are_bitwise_identical(backend):
    overlapped = _four(backend)
    synchronous = _run(backend, "hsdp_4_sync", tuple(SYNC_COMPARED))
    for name in SYNC_COMPARED:
        for a, b in zip(overlapped[name], synchronous[name]):
            assert a["losses"] == b["losses"], name
            for key in a["full"]:
                assert np.array_equal(a["full"][key], b["full"][key]), f"{name}: {key}"


OTHER_CONFIGS = {
    "mesh_2x1": {"mesh": (2, 1)},
    "mesh_2x1_scaled_sum": {"mesh": (2, 1), "scale": 0.25, "reduce_op": "sum"},
    "world_1_scaled": {"mesh": (1, 1), "scale": 3.0},
}
TWO_RANKS = ("mesh_2x1", "mesh_2x1_scaled_sum")
_register("hsdp_2", 2, OTHER_CONFIGS, TWO_RANKS)
_register("hsdp_1", 1, OTHER_CONFIGS, ("world_1_scaled",))
shared_launch.register(__name__, "hsdp_fsdp2", 4, "tests.scenarios:run_fsdp2_compare",
                       lambda backend: (True,), backends=("torch",), timeout_s=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", TWO_RANKS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_2_ranks(backend, name):
    results = _run(backend, "hsdp_2", TWO_RANKS)
    _assert_parity(results[name])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_scaling_factor_applies_at_world_size_one(backend):
    (result,) = _run(backend, "hsdp_1", ("world_1_scaled",))["world_1_scaled"]
    _assert_parity([result])
    assert result["last_step_comms"] == [{}]


@pytest.mark.timeout(600)
def test_hsdp_parity_with_torch_fsdp2():
    results = shared_launch.results("hsdp_fsdp2", "torch")
    for r in results:
        np.testing.assert_array_equal(r["losses"], r["their_losses"])  # the same math
        assert r["param_diff"] == 0.0
        assert r["local_shapes_match"]
