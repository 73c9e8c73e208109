"""The differentiable collectives of tensor parallelism, each one autograd node.

[Note: written once, over the contract]
Each op is a forward and a backward written here over the platform's counted collectives
(``all_gather``, ``reduce_scatter``, ``all_reduce``: checked, watched and counted like
fully_shard's) and run as one autograd node by ``differentiable_call`` (torch: an
``autograd.Function``; MindSpore: a Cell with a custom ``bprop``). So every platform gets
the same ops with the same gradients, and no platform holds a decision about them. The
collectives move 1-D tensors: an op along ``dim`` moves ``dim`` to the front, sends the
flat values and moves it back.

| op                         | forward                   | backward                      |
| -------------------------- | ------------------------- | ----------------------------- |
| ``reduce_in_backward``     | identity                  | all-reduce (sum)              |
| ``all_reduce``             | all-reduce (sum)          | identity, or all-reduce       |
| ``all_gather``             | all-gather along ``dim``  | reduce-scatter, or own chunk  |
| ``reduce_scatter``         | reduce-scatter along dim  | all-gather along ``dim``      |
| ``split``                  | own chunk along ``dim``   | all-gather (then / n)         |
| ``to_partial``             | value / n                 | identity                      |
| ``scale_backward``         | identity                  | gradient / n                  |
"""

from __future__ import annotations

import math
from typing import Any, Callable

from hyper_parallel.platform import get_platform


def _node(x: Any, forward: Callable, backward: Callable) -> Any:
    """``forward(x)`` as one autograd node whose gradient is ``backward(grad)``."""
    platform = get_platform()

    def backward_fn(grads):
        return [None if grads[0] is None else backward(grads[0])]

    return platform.differentiable_call([x], lambda xs: [forward(xs[0])], backward_fn)[0]


def _group(mesh):
    return mesh.get_group(0), mesh.mesh_dim_names[0], mesh.size()


def gather_along(x: Any, dim: int, mesh: Any) -> Any:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (not differentiable)."""
    p = get_platform()
    group, name, _ = _group(mesh)
    moved = p.contiguous(p.movedim(x, dim, 0))
    shape = p.shape(moved)
    pieces = p.all_gather(p.reshape(moved, (-1,)), group, dim=name).wait().pieces
    whole = p.cat([p.reshape(piece, shape) for piece in pieces], 0)
    return p.contiguous(p.movedim(whole, 0, dim))


def scatter_sum_along(x: Any, dim: int, mesh: Any) -> Any:
    """This rank's chunk along ``dim`` of the sum of every rank's ``x`` (not differentiable)."""
    p = get_platform()
    group, name, size = _group(mesh)
    moved = p.contiguous(p.movedim(x, dim, 0))
    shape = p.shape(moved)
    rows = shape[0] // size
    flat = p.reshape(moved, (-1,))
    chunk = math.prod(shape) // size
    pieces = [[p.narrow(flat, 0, r * chunk, chunk)] for r in range(size)]
    mine = p.reduce_scatter(pieces, group, dim=name).wait()
    return p.contiguous(p.movedim(p.reshape(mine, (rows,) + tuple(shape[1:])), 0, dim))


def own_chunk(x: Any, dim: int, mesh: Any) -> Any:
    """This rank's chunk of ``x`` along ``dim``, in memory of its own."""
    p = get_platform()
    size = p.shape(x)[dim] // mesh.size()
    return p.contiguous(p.narrow(x, dim, mesh.get_local_rank(0) * size, size))


def summed(x: Any, mesh: Any, op: str = "sum") -> Any:
    """The sum (or max) of every rank's ``x``, in new memory (not differentiable)."""
    p = get_platform()
    group, name, _ = _group(mesh)
    out = p.clone(x)
    p.all_reduce(out, group, op=op, dim=name)
    return out


def reduce_in_backward(x: Any, mesh: Any) -> Any:
    """A whole (replicated) tensor handed to computations that return partial gradients:
    identity forward, the partial gradients summed in backward."""
    return _node(x, get_platform().alias, lambda g: summed(g, mesh))


def all_reduce(x: Any, mesh: Any, partial_grads: bool) -> Any:
    """Partial -> Replicate: summed forward. Backward: identity (whole gradients), or the
    consumers' partial gradients summed (``partial_grads``)."""
    back = (lambda g: summed(g, mesh)) if partial_grads else get_platform().alias
    return _node(x, lambda t: summed(t, mesh), back)


def all_gather(x: Any, dim: int, mesh: Any, partial_grads: bool) -> Any:
    """Shard(dim) -> Replicate. Backward: the consumers' partial gradients reduce-scattered
    (``partial_grads``), or this rank's chunk of the whole gradient."""
    back = (lambda g: scatter_sum_along(g, dim, mesh)) if partial_grads \
        else (lambda g: own_chunk(g, dim, mesh))
    return _node(x, lambda t: gather_along(t, dim, mesh), back)


def reduce_scatter(x: Any, dim: int, mesh: Any) -> Any:
    """Partial -> Shard(dim); backward: the gradient's chunks all-gathered."""
    return _node(x, lambda t: scatter_sum_along(t, dim, mesh),
                 lambda g: gather_along(g, dim, mesh))


def split(x: Any, dim: int, mesh: Any, partial_grads: bool) -> Any:
    """Replicate -> Shard(dim); backward: the chunks' gradients all-gathered, then divided
    by the mesh size where the source's gradients are partial sums (``partial_grads``)."""
    p = get_platform()
    size = mesh.size()
    back = (lambda g: p.divide(gather_along(g, dim, mesh), size)) if partial_grads \
        else (lambda g: gather_along(g, dim, mesh))
    return _node(x, lambda t: own_chunk(t, dim, mesh), back)


def to_partial(x: Any, mesh: Any) -> Any:
    """Replicate -> Partial (a row-wise layer's bias): ``x / n`` on every rank, so the sum
    is ``x``, as torch partitions it; the gradient passes whole."""
    p = get_platform()
    return _node(x, lambda t: p.divide(t, mesh.size()), p.alias)


def scale_backward(x: Any, mesh: Any) -> Any:
    """A replicated tensor whose consumers return whole gradients, handed to a producer
    that expects partial ones: identity forward, gradient / n."""
    p = get_platform()
    return _node(x, p.alias, lambda g: p.divide(g, mesh.size()))
