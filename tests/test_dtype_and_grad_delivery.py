"""A sharded model's dtype changed with ``.to(dtype)``, and gradients delivered during backward.

The suite's shared launch of each (backend, world size) (tests/shared_launch.py) runs its
scenarios (tests/dtype_scenarios.py); each test reads its scenario's result. Parity: the mean of the ranks' losses equals the
single-process reference's, gathered parameters equal the reference's; on torch the same
holds against torch's own ``fully_shard``.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.tolerance import FLOAT64_RTOL, FP32_RTOL, REDUCED_IN_FLOAT32_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
TWO_RANKS = ("cast", "cast_reduce_float32", "optimizer_in_backward")
FOUR_RANKS = ("hsdp_optimizer_in_backward", "hsdp_deferred_all_reduce")


NAMES = {2: TWO_RANKS, 4: FOUR_RANKS}
shared_launch.register(__name__, "dtype_2", 2, "tests.dtype_scenarios:run_all",
                       lambda backend: (list(TWO_RANKS),), timeout_s=500)
shared_launch.register(__name__, "dtype_4", 4, "tests.dtype_scenarios:run_all",
                       lambda backend: (list(FOUR_RANKS),), timeout_s=500)


def _results(backend: str, world_size: int) -> dict:
    per_rank = shared_launch.results(f"dtype_{world_size}", backend)
    return {name: [r[name] for r in per_rank] for name in NAMES[world_size]}


def _dtypes(names: list) -> set:
    return {str(n).split(".")[-1] for n in names}


def _assert_parity(per_rank: list, tolerance: float, losses="losses", ref="ref_losses",
                   diff="param_diff"):
    mean_losses = np.mean([r[losses] for r in per_rank], axis=0)
    assert_close(mean_losses, per_rank[0][ref], tolerance)
    for r in per_rank:
        assert r[diff] <= tolerance, f"gathered parameters differ by {r[diff]}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_model_trains_in_float64(backend):
    """``model.to(float64)``: the sharded parameters, the full parameters a forward sees,
    the gathered state and the delivered gradients are float64, and training matches a
    float64 reference to rounding (on torch also torch's own fully_shard). The cast comes
    after fully_shard, and every converted parameter is still known as its unit's shard."""
    per_rank = _results(backend, 2)["cast"]
    for r in per_rank:
        for key in ("param_dtypes", "full_dtypes_in_forward", "gathered_dtypes", "grad_dtypes"):
            assert _dtypes(r[key]) == {"float64"}, (key, r[key])
        assert r["tracked_after_cast"] and all(r["tracked_after_cast"]), r["tracked_after_cast"]
    _assert_parity(per_rank, FLOAT64_RTOL)
    if backend == "torch":
        for r in per_rank:
            np.testing.assert_array_equal(r["losses"], r["their_losses"])  # the same math
            assert r["their_param_diff"] == 0.0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cast_back_to_float32_after_training(backend):
    """Back to float32 after float64 steps: parameters, gathers and gradients follow."""
    per_rank = _results(backend, 2)["cast"]
    for r in per_rank:
        assert _dtypes(r["back_param_dtypes"]) == {"float32"}
        assert _dtypes(r["back_grad_dtypes"]) == {"float32"}
    _assert_parity(per_rank, FP32_RTOL, "back_losses", "back_ref_losses", "back_param_diff")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_model_reduced_in_float32_gets_float64_gradients(backend):
    """``MixedPrecisionPolicy(reduce_dtype=float32)`` on a float64 model: gradients are
    reduced in float32 and delivered in float64."""
    per_rank = _results(backend, 2)["cast_reduce_float32"]
    for r in per_rank:
        assert _dtypes(r["param_dtypes"]) == {"float64"}
        assert _dtypes(r["grad_dtypes"]) == {"float64"}
    _assert_parity(per_rank, REDUCED_IN_FLOAT32_RTOL)
    if backend == "torch":
        for r in per_rank:
            np.testing.assert_array_equal(r["losses"], r["their_losses"])  # the same math
            assert r["their_param_diff"] == 0.0




@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_optimizer_in_backward_matches_a_normal_step(backend, world_size):
    """One optimizer per parameter, stepped from the parameter's delivery callback (torch:
    ``register_post_accumulate_grad_hook``; MindSpore: ``Parameter.register_hook``, which
    sees the reduced gradient where the reduction runs inside the unit's backward, the
    default on CPU): the same parameters as one optimizer step after backward. FSDP on 2
    ranks, HSDP 2x2 on 4; on torch also the same as torch's own fully_shard with the same
    hooks (each of which runs once per backward, after its gradient is written)."""
    name = "optimizer_in_backward" if world_size == 2 else "hsdp_optimizer_in_backward"
    per_rank = _results(backend, world_size)[name]
    if backend == "mindspore":
        assert per_rank[0]["sync_collectives"], "Parameter.register_hook sees the reduced " \
            "gradient only where each unit reduces inside its own backward"
    for r in per_rank:
        # the same optimizer math per parameter, in or after backward
        assert r["param_diff_vs_stepped"] == 0.0, r["param_diff_vs_stepped"]
        np.testing.assert_array_equal(r["losses"], r["stepped_losses"])
        if backend == "torch":
            assert r["their_param_diff"] == 0.0
            assert all(calls == [True] * r["trainable"] for calls in r["their_calls"])
    _assert_parity(per_rank, FP32_RTOL)


def assert_callbacks_once_during_backward(per_rank: list) -> None:
    """Each backward ran every trainable parameter's callback once, with its gradient there,
    before ``backward()`` returned, and some before the end-of-backward drain (the units
    whose reduction completed earlier)."""
    for r in per_rank:
        for calls in r["per_backward"]:
            names = [c[0] for c in calls]
            assert len(names) == len(set(names)) == r["trainable"], names
            assert all(grad_set and in_backward for _, grad_set, in_backward, _ in calls), calls
        for calls in r["per_backward"][1:]:  # the drain is watched from the second step on
            assert any(not draining for *_, draining in calls), calls


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_delivery_callbacks_run_once_per_parameter_during_backward(backend, world_size):
    name = "optimizer_in_backward" if world_size == 2 else "hsdp_optimizer_in_backward"
    assert_callbacks_once_during_backward(_results(backend, world_size)[name])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_deferred_all_reduce_then_one_step_matches_the_whole_batch(backend):
    """HSDP 2x2 with ``set_requires_all_reduce(False)`` on the first two of three
    micro-batches, one optimizer step after the third: one step on the whole batch."""
    _assert_parity(_results(backend, 4)["hsdp_deferred_all_reduce"], FP32_RTOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_deferred_all_reduce_runs_callbacks_on_the_last_micro_batch(backend):
    """Nothing is delivered while the all-reduce is deferred: on torch each parameter's hook
    runs once, in the last micro-batch. MindSpore's ``Parameter.register_hook`` sees every
    backward's returned gradient (zeros while the all-reduce is deferred)."""
    result = _results(backend, 4)["hsdp_deferred_all_reduce"][0]
    calls, trainable = result["calls_per_micro_batch"], result["trainable"]
    per_step = [trainable] * 3 if backend == "mindspore" else [0, 0, trainable]
    assert calls == per_step * (len(calls) // 3), calls
