"""Reduce-op and scaling resolution: pure functions, no tensors, no framework.

[Note: why SUM plus explicit scaling]
Every gradient collective reduces with SUM and every division is an explicit
multiplication, for three reasons: gloo has no PREMUL_SUM, MindSpore's composed
reduce-scatter is an all-reduce whose AVG would divide by the wrong group, and padding stays
exact (zeros sum to zeros). The user's knobs only change the two factors below.

[Note: where each factor is applied, exactly once]
``pre_scale`` multiplies each gradient before its first collective (reduce-scatter, or the
all-reduce of an unsharded parameter, or nothing at world size 1): it carries the user's
gradient scaling factor and the fp16 pre-divide. ``post_scale`` multiplies the result of the
shard-dim reduction, before the replicate all-reduce and before gradients deferred by
``set_requires_all_reduce(False)`` are folded in, so every gradient that reaches the
all-reduce is already in its final scale and sums stay linear.

[Note: fp16]
Summing N fp16 gradients before dividing can overflow; dividing first can underflow. For
fp16 the divide factor F is split: ``pre`` = the largest power of two not above sqrt(F)
before the collective, F / pre after it (a power of two divides exactly).
``force_sum_reduction_for_comms`` turns the split off: the collectives sum the raw
(scaled) gradients and the whole division happens after.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

REDUCE_OP_TYPES = ("avg", "sum")


@dataclass(frozen=True)
class ReducePlan:
    """Multiply by ``pre_scale`` before the first collective, by ``post_scale`` after the
    shard-dim reduction. Collectives always SUM."""

    pre_scale: float
    post_scale: float


def normalize_reduce_op(op: str) -> str:
    """"avg"/"sum" in any case; anything else is an error naming the valid values."""
    if not isinstance(op, str) or op.strip().lower() not in REDUCE_OP_TYPES:
        raise ValueError(f"reduce op type must be one of {REDUCE_OP_TYPES} (case-insensitive), got {op!r}")
    return op.strip().lower()


def validate_factor(value: float, what: str) -> float:
    """A positive finite float; anything else is an error naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a float, an int or a one-element tensor, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive finite number, got {value}")
    return value


def divide_factor(data_parallel_size: int, reduce_op: str, custom_divide_factor: float | None) -> float:
    """What the summed gradient is divided by: the custom factor when set, else the
    data-parallel size for "avg" and 1 for "sum"."""
    if custom_divide_factor is not None:
        return custom_divide_factor
    return float(data_parallel_size) if normalize_reduce_op(reduce_op) == "avg" else 1.0


def fp16_pre_divide(factor: float) -> float:
    """The largest power of two not above sqrt(factor) (1 for factor <= 1)."""
    if factor <= 1.0:
        return 1.0
    return 2.0 ** math.floor(math.log2(math.sqrt(factor)))


def plan_reduction(data_parallel_size: int, *, reduce_op: str = "avg",
                   custom_divide_factor: float | None = None, scaling_factor: float = 1.0,
                   reduce_in_fp16: bool = False, force_sum: bool = False) -> ReducePlan:
    """The two factors of one gradient reduction (see the notes at the top of the file)."""
    factor = divide_factor(data_parallel_size, reduce_op, custom_divide_factor)
    pre = fp16_pre_divide(factor) if reduce_in_fp16 and not force_sum else 1.0
    return ReducePlan(pre_scale=scaling_factor / pre, post_scale=pre / factor)


def resolve_reduce_dtype(reduce_dtype, param_dtype, grad_dtype):
    """reduce_dtype, else param_dtype, else the gradient's own dtype."""
    if reduce_dtype is not None:
        return reduce_dtype
    if param_dtype is not None:
        return param_dtype
    return grad_dtype
