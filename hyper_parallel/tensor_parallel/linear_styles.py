"""``ColwiseParallel`` and ``RowwiseParallel``: linear and embedding layers split over a
1-D mesh, with torch's arguments, defaults and layouts.

[Note: the four splits]
- Column-wise linear: weight and bias split on dim 0 (output features). Input made
  replicated (its gradient summed over the ranks), output Shard(-1).
- Column-wise embedding: weight split on dim 1 (embedding dim); ids replicated.
- Row-wise linear: weight split on dim 1 (input features), bias replicated. Input made
  Shard(-1); the local product is a partial sum, to which each rank adds ``bias / n`` (as
  torch partitions a replicated bias into a partial one), then reduced to the output
  layout (Replicate: all-reduce; Shard(d): reduce-scatter).
- Row-wise embedding (vocabulary-parallel): weight split on dim 0 (vocabulary). Each rank
  looks up the ids in its own range (others read row 0 and are zeroed after), a partial
  sum reduced to the output layout.
"""

from __future__ import annotations


from hyper_parallel.platform import get_platform
from hyper_parallel.tensor_parallel import collectives as C
from hyper_parallel.tensor_parallel.layout import LayoutTensor, mark_local
from hyper_parallel.tensor_parallel.placement import (
    Partial, Replicate, Shard, check_placement)
from hyper_parallel.tensor_parallel.redistribute import check_movable, move
from hyper_parallel.tensor_parallel.style import (
    ParallelStyle, check_even, param_in_forward, prepared, split_param, style_on)

_LAYERS = ("torch: nn.Linear, nn.Embedding; MindSpore: nn.Dense without activation, "
           "mint.nn.Linear, nn.Embedding, mint.nn.Embedding")


class _LinearStyle(ParallelStyle):
    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True,
                 default_input=None, default_output=None):
        check_placement(input_layouts, "input_layouts", allow_none=True)
        check_placement(output_layouts, "output_layouts", allow_none=True)
        self.input_layouts = (input_layouts or default_input,)
        self.output_layouts = (output_layouts or default_output,)
        self.use_local_output = use_local_output

    def _layer(self, module):
        platform = get_platform()
        layer = platform.parallel_layer(module)
        if layer is None:
            reason = platform.unsplittable_reason(module)
            if reason is not None:
                raise NotImplementedError(f"{type(self).__name__} cannot split this "
                                          f"{type(module).__name__}: {reason}")
            raise NotImplementedError(
                f"{type(self).__name__} splits linear and embedding layers only ({_LAYERS}); "
                f"got {type(module).__name__}")
        return layer

    def _check_split(self, module, layer, dim: int, mesh) -> None:
        if dim not in layer.split_dims:
            raise NotImplementedError(
                f"{type(self).__name__} splits dim {dim} of {type(module).__name__}'s "
                f"{layer.weight!r}, and its forward computes only with dims {layer.split_dims} "
                f"split (it reshapes by a size it stored); use another style for it")
        check_even(module, layer.weight, dim, mesh, type(self).__name__)

    def _check_embedding_input(self, layer) -> None:
        if layer.kind == "embedding" and not self.input_layouts[0].is_replicate():
            raise NotImplementedError(
                f"{type(self).__name__} on an embedding takes replicated ids; got "
                f"input_layouts={self.input_layouts[0]}")

    def _output(self, module, local, source, mesh):
        out = move(local, source, self.output_layouts[0], mesh, source_grads_whole=True,
                   result_grads_whole=self.use_local_output)
        if self.use_local_output:
            return mark_local(out, self.output_layouts[0], mesh, style_on(self, module))
        return LayoutTensor(out, self.output_layouts[0], mesh)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts="
                f"{self.output_layouts}, use_local_output={self.use_local_output})")


class ColwiseParallel(_LinearStyle):
    """Split a linear layer's output features (or an embedding's dim) over the mesh."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output, default_input=Replicate(),
                         default_output=Shard(-1))

    def check(self, module, mesh):
        layer = self._layer(module)
        self._check_embedding_input(layer)
        self._check_split(module, layer, 0 if layer.kind == "linear" else 1, mesh)
        check_movable(self.input_layouts[0], Replicate())
        check_movable(Shard(-1), self.output_layouts[0])

    def apply(self, module, mesh):
        layer = self._layer(module)
        dim = 0 if layer.kind == "linear" else 1
        for attr in (layer.weight, layer.bias):
            if attr is not None:
                split_param(module, attr, Shard(dim), mesh, self.src_data_rank)
        partial_input = layer.kind == "linear"  # its product returns partial input grads

        def pre(mod, args, kwargs):
            local = prepared(args[0], self.input_layouts[0], Replicate(), mesh,
                             result_grads_whole=not partial_input,
                             consumer=style_on(self, mod))
            return (local,) + tuple(args[1:]), kwargs

        def post(mod, args, kwargs, output):
            return self._output(mod, output, Shard(-1), mesh)

        get_platform().register_forward_hooks(module, pre, post)
        return module


class RowwiseParallel(_LinearStyle):
    """Split a linear layer's input features (or an embedding's vocabulary) over the mesh."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output, default_input=Shard(-1),
                         default_output=Replicate())

    def check(self, module, mesh):
        layer = self._layer(module)
        self._check_embedding_input(layer)
        self._check_split(module, layer, 1 if layer.kind == "linear" else 0, mesh)
        if layer.kind == "linear":
            check_movable(self.input_layouts[0], Shard(-1))

    def apply(self, module, mesh):
        layer = self._layer(module)
        if layer.kind == "embedding":
            split_param(module, layer.weight, Shard(0), mesh, self.src_data_rank)
            return self._apply_vocabulary(module, layer, mesh)
        split_param(module, layer.weight, Shard(1), mesh, self.src_data_rank)
        if layer.bias is not None:
            split_param(module, layer.bias, Replicate(), mesh, self.src_data_rank)
        p = get_platform()

        def pre(mod, args, kwargs):
            local = prepared(args[0], self.input_layouts[0], Shard(-1), mesh,
                             result_grads_whole=True, consumer=style_on(self, mod))
            if layer.bias is not None:
                p.read_in_forward(mod, layer.bias,
                                C.to_partial(param_in_forward(mod, layer.bias), mesh))
            return (local,) + tuple(args[1:]), kwargs

        def post(mod, args, kwargs, output):
            if layer.bias is not None:
                p.end_read_in_forward(mod, layer.bias)
            return self._output(mod, output, Partial(), mesh)

        p.register_forward_hooks(module, pre, post)
        return module

    def _apply_vocabulary(self, module, layer, mesh):
        p = get_platform()
        rows = p.shape(p.registered_param(module, layer.weight))[0]
        low = mesh.get_local_rank(0) * rows
        in_range = []  # per call in flight: the mask of the ids this rank holds

        def pre(mod, args, kwargs):
            ids = args[0]
            if isinstance(ids, LayoutTensor):
                if not ids.placement.is_replicate():
                    raise NotImplementedError(f"{type(self).__name__} on an embedding takes "
                                              f"replicated ids; got a {ids!r}")
                ids = ids.local_tensor
            mask = p.in_range(ids, low, low + rows)
            in_range.append(mask)
            local_ids = p.where(mask, p.subtract(ids, low), 0)
            return (local_ids,) + tuple(args[1:]), kwargs

        def post(mod, args, kwargs, output):
            mask = in_range.pop()
            keep = p.reshape(mask, tuple(p.shape(mask)) + (1,))
            return self._output(mod, p.where(keep, output, 0.0), Partial(), mesh)

        p.register_forward_hooks(module, pre, post)
        return module
