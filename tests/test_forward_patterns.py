"""Forwards that are not one clean pass (tests/forward_pattern_scenarios.py): chunked heads,
two forwards before one backward, evaluation and explicit reshard/unshard between forward
and backward, a backward per chunk over a retained graph.

One 2-rank launch per backend runs every pattern. Parity: the mean of the ranks' losses
equals the single-process reference's, and the gathered parameters equal its parameters;
on torch, each rank's losses and the parameters also equal torch FSDP2's on the same
wrapping and data (except where FSDP2 itself fails, marked in the pattern). Mixed precision (bf16 on torch, fp16 on MindSpore) is compared with the
fp32 reference at a looser tolerance and with FSDP2 at the fp32 one.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.forward_pattern_scenarios import PATTERNS, TORCH_ONLY
from tests.multirank import FAST_MINDSPORE, run_ranks
from tests.tolerance import FP32_RTOL, LOW_PRECISION_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
LOW_PRECISION = {"torch": "bfloat16", "mindspore": "float16"}  # the scenarios' param_dtype


# Its own launch, not the suite's shared one (tests/shared_launch.py): the leak check counts
# the full-parameter sets alive in the whole process, which earlier jobs' objects, freed
# whenever their last reference goes, would shift. MindSpore runs blocking, as the shared
# launches do (~27 s instead of ~90 s on 2 cores).
@shared_launch.once
def _results(backend: str) -> list:
    return run_ranks("tests.forward_pattern_scenarios:run_all", 2, backend, list(PATTERNS),
                     timeout_s=400, env=FAST_MINDSPORE)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_pattern_matches_reference(backend, pattern):
    if backend == "mindspore" and pattern in TORCH_ONLY:
        pytest.skip("a MindSpore backward is one value_and_grad call over the whole loss: "
                    "there is no backward per chunk over a retained graph")
    per_rank = [r[pattern] for r in _results(backend)]
    tolerance = LOW_PRECISION_RTOL[LOW_PRECISION[backend]] if PATTERNS[pattern].get("mp") \
        else FP32_RTOL
    mean_losses = np.mean([r["losses"] for r in per_rank], axis=0)
    assert_close(mean_losses, per_rank[0]["ref_losses"], tolerance)
    for r in per_rank:
        assert r["ref_diff"] <= tolerance, f"parameters differ from the reference by {r['ref_diff']}"
        # sets of full parameters alive after each step: one graph's worth (a set per unit)
        # may wait for its collection; a leak adds a set per unit every step
        live = r["live_full_params"]
        assert max(live) - live[0] <= r["units"], f"full parameters alive per step: {live}"
        # after every step (backward and optimizer) each unit holds only its shards, as
        # FSDP2's after its final callback (reshard_after_backward is never turned off here)
        assert all(s == "sharded" for step in r["states"] for s in step), r["states"]
        if "fsdp2_losses" in r:
            assert_close(r["losses"], r["fsdp2_losses"], FP32_RTOL)
            assert r["fsdp2_diff"] <= FP32_RTOL, f"parameters differ from FSDP2's by {r['fsdp2_diff']}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_root_reshards_after_forward_only_when_asked(backend):
    """By default the root keeps its full parameters from forward to backward; an explicit
    ``reshard_after_forward=True`` on the root frees them after forward."""
    results = _results(backend)
    for r in results:
        assert r["chunked"]["root_resharded"] == [False] * len(r["chunked"]["losses"])
        assert r["root_reshards"]["root_resharded"] == [True] * len(r["root_reshards"]["losses"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_parameters_while_unsharded(backend):
    """torch, as FSDP2: while a unit is unsharded (after a forward that keeps its full
    parameters, or an explicit unshard()), parameters() yields the full tensors; after
    the step or reshard() the sharded ones; a state dict always holds the sharded ones.
    MindSpore: the registered Parameters stay the sharded ones (value_and_grad's weights
    and the optimizer are bound to them; the modules read the full tensors as attributes)."""
    for per_rank in _results(backend):
        trace = per_rank["registration"]["hp"]
        n = len(trace["after_step"])
        unsharded = backend == "torch"
        assert trace["after_forward"] == [unsharded] * n
        assert trace["after_step"] == [False] * n
        assert trace["after_unshard"] == [unsharded] * n
        assert trace["after_reshard"] == [False] * n
        if backend == "torch":
            assert trace["state_dict"] == [False] * n
            assert trace == per_rank["registration"]["fsdp2"]
