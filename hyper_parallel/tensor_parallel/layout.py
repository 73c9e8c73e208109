"""What tensor parallelism records: the layout on each parameter it split or replicated, and
the layout an activation carries between styles.

[Note: one framework-neutral description per parameter]
A parameter a style split holds only its local block, as a plain framework parameter (the
module computes with it as with any parameter, and an optimizer updates it as any other).
What the block is part of is recorded on the parameter itself, under ``LAYOUT_ATTR``, as
one ``ParamLayout``: the mesh, the placement, the whole shape and this rank's offset in
every dim. It is the only place fully_shard, checkpoints, export and clipping may learn
that a parameter is part of a bigger one (``tensor_parallel_layout``). fully_shard shards
the block and keeps the record on the sharded parameter (fully_shard/param.py), clipping
reduces a split block's norm over its mesh (clip_grad.py), checkpoints store the block as
a region of the whole tensor (checkpoint/layout.py), and state dicts and export lay it out
as a box of the whole value and gather it over the mesh (checkpoint/state_dict.py,
full_state.py).

[Note: activations between styles]
A style's output is a plain tensor (``use_local_output=True``, torch's default for the
linear styles): this rank's local values, whose layout the next style is told by its
``input_layouts``. With ``use_local_output=False`` it is a ``LayoutTensor``: the local
tensor and its placement, which the next style reads instead of its ``input_layouts`` (as
torch's styles read a DTensor's placements) and the loss (``cross_entropy``) requires.
A ``LayoutTensor`` is no framework tensor: only styles, ``cross_entropy`` and
``to_local()`` take it. Its gradient convention is DTensor's: the gradient a consumer
returns for a *replicated* ``LayoutTensor`` is a partial sum, reduced once by whoever made
it (redistribute.py); a plain tensor's gradient is always whole.

[Note: a plain output remembers its layout]
A style's plain (local) output carries the placement it is in (``mark_local``), so a
style that receives that very tensor and is told another layout by its
``input_layouts`` (torchtitan's head takes ``Shard(1)`` from a sequence-parallel norm;
``Shard(0)`` there gathers the rows in another order than the targets, and trains on a
wrong loss without a word) raises, naming both (style.py ``prepared``). A tensor the
model computed anew from it carries nothing: its layout is what the model made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyper_parallel.platform import get_platform
from hyper_parallel.tensor_parallel.placement import Placement, Shard, normalized
from hyper_parallel.tensor_parallel.redistribute import move

#: the attribute of a parameter that holds its ``ParamLayout``
LAYOUT_ATTR = "hp_tensor_parallel"


@dataclass(frozen=True)
class ParamLayout:
    """A tensor-parallel parameter's place in the whole tensor."""

    mesh: Any               # the 1-D hyper_parallel DeviceMesh it is split over
    placement: Placement    # Shard(dim) or Replicate()
    whole_shape: tuple      # the shape of the whole parameter
    offset: tuple           # where this rank's block starts, per dim

    @property
    def mesh_dim_name(self) -> str:
        return self.mesh.mesh_dim_names[0]


def tensor_parallel_layout(param: Any) -> ParamLayout | None:
    """The layout tensor parallelism recorded on ``param``; None for any other parameter."""
    return getattr(param, LAYOUT_ATTR, None)


def record_layout(param: Any, layout: ParamLayout) -> None:
    setattr(param, LAYOUT_ATTR, layout)


#: on a style's plain output: ``(its placement, the mesh's ranks, who made it)``
_PRODUCED_ATTR = "_hp_tensor_parallel_output"


def named(who: Any) -> str:
    """How an error names ``who``: a text as it is, a (style, module) pair (style.py
    ``style_on``) as ``ColwiseParallel on Linear``."""
    if isinstance(who, str):
        return who
    style, module = who
    return f"{type(style).__name__} on {type(module).__name__}"


def mark_local(tensor: Any, placement: Placement, mesh: Any, producer: Any) -> Any:
    """``tensor``, a style's plain output in ``placement`` over ``mesh``, marked so ([Note:
    a plain output remembers its layout]); ``producer``: who made it (``named``)."""
    setattr(tensor, _PRODUCED_ATTR, (placement, mesh.ranks, producer))
    return tensor


