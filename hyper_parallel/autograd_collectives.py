"""The differentiable exchanges of activations between ranks: all-to-all and ring shift.

[Note: one autograd node each, written once]
Expert parallelism sends each token to the rank of its expert and back (an all-to-all with
uneven splits); context parallelism passes keys and values around a ring (a shift by one
rank) or trades heads for sequence (an all-to-all). Each op here is the platform's
collective as one autograd node (``differentiable_call``) whose backward is the reverse
exchange: the gradient of what a rank received goes back to the rank that sent it. So
every parallelism gets the same gradients on every platform, and none writes its own.

The ops work over a one-dimensional hp ``DeviceMesh`` (a slice of a larger one, such as
``mesh["ep"]``): its group, its dim name for the counters, its size. They move dim-0 rows
of any shape; the other dims travel with their row.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from hyper_parallel.platform import get_platform


def _group(mesh: Any) -> tuple:
    return mesh.get_group(0), mesh.mesh_dim_names[0], mesh.size()


def _rows_all_to_all(x: Any, input_splits: Sequence[int], output_splits: Sequence[int],
                     mesh: Any) -> Any:
    """The all-to-all of ``x``'s dim-0 rows (not differentiable)."""
    p = get_platform()
    group, name, _ = _group(mesh)
    shape = tuple(p.shape(x))
    row = math.prod(shape[1:])
    flat = p.reshape(p.contiguous(x), (-1,))
    received = p.all_to_all(flat, [n * row for n in input_splits],
                            [n * row for n in output_splits], group, dim=name).wait()
    return p.reshape(received, (sum(output_splits),) + shape[1:])


def all_to_all(x: Any, input_splits: Sequence[int], output_splits: Sequence[int],
               mesh: Any) -> Any:
    """Send ``x``'s dim-0 rows to the ranks of ``mesh``: the first ``input_splits[0]`` rows
    to rank 0, the next ``input_splits[1]`` to rank 1, ...; return the rows received,
    ``output_splits[r]`` from rank r, in rank order. Splits may be uneven or zero (a rank
    that routes nothing to a peer sends it nothing). Differentiable: the backward sends each
    row's gradient back to the rank it came from."""
    input_splits, output_splits = [int(n) for n in input_splits], [int(n) for n in output_splits]
    size = mesh.size()
    if len(input_splits) != size or len(output_splits) != size:
        raise ValueError(f"hyper_parallel: all_to_all over {size} ranks needs {size} input and "
                         f"output splits, got {len(input_splits)} and {len(output_splits)}")
    rows = get_platform().shape(x)[0]
    if sum(input_splits) != rows:
        raise ValueError(f"hyper_parallel: all_to_all's input splits {input_splits} add up to "
                         f"{sum(input_splits)} rows, the input has {rows}")
    return get_platform().differentiable_call(
        [x], lambda xs: [_rows_all_to_all(xs[0], input_splits, output_splits, mesh)],
        lambda grads: [None if grads[0] is None
                       else _rows_all_to_all(grads[0], output_splits, input_splits, mesh)])[0]


def exchange_counts(counts: Any, mesh: Any) -> Any:
    """Tell every rank how many items this one will send it: ``counts`` is a 1-D integer
    tensor of ``mesh.size() * m`` entries (m per destination rank, in rank order, e.g. the
    tokens for each of a rank's m experts); the result has the same length, the m entries
    every source rank sent this one, in source order. Not differentiable."""
    p = get_platform()
    size = mesh.size()
    total = p.shape(counts)[0]
    if total % size:
        raise ValueError(f"hyper_parallel: exchange_counts needs {size} equal groups of counts "
                         f"(one per rank), got {total} counts")
    share = [total // size] * size
    return _rows_all_to_all(counts, share, share, mesh)


def _shifted(x: Any, mesh: Any, shift: int) -> Any:
    """``x`` of the rank ``shift`` places before this one (not differentiable)."""
    p = get_platform()
    group, name, size = _group(mesh)
    me = mesh.get_local_rank(0)
    sending = p.send(x, (me + shift) % size, group, dim=name)
    receiving = p.recv(p.shape(x), p.dtype_of(x), (me - shift) % size, group, dim=name)
    received = receiving.wait()
    sending.wait()
    return received


def ring_shift(x: Any, mesh: Any, shift: int = 1) -> Any:
    """Pass ``x`` around the ring of ``mesh``'s ranks: send it to rank ``me + shift`` and
    return what rank ``me - shift`` sent (same shape and dtype on every rank). ``mesh.size()``
    shifts by one bring a tensor back to its owner. Differentiable: the backward shifts the
    gradient the other way. A shift by a multiple of the ring's size returns ``x``."""
    if shift % mesh.size() == 0:
        return x
    return get_platform().differentiable_call(
        [x], lambda xs: [_shifted(xs[0], mesh, shift)],
        lambda grads: [None if grads[0] is None else _shifted(grads[0], mesh, -shift)])[0]
