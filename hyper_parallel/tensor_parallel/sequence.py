"""``SequenceParallel``: a module whose parameters stay whole (a norm, dropout) run on this
rank's part of the sequence, with torch's arguments and defaults.

The input is taken to be Shard(sequence_dim) (a ``LayoutTensor`` in another layout is
moved there); the output is Shard(sequence_dim), a ``LayoutTensor`` unless
``use_local_output``. Each parameter is read, during the forward, through an op whose
backward sums its gradient over the ranks: each rank's gradient covers only its part of
the sequence. torch leaves that sum to the optimizer step (a Partial gradient on a
replicated DTensor); here the gradient a parameter receives is already the whole one.
"""

from __future__ import annotations

from hyper_parallel.platform import get_platform
from hyper_parallel.tensor_parallel import collectives as C
from hyper_parallel.tensor_parallel.layout import LayoutTensor, mark_local
from hyper_parallel.tensor_parallel.placement import Shard
from hyper_parallel.tensor_parallel.style import (
    ParallelStyle, param_in_forward, prepared, record_replicated, style_on)


class SequenceParallel(ParallelStyle):
    """Run ``module`` on sequence shards, its parameters replicated."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        if not isinstance(sequence_dim, int):
            raise TypeError(f"SequenceParallel: sequence_dim must be an int; got {sequence_dim!r}")
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def apply(self, module, mesh):
        p = get_platform()
        names = record_replicated(module, mesh)
        layout = self.sequence_sharding[0]

        def pre(mod, args, kwargs):
            if not args or not (p.is_tensor(args[0]) or isinstance(args[0], LayoutTensor)):
                raise ValueError(f"expecting input of {type(mod).__name__} to be a tensor or a "
                                 f"LayoutTensor, but got {args[0] if args else None!r}")
            local = prepared(args[0], layout, layout, mesh, result_grads_whole=True,
                             consumer=style_on(self, mod))
            for attr in names:
                p.read_in_forward(mod, attr, C.reduce_in_backward(param_in_forward(mod, attr),
                                                                mesh))
            return (local,) + tuple(args[1:]), kwargs

        def post(mod, args, kwargs, output):
            for attr in names:
                p.end_read_in_forward(mod, attr)
            if self.use_local_output:
                return mark_local(output, layout, mesh, style_on(self, mod))
            return LayoutTensor(output, layout, mesh)

        p.register_forward_hooks(module, pre, post)
        return module

    def __repr__(self) -> str:
        return (f"SequenceParallel(sequence_dim={self.sequence_sharding[0].dim}, "
                f"use_local_output={self.use_local_output})")