def check_declared(tensor: Any, declared: Placement, mesh: Any, consumer: Any) -> None:
    """ValueError where ``tensor`` is a style's plain output over ``mesh`` in another
    placement than ``declared``, the layout ``consumer`` (``named``) was told it is in."""
    produced = getattr(tensor, _PRODUCED_ATTR, None)
    if produced is None or produced[1] != mesh.ranks:
        return
    placement, _, producer = produced
    ndim = len(get_platform().shape(tensor))
    if normalized(placement, ndim) != normalized(declared, ndim):
        consumer, producer = named(consumer), named(producer)
        raise ValueError(
            f"{consumer} is told its input is in {declared}, but the input is the output of "
            f"{producer}, which is in {placement}: taken as {declared} its rows or columns "
            f"would land in another order than the model's; set the layout to {placement} "
            f"(e.g. input_layouts={placement!r}), or have {producer} hand a LayoutTensor "
            f"over (use_local_output=False)")


class LayoutTensor:
    """A local tensor and its placement, as one style hands it to the next with
    ``use_local_output=False`` (torch: a DTensor). See [Note: activations between styles]."""

    def __init__(self, local: Any, placement: Placement, mesh: Any):
        #: this rank's values as they are, for styles and the loss (``to_local()`` is the
        #: differentiable way out, with the gradient convention above)
        self.local_tensor = local
        self.placement = placement
        self.device_mesh = mesh

    @property
    def placements(self) -> tuple:
        return (self.placement,)

    @property
    def shape(self) -> tuple:
        """The whole tensor's shape (as a DTensor's)."""
        shape = list(get_platform().shape(self.local_tensor))
        if self.placement.is_shard():
            dim = self.placement.dim % len(shape)
            shape[dim] *= self.device_mesh.size()
        return tuple(shape)

    def reshape(self, *shape) -> LayoutTensor:
        """The whole tensor reshaped to ``shape`` (the whole shape, one dim may be -1), as
        ``DTensor.reshape`` for the moves that need no collective: any reshape of a
        replicated tensor, and of one split on its last dim that keeps that dim (flattening
        the leading dims of logits for the loss). Anything else is a NotImplementedError."""
        p = get_platform()
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) \
            else tuple(shape)
        placement, whole = self.placement, self.shape
        if placement.is_replicate():
            return LayoutTensor(p.reshape(self.local_tensor, shape), placement, self.device_mesh)
        if normalized(placement, len(whole)) != Shard(len(whole) - 1) or not shape or \
                shape[-1] != whole[-1]:
            raise NotImplementedError(
                f"LayoutTensor.reshape of a tensor {placement} of shape {whole} to {shape}: "
                f"only reshapes that keep the split last dim are supported (they need no "
                f"collective); move it to Replicate() first")
        local = shape[:-1] + (p.shape(self.local_tensor)[-1],)
        return LayoutTensor(p.reshape(self.local_tensor, local), Shard(len(shape) - 1),
                            self.device_mesh)

    def astype(self, dtype: Any) -> LayoutTensor:
        """The same layout in ``dtype`` (a framework dtype), e.g. float32 logits for the loss."""
        return LayoutTensor(get_platform().cast(self.local_tensor, dtype), self.placement,
                            self.device_mesh)

    def to_local(self) -> Any:
        """This rank's values as a plain tensor (its gradient then counts as whole)."""
        local = move(self.local_tensor, self.placement, self.placement, self.device_mesh,
                     source_grads_whole=False, result_grads_whole=True)
        return mark_local(local, self.placement, self.device_mesh, "LayoutTensor.to_local()")

    def __repr__(self) -> str:
        return f"LayoutTensor(shape={self.shape}, placement={self.placement})"

    # [Note: a framework op given a LayoutTensor]
    # A LayoutTensor is no framework tensor, and a framework's own op refuses it with a
    # message that does not say why (MindSpore: "must be a Tensor, but got 'External'").
    # Each framework asks the object first through a protocol of its own: torch calls
    # ``__torch_function__`` of an argument's type, MindSpore's op conversion looks up
    # ``__ms_class__``. Both answer with the way out, the same on both frameworks.

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(_not_a_tensor(getattr(func, "__name__", str(func))))

    def __getattr__(self, name: str):
        if name.startswith("__ms_"):
            raise TypeError(_not_a_tensor("a MindSpore op"))
        raise AttributeError(f"'LayoutTensor' object has no attribute {name!r}")


def _not_a_tensor(op: str) -> str:
    return (f"{op} was given a LayoutTensor (a value split over the tensor-parallel mesh, made "
            f"by a style with use_local_output=False), which is no framework tensor: for the "
            f"loss, call hp.cross_entropy(logits, targets) inside hp.loss_parallel(); for "
            f"anything else, take this rank's part with .to_local() or give the style "
            f"use_local_output=True")
