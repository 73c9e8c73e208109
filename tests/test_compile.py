"""Compilers on sharded blocks (tests/compile_scenarios.py): one 2-rank launch per backend.

torch: ``torch.compile`` of each block, before or after ``fully_shard``, by method or by
wrapper, gives the same losses and parameters as uncompiled hyper_parallel and as torch
FSDP2 compiled the same way, with no more graph breaks and no more graphs than FSDP2; the
mean of the ranks' losses equals the single-process reference's.

MindSpore: a sharded cell whose construct is jitted (before or after ``fully_shard``)
refuses its first call with an error that says what to do, leaving the parameters as they
were; a block whose construct calls a jitted function of its parameters trains with parity.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.compile_scenarios import MS_REFUSED, TORCH_VARIANTS
from tests.multirank import run_ranks
from tests.tolerance import FP32_RTOL, assert_close


@shared_launch.once
def _results(backend: str) -> list:
    target = "run_torch" if backend == "torch" else "run_mindspore"
    return run_ranks(f"tests.compile_scenarios:{target}", 2, backend, timeout_s=400)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", TORCH_VARIANTS)
def test_torch_compile_matches_eager_and_fsdp2(variant):
    results = _results("torch")
    mean_eager = np.mean([r["eager_losses"] for r in results], axis=0)
    assert_close(mean_eager, results[0]["ref_losses"], FP32_RTOL)
    for r in results:
        assert r["eager_ref_diff"] <= FP32_RTOL
        run = r[variant]
        # aot_eager runs the eager kernels in the eager order: the same math
        np.testing.assert_array_equal(run["losses"], r["eager_losses"])
        np.testing.assert_array_equal(run["losses"], run["fsdp2_losses"])
        assert run["eager_diff"] == 0.0, f"parameters differ from eager by {run['eager_diff']}"
        assert run["fsdp2_diff"] == 0.0, f"parameters differ from FSDP2's by {run['fsdp2_diff']}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", TORCH_VARIANTS)
def test_torch_compile_breaks_no_more_than_fsdp2(variant):
    for r in _results("torch"):
        run = r[variant]
        assert run["graphs"] >= 1, "nothing was compiled"
        assert run["breaks"] <= run["fsdp2_breaks"], (
            f"{run['breaks']} graph breaks against FSDP2's {run['fsdp2_breaks']}: "
            f"{run['break_reasons']}")
        assert run["graphs"] <= run["fsdp2_graphs"], (
            f"{run['graphs']} graphs against FSDP2's {run['fsdp2_graphs']}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", MS_REFUSED)
def test_mindspore_jitted_sharded_cell_is_refused(variant):
    for r in _results("mindspore"):
        error = r[variant]["error"]
        assert error is not None, "a jitted sharded cell trained without an error"
        assert "mindspore.jit" in error and "takes the parameters as arguments" in error, error
        assert r[variant]["unchanged"], "the refused call changed the parameters"


@pytest.mark.timeout(600)
def test_mindspore_jit_inside_sharded_cell_matches_reference():
    results = _results("mindspore")
    mean = np.mean([r["losses"] for r in results], axis=0)
    assert_close(mean, results[0]["ref_losses"], FP32_RTOL)
    for r in results:
        assert r["ref_diff"] <= FP32_RTOL, f"parameters differ from the reference by {r['ref_diff']}"
