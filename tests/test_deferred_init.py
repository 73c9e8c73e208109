"""Deferred initialisation (tests/deferred_init_scenarios.py): models built without values
(torch meta device, MindSpore ``no_init_parameters()``), sharded, given the reference's
values through a supported path and trained; parameters replaced after fully_shard; peak
host memory while building and sharding a 1 GiB model.

Its jobs run in the suite's shared 2-rank launch (tests/shared_launch.py). Parity: the mean of the ranks' losses (the first loss
included) equals the single-process reference's, and the gathered parameters equal its
parameters; on torch each rank's losses and parameters also equal torch FSDP2's through the
same meta flow.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.deferred_init_scenarios import TORCH_FLOWS
from tests.tolerance import FP32_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
# growth of the peak RSS allowed beyond P/N + the largest parameter (allocator slack,
# the first touch of library code)
MEMORY_SLACK = 64 << 20


shared_launch.register(__name__, "deferred_init", 2, "tests.deferred_init_scenarios:run_all",
                       timeout_s=300)


def _results(backend: str) -> list:
    return shared_launch.results("deferred_init", backend)


def _check_parity(per_rank: list) -> None:
    mean_losses = np.mean([r["hp_losses"] for r in per_rank], axis=0)
    assert_close(mean_losses[0], per_rank[0]["ref_losses"][0], FP32_RTOL)
    assert_close(mean_losses, per_rank[0]["ref_losses"], FP32_RTOL)
    for r in per_rank:
        assert r["hp_ref_diff"] <= FP32_RTOL, f"parameters differ from the reference by {r['hp_ref_diff']}"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("flow", list(TORCH_FLOWS))
def test_torch_meta_flow_matches_reference_and_fsdp2(flow):
    per_rank = [r[flow] for r in _results("torch")]
    _check_parity(per_rank)
    for r in per_rank:
        np.testing.assert_array_equal(r["hp_losses"], r["fsdp2_losses"])  # the same math
        assert r["fsdp2_ref_diff"] <= FP32_RTOL and r["fsdp2_diff"] == 0.0, \
            f"parameters differ from FSDP2's by {r['fsdp2_diff']}"


@pytest.mark.timeout(400)
def test_mindspore_lazy_parameters_shard_without_full_tensors():
    per_rank = [r["lazy_init"] for r in _results("mindspore")]
    for r in per_rank:
        assert r["initialised"] == {"all_lazy_before": True, "no_lazy_after": True,
                                    "shard_shapes": True, "gamma_ones": True}, r["initialised"]
    _check_parity(per_rank)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", BACKENDS)
def test_replaced_or_missing_values_raise_clear_errors(backend):
    for r in _results(backend):
        errors = r["errors"]
        if backend == "torch":
            assert "has no values at the first forward" in errors["meta_forward"], errors
            assert "to_empty" in errors["meta_forward"], errors
        assert "head.weight" in errors["plain_full"] and \
            "cannot become this rank's shard" in errors["plain_full"], errors
        assert "head.weight" in errors["wrong_shape"] and "(4, 16)" in errors["wrong_shape"] \
            and "(3, 16)" in errors["wrong_shape"], errors
        if backend == "mindspore":
            assert "should have the same shape" in errors["load_full"], errors


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", BACKENDS)
def test_peak_memory_stays_within_one_shard_of_the_model(backend):
    for r in _results(backend):
        m = r["memory"]
        bound = m["total"] // r["world"] + m["largest"] + MEMORY_SLACK
        print(f"{backend}: peak RSS growth {m['peak_growth'] / 2**20:.0f} MiB for a "
              f"{m['total'] / 2**20:.0f} MiB model on {r['world']} ranks "
              f"(bound {bound / 2**20:.0f} MiB)")
        assert m["peak_growth"] <= bound, m
        assert m["peak_growth"] >= m["total"] // r["world"] // 2, \
            f"the shards were not materialised: {m}"
