"""Bad input: a clear error naming the problem and the fix, and nothing half-changed."""

from __future__ import annotations

import pytest

from hyper_parallel.platform import resolve_backend_name
from tests import shared_launch
from tests.test_fsdp2_surface import FSDP2_SHARED_PARAMETER_WORDING

BACKENDS = ["torch", "mindspore"]


shared_launch.register(__name__, "bad_input", 2, "tests.bad_input:run_checks", timeout_s=200)


def _checks(backend):
    return shared_launch.results("bad_input", backend)[0]


@pytest.mark.parametrize("value", ["jax", "", "tensorflow "])
def test_unknown_backend_names_the_valid_values(monkeypatch, value):
    monkeypatch.setenv("HP_BACKEND", value or "nope")
    with pytest.raises(ValueError, match="valid values: torch, mindspore"):
        resolve_backend_name()


def test_backend_name_is_case_insensitive(monkeypatch):
    monkeypatch.setenv("HP_BACKEND", "  TorCH ")
    assert resolve_backend_name() == "torch"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("check, error_type, message", [
    ("mesh_size", "ValueError", "holds 3 ranks but the world has 2"),
    ("mesh_dup_names", "ValueError", "has duplicates"),
    ("mesh_3d", "ValueError", "dp_mesh_dims=hp.DataParallelMeshDims("),
    ("shard_dim_out_of_range", "ValueError", "return a dim in [-2, 2)"),
    ("ignored_not_a_parameter", "TypeError", "is not a parameter"),
    ("twice", "ValueError", "already applied"),
    ("top_down", "ValueError", "apply it to the blocks first"),
    ("tied_across_units", "ValueError", "common ancestor"),
    *[("tied_across_units", "ValueError", phrase) for phrase in FSDP2_SHARED_PARAMETER_WORDING],
    ("unknown_reduce_op", "ValueError", "one of ('avg', 'sum')"),
    ("non_scalar_scaling", "ValueError", "one-element tensor, got shape (2,)"),
    ("negative_threshold", "ValueError", "shard_threshold_bytes must be an int >= 0"),
    ("bad_own_collective_bytes", "ValueError", "own_collective_bytes must be an int >= 0, None"),
    ("unknown_dtype_name", "ValueError", "unknown dtype name 'bf16'"),
    ("policy_none", "TypeError", "mp_policy must be a hp.MixedPrecisionPolicy, got None"),
    ("policy_lookalike", "TypeError", "mp_policy must be a hp.MixedPrecisionPolicy, got LookalikePolicy("),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_rejected_cleanly(backend, check, error_type, message):
    found_type, found_message, untouched = _checks(backend)[check]
    assert found_type == error_type, found_message
    assert message in found_message
    assert untouched, "the module was changed by a call that failed"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_module_without_parameters_is_a_no_op_unit(backend):
    is_unit, values = _checks(backend)["no_params"]
    assert is_unit
    assert values == [[0.0, 2.0]]
