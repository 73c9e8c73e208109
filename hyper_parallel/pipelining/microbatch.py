"""Cutting a step's batch into micro-batches (torch's ``pipelining.microbatch``, dim 0 only).

Every tensor argument is cut along dim 0 into ``n`` equal chunks, as torch's default
``TensorChunkSpec(0)`` does; other arguments go whole to every micro-batch. A batch that
``n`` does not divide is refused before anything runs: unequal micro-batches would weigh
rows unequally under a mean loss and change the stages' shapes within a step.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.platform import get_platform


def split_args_kwargs_into_chunks(args: tuple, kwargs: dict | None, chunks: int) -> tuple:
    """``(args_per_chunk, kwargs_per_chunk)``: lists of ``chunks`` tuples and dicts."""
    kwargs = kwargs or {}
    cut_args = [_cut(a, chunks, f"positional argument {i}") for i, a in enumerate(args)]
    cut_kwargs = {k: _cut(v, chunks, f"keyword argument {k!r}") for k, v in kwargs.items()}
    return ([tuple(a[i] for a in cut_args) for i in range(chunks)],
            [{k: v[i] for k, v in cut_kwargs.items()} for i in range(chunks)])


def split_target(target: Any, chunks: int) -> list:
    """The target cut as the inputs are; ``[None] * chunks`` without one."""
    return [None] * chunks if target is None else _cut(target, chunks, "target")


def _cut(value: Any, chunks: int, what: str) -> list:
    p = get_platform()
    if not p.is_tensor(value):
        return [value] * chunks
    rows = p.shape(value)[0] if p.shape(value) else 0
    if rows % chunks:
        raise ValueError(f"the {what} has {rows} rows on dim 0, which n_microbatches="
                         f"{chunks} does not divide: pass a batch whose size is a multiple "
                         f"of n_microbatches, or a divisor of {rows} as n_microbatches")
    size = rows // chunks
    return [p.narrow(value, 0, i * size, size) for i in range(chunks)]
