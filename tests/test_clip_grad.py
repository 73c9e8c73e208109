"""Gradient clipping under fully_shard (tests/clip_grad_scenarios.py): ``hp.clip_grad_norm_``
returns the single-process norm of the full gradients (2-norm and inf-norm) and clips like
the framework's own whole-model clipping, so the model trains like the single-process
reference; on torch ``torch.nn.utils.clip_grad_norm_`` on hyper_parallel's DTensor gradients
and under FSDP2 gives the same. The 2-rank layouts run in the suite's shared 2-rank launch
(tests/shared_launch.py), the HSDP 2 x 2 layout in the 4-rank one, as a config of
tests/test_hsdp.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.clip_grad_scenarios import CLIP_BY, MAX_NORM
from tests.tolerance import FP32_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
LAYOUTS_2 = ["fsdp", "outside"]


shared_launch.register(__name__, "clip_grad", 2, "tests.clip_grad_scenarios:run_all",
                       lambda backend: (LAYOUTS_2,), timeout_s=400)


def _results(backend: str) -> list:
    return shared_launch.results("clip_grad", backend)


def _assert_trains_like_reference(run: dict, ref: dict) -> None:
    assert_close(run["losses"], ref["losses"], FP32_RTOL)
    for step, (got, want) in enumerate(zip(run["norms"], ref["norms"])):
        for norm_type in CLIP_BY:
            assert_close(got[norm_type], want[norm_type], FP32_RTOL,
                         err_msg=f"step {step}, norm {norm_type}")
    assert run["diff"] <= FP32_RTOL, f"parameters differ from the reference by {run['diff']}"


def _assert_clipping_active(ref: dict) -> None:
    for step, norms in enumerate(ref["norms"]):
        by = CLIP_BY[step % 2]
        assert norms[by] > MAX_NORM[by], f"step {step} does not clip: {norms[by]} <= {MAX_NORM[by]}"


def _assert_layout(per_rank: list, layout: str) -> None:
    mean_losses = np.mean([r[layout]["hp"]["losses"] for r in per_rank], axis=0)
    ref = per_rank[0][layout]["ref"]
    _assert_clipping_active(ref)
    assert_close(mean_losses, ref["losses"], FP32_RTOL)
    for r in per_rank:
        result = r[layout]
        run = {**result["hp"], "losses": ref["losses"]}  # each rank's loss is its slice's
        _assert_trains_like_reference(run, ref)
        for other in ("hp_torch_clip", "fsdp2"):
            if other in result:
                assert_close(result[other]["losses"], result["hp"]["losses"], FP32_RTOL)
                _assert_trains_like_reference({**result[other], "losses": ref["losses"]}, ref)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", LAYOUTS_2)
@pytest.mark.parametrize("backend", BACKENDS)
def test_clipping_matches_reference(backend, layout):
    per_rank = [r["layouts"] for r in _results(backend)]
    _assert_layout(per_rank, layout)
    if backend == "torch" and layout == "fsdp":
        assert all("fsdp2" in r[layout] and "hp_torch_clip" in r[layout] for r in per_rank)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_clipping_under_hsdp_matches_reference(backend):
    from tests.test_hsdp import CLIP_CONFIG, _four

    per_rank = [{"hsdp": r} for r in _four(backend)[CLIP_CONFIG]]
    _assert_layout(per_rank, "hsdp")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_rejected_and_changes_nothing(backend):
    for r in _results(backend):
        bad = r["bad_input"]
        errors = bad["errors"]
        assert all(errors.values()), f"accepted: {[k for k, v in errors.items() if not v]}"
        assert errors["max_norm_string"][0] == "TypeError" and "max_norm" in errors["max_norm_string"][1]
        assert errors["max_norm_none"][0] == "TypeError"
        assert errors["max_norm_negative"][0] == "ValueError"
        for key in ("norm_type_negative", "norm_type_zero"):
            assert errors[key][0] == "ValueError" and "norm_type must be positive" in errors[key][1]
        assert "one gradient (or None) per parameter" in errors["grads_wrong_length"][1]
        assert errors["nonfinite"][0] == "RuntimeError" and "error_if_nonfinite" in errors["nonfinite"][1]
        if backend == "mindspore":
            assert "grads=grads" in errors["mindspore_without_grads"][1]
        assert bad["grads_unchanged"]
        if backend == "torch":
            assert bad["grads_form_same"], "grads= returned other gradients than .grad holds"
