"""``ParallelStyle``: what every style does to a module, the parameter split they share, and
the input a style receives (``prepared``).

[Note: check, then change]
``parallelize_module`` first asks every style of the plan whether it can apply to its
modules (``check``: the layer kind, even splits, the layouts), and only when all can does
it call ``apply``. ``apply`` replaces parameters by their local blocks (recording each
block's ``ParamLayout``) and installs the forward hooks that move activations; it raises
nothing a check could have found.

[Note: styles under fully_shard]
``fully_shard`` over a tensor-parallel module (TP first, then FSDP, as torchtitan
composes them) shards each parameter's local block over the data-parallel mesh; while its
unit is unsharded, the module reads the gathered block, which is exactly the parameter
the style computes with. A style that reads a parameter itself (a row-wise bias made
partial, a sequence-parallel norm's parameters) therefore reads what the module reads now
(``param_in_forward``), never the registered parameter, and puts back what it shadowed
(``read_in_forward``/``end_read_in_forward``). Hook order: ``register_forward_hooks``
prepends pre-hooks and appends post-hooks, and ``fully_shard`` comes after
``parallelize_module``, so on a module that is both a unit and styled (a block under
``PrepareModuleInput``), the unit gathers before any style runs and reshards after every
style's post-hook: styles always see full blocks. ``parallelize_module`` after
``fully_shard`` would see shards, which is why it must come first.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.platform import get_platform
from hyper_parallel.tensor_parallel.layout import (
    LayoutTensor, ParamLayout, check_declared, record_layout)
from hyper_parallel.tensor_parallel.placement import Placement, Replicate, Shard
from hyper_parallel.tensor_parallel.redistribute import move


class ParallelStyle:
    """How ``parallelize_module`` parallelizes one module (torch's ``ParallelStyle``)."""

    #: the mesh rank whose values a split parameter takes (torch's ``src_data_rank``);
    #: ``parallelize_module`` sets it on the style; None: every rank keeps its own values
    src_data_rank: int | None = 0

    def check(self, module: Any, mesh: Any) -> None:
        """Raise the error ``apply`` would meet, before anything changes."""

    def apply(self, module: Any, mesh: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement apply")


def style_on(style: ParallelStyle, module: Any) -> tuple:
    """A style at work on a module, as errors name it (``ColwiseParallel on Linear``,
    layout.py ``named``): kept as the pair, and spelled only when an error is raised, as
    the styles pass it on every forward."""
    return (style, module)


def param_in_forward(module: Any, attr: str) -> Any:
    """``module.<attr>`` as the module's forward reads it now: the registered parameter,
    or the full block ``fully_shard`` attached while its unit is unsharded; never what an
    earlier forward cut short (a recomputation stopped early) left it reading."""
    get_platform().end_read_in_forward(module, attr)
    return getattr(module, attr)


def whole_values(param: Any, mesh: Any, src_data_rank: int | None) -> Any:
    """The whole parameter as mesh rank ``src_data_rank`` holds it (every rank's own
    values for None), so that every rank starts from the same whole tensor, as torch's
    ``distribute_tensor`` scatters rank 0's (here: an all-gather of it, at apply time)."""
    p = get_platform()
    if src_data_rank is None or mesh.size() == 1:
        return param
    with p.no_grad():
        flat = p.contiguous(p.reshape(param, (-1,)))
        pieces = p.all_gather(flat, mesh.get_group(0), dim=mesh.mesh_dim_names[0]).wait().pieces
        return p.reshape(p.clone(pieces[src_data_rank]), p.shape(param))


def split_param(module: Any, attr: str, placement: Placement, mesh: Any,
                src_data_rank: int | None) -> None:
    """Replace ``module.<attr>`` by a plain parameter holding this rank's block of it in
    ``placement`` (Shard(dim) or Replicate), its ``ParamLayout`` recorded on it."""
    p = get_platform()
    param = p.registered_param(module, attr)
    shape = tuple(p.shape(param))
    offset, dim, size = [0] * len(shape), 0, shape[0] if shape else 0
    if isinstance(placement, Shard):
        dim, size = placement.dim, shape[placement.dim] // mesh.size()
        offset[dim] = mesh.get_local_rank(0) * size
    with p.no_grad():
        if p.is_deferred(param):
            # built without values (no_init_parameters, meta): only this rank's block is
            # made, from the parameter's initializer; its values come later (a
            # checkpoint), so there is nothing to take from src_data_rank
            values = p.deferred_part(param, dim, offset[dim], size)
        else:
            values = whole_values(param, mesh, src_data_rank)
            if isinstance(placement, Shard):
                values = p.narrow(values, dim, offset[dim], size)
    new = p.new_local_param(param, p.contiguous(values))
    for name, value in vars(param).items():
        if name.startswith("_hp_"):  # what the library set on it (a gather codec) stays
            object.__setattr__(new, name, value)
    record_layout(new, ParamLayout(mesh, placement, shape, tuple(offset)))
    p.set_local_param(module, attr, new)


def record_replicated(module: Any, mesh: Any) -> list:
    """Record every parameter of ``module`` (its own, not its submodules') as replicated
    over ``mesh``, values and objects unchanged; return their names."""
    p = get_platform()
    names = []
    for attr, param in p.direct_params(module):
        record_layout(param, ParamLayout(mesh, Replicate(), tuple(p.shape(param)),
                                         (0,) * len(p.shape(param))))
        names.append(attr)
    return names


def check_even(module: Any, attr: str, dim: int, mesh: Any, style: str) -> None:
    """ValueError unless ``module.<attr>`` splits evenly along ``dim`` over ``mesh``."""
    p = get_platform()
    shape = tuple(p.shape(p.registered_param(module, attr)))
    if shape[dim] % mesh.size():
        raise ValueError(
            f"{style}: parameter {attr!r} of {type(module).__name__} has shape {shape}; its "
            f"dim {dim} ({shape[dim]}) does not split evenly over {mesh.size()} ranks, and "
            f"hyper_parallel.tensor_parallel supports even splits only (torch also splits "
            f"unevenly); choose sizes divisible by the tensor-parallel degree")


def prepared(value: Any, given: Placement, desired: Placement | None, mesh: Any, *,
             result_grads_whole: bool, consumer: Any) -> Any:
    """An input as a style (``consumer``, for errors) receives it: a ``LayoutTensor`` keeps
    its own placement (``given`` is then ignored, as torch ignores it for a DTensor); a
    plain tensor is taken to be in ``given``, which must be the placement another style's
    output is in (layout.py, [Note: a plain output remembers its layout]). Returns the
    local tensor in ``desired`` (``given`` where None)."""
    if isinstance(value, LayoutTensor):
        source, local, whole = value.placement, value.local_tensor, False
    else:
        check_declared(value, given, mesh, consumer)
        source, local, whole = given, value, True
    return move(local, source, desired if desired is not None else source, mesh,
                source_grads_whole=whole, result_grads_whole=result_grads_whole)
