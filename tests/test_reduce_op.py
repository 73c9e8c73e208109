"""Table tests of the pure reduce-op / scaling resolution (no processes, no framework)."""

from __future__ import annotations

import math

import pytest

from hyper_parallel.fully_shard.reduce_op import (
    ReducePlan, divide_factor, fp16_pre_divide, normalize_reduce_op, plan_reduction,
    resolve_reduce_dtype, validate_factor,
)


@pytest.mark.parametrize("given, expected", [("avg", "avg"), ("SUM", "sum"), (" Avg ", "avg")])
def test_reduce_op_names_are_case_insensitive(given, expected):
    assert normalize_reduce_op(given) == expected


@pytest.mark.parametrize("bad", ["max", "mean", "", None, 1])
def test_unknown_reduce_op_is_an_error_naming_the_valid_ones(bad):
    with pytest.raises(ValueError, match=r"one of \('avg', 'sum'\)"):
        normalize_reduce_op(bad)


@pytest.mark.parametrize("dp, op, custom, expected", [
    (8, "avg", None, 8.0), (8, "sum", None, 1.0), (8, "avg", 3.0, 3.0), (8, "sum", 2.0, 2.0),
    (1, "avg", None, 1.0),
])
def test_divide_factor(dp, op, custom, expected):
    assert divide_factor(dp, op, custom) == expected


@pytest.mark.parametrize("factor, pre", [(1, 1), (2, 1), (4, 2), (8, 2), (16, 4), (32, 4), (64, 8), (6, 2)])
def test_fp16_pre_divide_is_a_power_of_two_near_the_square_root(factor, pre):
    assert fp16_pre_divide(factor) == pre
    assert pre <= math.sqrt(factor) < 2 * pre or factor < 2


@pytest.mark.parametrize("kwargs, plan", [
    (dict(), ReducePlan(1.0, 1 / 8)),
    (dict(reduce_op="sum"), ReducePlan(1.0, 1.0)),
    (dict(custom_divide_factor=2.0), ReducePlan(1.0, 0.5)),
    (dict(scaling_factor=0.5), ReducePlan(0.5, 1 / 8)),
    (dict(reduce_in_fp16=True), ReducePlan(0.5, 0.25)),
    (dict(reduce_in_fp16=True, force_sum=True), ReducePlan(1.0, 1 / 8)),
    (dict(reduce_in_fp16=True, scaling_factor=4.0), ReducePlan(2.0, 0.25)),
])
def test_plan_for_8_ranks(kwargs, plan):
    got = plan_reduction(8, **kwargs)
    assert got == plan
    scaling = kwargs.get("scaling_factor", 1.0)
    divide = divide_factor(8, kwargs.get("reduce_op", "avg"), kwargs.get("custom_divide_factor"))
    assert math.isclose(got.pre_scale * got.post_scale, scaling / divide), "scaling applied once"


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1.0, ValueError), (math.inf, ValueError),
                                        ("2", TypeError), (True, TypeError), ([1.0], TypeError)])
def test_bad_factors_are_rejected(bad, error):
    with pytest.raises(error, match="scaling factor"):
        validate_factor(bad, "gradient scaling factor")


def test_reduce_dtype_resolution():
    assert resolve_reduce_dtype("f32", "bf16", "g") == "f32"
    assert resolve_reduce_dtype(None, "bf16", "g") == "bf16"
    assert resolve_reduce_dtype(None, None, "g") == "g"
