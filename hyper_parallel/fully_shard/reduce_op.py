"""Reduce-op and divide-factor resolution: pure functions, no tensors, no framework.

[Note: why SUM plus explicit division]
Every collective reduces with SUM and averaging is an explicit multiplication, for three
reasons: gloo has no PREMUL_SUM, MindSpore's composed reduce-scatter is an all-reduce whose
AVG would divide by the wrong group, and padding stays exact (zeros sum to zeros).

[Note: fp16]
Summing N fp16 gradients before dividing can overflow; dividing first can underflow. For
fp16 the factor N is split: divide by ``pre`` before the collective and by ``post = N/pre``
after, with ``pre`` the largest power of two not above sqrt(N) (a power of two divides
exactly in binary floating point).
"""

from __future__ import annotations

import math

REDUCE_OP_TYPES = ("avg", "sum")


def normalize_reduce_op(op: str) -> str:
    """"avg"/"sum" in any case; anything else is an error naming the valid values."""
    if not isinstance(op, str) or op.lower() not in REDUCE_OP_TYPES:
        raise ValueError(f"reduce op must be one of {REDUCE_OP_TYPES} (case-insensitive), got {op!r}")
    return op.lower()


def divide_factors(data_parallel_size: int, reduce_op: str = "avg", divide_factor: float | None = None,
                   split_for_fp16: bool = False) -> tuple[float, float]:
    """(pre, post): divide gradients by ``pre`` before the first collective and by ``post``
    after the last one. ``avg`` divides by the data-parallel size (or ``divide_factor``),
    ``sum`` divides by nothing unless ``divide_factor`` is set."""
    factor = float(divide_factor) if divide_factor is not None else (
        float(data_parallel_size) if normalize_reduce_op(reduce_op) == "avg" else 1.0)
    if factor <= 0:
        raise ValueError(f"gradient divide factor must be > 0, got {factor}")
    if not split_for_fp16 or factor <= 1.0:
        return 1.0, factor
    pre = 2.0 ** math.floor(math.log2(math.sqrt(factor)))
    return pre, factor / pre


def resolve_reduce_dtype(reduce_dtype, param_dtype, grad_dtype):
    """reduce_dtype, else param_dtype, else the gradient's own dtype."""
    if reduce_dtype is not None:
        return reduce_dtype
    if param_dtype is not None:
        return param_dtype
    return grad_dtype
