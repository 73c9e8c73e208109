"""One tensor moved from one placement to another, with DTensor's gradients.

[Note: whose gradient is partial]
DTensor tracks a gradient's placement at run time. Here a gradient is a plain tensor, so
its meaning is fixed by who made it (layout.py, [Note: activations between styles]): the
gradient of a plain tensor is whole; the gradient a computation over a replicated input
returns is partial whenever that computation is split (a column-wise layer's product with
its weight block), and so is the gradient of a replicated ``LayoutTensor``. Each move
below therefore asks two things: are the source's gradients whole, and are the result's
(``source_grads_whole``, ``result_grads_whole``); only replicated values care. With them,
each move is the op torch's redistribution and its backward amount to:

| source -> target        | forward         | backward                                       |
| ----------------------- | --------------- | ---------------------------------------------- |
| Partial -> Replicate    | all-reduce      | identity (result whole) / all-reduce (partial) |
| Partial -> Shard(d)     | reduce-scatter  | all-gather                                     |
| Shard(d) -> Replicate   | all-gather      | own chunk (result whole) / reduce-scatter      |
| Replicate -> Shard(d)   | own chunk       | all-gather (/ n where the source is partial)   |
| Replicate -> Replicate  | identity        | all-reduce (whole -> partial result), / n      |
|                         |                 | (partial source -> whole result), else none    |
| Shard(d) -> Shard(d)    | identity        | identity                                       |

Shard(d) -> Shard(e) (an all-to-all) is not supported.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.platform import get_platform
from hyper_parallel.tensor_parallel import collectives as C
from hyper_parallel.tensor_parallel.placement import Placement, Shard, normalized


def move(local: Any, source: Placement, target: Placement, mesh: Any, *,
         source_grads_whole: bool, result_grads_whole: bool) -> Any:
    """``local`` (this rank's values in ``source``) as this rank's values in ``target``."""
    ndim = len(get_platform().shape(local))
    source, target = normalized(source, ndim), normalized(target, ndim)
    if source.is_partial():
        if target.is_replicate():
            return C.all_reduce(local, mesh, partial_grads=not result_grads_whole)
        return C.reduce_scatter(local, target.dim, mesh)
    if source == target:
        if source.is_replicate() and source_grads_whole and not result_grads_whole:
            return C.reduce_in_backward(local, mesh)
        if source.is_replicate() and not source_grads_whole and result_grads_whole:
            return C.scale_backward(local, mesh)
        return local
    if source.is_shard() and target.is_replicate():
        return C.all_gather(local, source.dim, mesh, partial_grads=not result_grads_whole)
    if source.is_replicate() and target.is_shard():
        return C.split(local, target.dim, mesh, partial_grads=not source_grads_whole)
    raise NotImplementedError(f"moving a tensor from {source} to {target} (an all-to-all) is "
                              f"not supported by hyper_parallel.tensor_parallel")


def check_movable(source: Placement, target: Placement) -> None:
    """The error ``move`` would raise for this pair, raised before anything changes (dims
    as given: a negative and a positive dim may still name the same one)."""
    if isinstance(source, Shard) and isinstance(target, Shard) and source.dim != target.dim \
            and (source.dim < 0) == (target.dim < 0):
        raise NotImplementedError(f"moving a tensor from {source} to {target} (an all-to-all) "
                                  f"is not supported by hyper_parallel.tensor_parallel")
