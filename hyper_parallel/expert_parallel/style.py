"""``ExpertParallel``: the experts of a mixture-of-experts layer split over a 1-D mesh, each
rank computing with its own, tokens sent to them and back (torchtitan's style, its name
and its semantics).

[Note: what the style splits]
The experts module holds every expert in one 3-D parameter per projection,
``(num_experts, ...)`` (torchtitan's ``GroupedExperts``: ``w1``, ``w2``, ``w3``), and is
called ``experts(x, num_tokens_per_expert)`` with the rows of this rank's tokens grouped by
expert. The style keeps ``num_experts / ep`` experts per rank: each 3-D parameter becomes
its Shard(0) block over the mesh (``split_param``), recorded as tensor parallelism records
a split (``ParamLayout``), so fully_shard shards the block, state dicts, checkpoints and
export lay it out as a region of the whole ``(num_experts, ...)`` value, and
``clip_grad_norm_`` reduces its norm over the mesh: every expert is counted once. Around
the module's forward, the pre-hook dispatches the rows to their experts' ranks and the
post-hook combines the results back (dispatch.py); the module itself computes with its
local experts and the local counts, unchanged. Hugging Face's experts module of
transformers 5 holds its experts the same way but is called with each token's chosen
experts and weights (``experts(hidden_states, top_k_index, top_k_weights)``, told apart by
its forward's signature): routed.py turns that call into rows grouped by expert around
the same dispatch and combine. The older Hugging Face form (a ``ModuleList`` of expert
modules that the MoE layer loops over itself) gives neither a call to dispatch around
nor a parameter holding every expert: it is refused, naming the grouped form.

[Note: no rows here]
A rank whose experts receive no row in a step still takes part in the backward of both
all-to-alls: its peers wait for the gradients of the rows they sent. An experts module
whose output does not depend on its empty input (it skips experts without rows, or builds
their empty products from new tensors) would leave the dispatch out of autograd's graph on
that rank, and its peers waiting; so the empty output is tied to the empty input (plus
zero times it), which keeps the dispatch in the graph at no cost. Likewise the experts'
``fully_shard`` unit: its peers inside the expert group wait in its gradient reduction,
which runs only where backward reaches its parameters (MindSpore's backward does not
through an empty product), so one element of each parameter joins the tie, times zero.

[Note: data parallelism over the expert ranks]
The expert ranks are data-parallel ranks too (torchtitan carves the expert dim out of
``dp_shard``): each feeds its own tokens. A local expert's gradient therefore sums over
the tokens of every rank of the mesh, where a dense parameter's gradient holds this rank's
tokens only and is averaged by fully_shard over the data-parallel ranks. To train as one
process on the whole batch, the experts' gradient is divided by the number of
data-parallel ranks whose tokens it sums (torchtitan's gradient divide factor: the whole
data-parallel size), e.g. ``fully_shard(experts, mesh=mesh["efsdp"])`` then
``experts.set_gradient_divide_factor(dp_size)``; docs/expert-parallel.md has the plan.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.expert_parallel.capacity import cap, check_capacity_factor, uncap
from hyper_parallel.expert_parallel.dispatch import combine, dispatch
from hyper_parallel.expert_parallel.routed import (
    ROUTED, call_form, from_grouped, local_call, routed_names, to_grouped)
from hyper_parallel.platform import get_platform
from hyper_parallel.tensor_parallel.placement import Shard
from hyper_parallel.tensor_parallel.style import ParallelStyle, param_in_forward, split_param


def expert_params(module: Any) -> list:
    """``[(name, shape)]`` of ``module``'s own parameters (grouped experts: weights of 3-D
    or more, biases of 2-D, one leading dim of experts)."""
    p = get_platform()
    return [(attr, tuple(p.shape(param))) for attr, param in p.direct_params(module)]


def _children(module: Any) -> list:
    return [sub for name, sub in get_platform().named_modules(module) if name and "." not in name]


class ExpertParallel(ParallelStyle):
    """Split a grouped experts module's experts over the mesh; dispatch each token to its
    expert's rank and combine the results back (all-to-all both ways). ``capacity_factor``:
    each expert takes at most ``ceil(capacity_factor * rows / num_experts)`` rows from one
    rank per call, the rest dropped (capacity.py); None: no row dropped."""

    def __init__(self, *, capacity_factor: float | None = None):
        check_capacity_factor(capacity_factor)
        self.capacity_factor = capacity_factor

    def check(self, module: Any, mesh: Any) -> None:
        params = expert_params(module)
        if not params and _children(module):
            raise ValueError(
                f"ExpertParallel on {type(module).__name__}: it holds no grouped experts "
                f"(its experts are {len(_children(module))} modules of their own, the "
                f"Hugging Face form of transformers 4, which this style does not split: "
                f"no call of it carries every expert's rows and no parameter holds every "
                f"expert); hold the experts as (num_experts, ...) parameters of one module "
                f"(torchtitan's GroupedExperts: w1, w2, w3; transformers 5's experts "
                f"module) and apply the style to it")
        if not any(len(shape) >= 3 for _, shape in params) or \
                any(len(shape) < 2 for _, shape in params):
            holds = ", ".join(f"{a} {s}" for a, s in params) or "no parameters of its own"
            raise ValueError(
                f"ExpertParallel on {type(module).__name__}: it holds no grouped experts "
                f"({holds}); apply it to the experts module, whose parameters are "
                f"(num_experts, ...) tensors (torchtitan's GroupedExperts: w1, w2, w3), "
                f"e.g. parallelize_module(moe.experts, mesh['ep'], ExpertParallel())")
        counts = {shape[0] for _, shape in params}
        if len(counts) != 1:
            raise ValueError(
                f"ExpertParallel on {type(module).__name__}: its parameters disagree on "
                f"the number of experts (dim 0: {dict(params)}); every parameter of a "
                f"grouped experts module holds one slice per expert")
        experts = counts.pop()
        if experts % mesh.size():
            raise ValueError(
                f"ExpertParallel on {type(module).__name__}: {experts} experts do not split "
                f"evenly over the {mesh.size()} ranks of mesh dim "
                f"{mesh.mesh_dim_names[0]!r}; choose an expert-parallel degree that "
                f"divides the number of experts")

    def apply(self, module: Any, mesh: Any) -> Any:
        params = expert_params(module)
        experts = params[0][1][0]
        for attr, _ in params:
            split_param(module, attr, Shard(0), mesh, self.src_data_rank)
        form = call_form(module)
        names = routed_names(module) if form == ROUTED else _NAMES
        if form == ROUTED and getattr(module, "num_experts", None) == experts:
            module.num_experts = experts // mesh.size()  # [Note: the routed form around the exchange]
        in_flight = []  # per call of the module: its dispatch, until its combine

        def pre(mod, args, kwargs):
            given, others = _inputs(args, kwargs, names)
            if form == ROUTED:
                x, counts, slots = to_grouped(*given, experts)
            else:
                (x, counts), slots = given, None
                _check_counts(mod, counts, experts)
            capped = None
            if self.capacity_factor is not None:
                x, counts, capped = cap(x, counts, self.capacity_factor)
            rows, local_counts, routed = dispatch(x, counts, mesh)
            in_flight.append((routed, rows, slots, capped))
            if form == ROUTED:
                local = (rows,) + local_call(rows, local_counts, get_platform().dtype_of(given[2]))
            else:
                local = (rows, local_counts)
            return local + given[len(local):], others

        def post(mod, args, kwargs, output):
            routed, rows, slots, capped = in_flight.pop()
            if not sum(routed.output_splits):
                output = _tied(mod, output, rows, params)  # [Note: no rows here]
            back = combine(output, routed, mesh)
            if capped is not None:
                back = uncap(back, capped)
            return back if slots is None else from_grouped(back, slots)

        get_platform().register_forward_hooks(module, pre, post)
        return module

    def __repr__(self) -> str:
        if self.capacity_factor is None:
            return "ExpertParallel()"
        return f"ExpertParallel(capacity_factor={self.capacity_factor!r})"


def _tied(module: Any, output: Any, rows: Any, params: list) -> Any:
    """The empty ``output`` plus zero times the empty ``rows`` and one element of each
    local expert parameter (as the module reads it now)."""
    p = get_platform()
    for attr, _ in params:
        first = p.narrow(p.reshape(param_in_forward(module, attr), (-1,)), 0, 0, 1)
        output = p.add(output, p.scale(first, 0.0))
    return p.add(output, p.scale(rows, 0.0))


_NAMES = ("x", "num_tokens_per_expert")


def _check_counts(module: Any, counts: Any, experts: int) -> None:
    n = tuple(get_platform().shape(counts))
    if n != (experts,):
        raise ValueError(f"ExpertParallel on {type(module).__name__}: num_tokens_per_expert "
                         f"has shape {n}; expected ({experts},), one count per expert of "
                         f"the whole layer")


def _inputs(args: tuple, kwargs: dict, names: tuple) -> tuple:
    """``(the inputs named ``names`` and the positional args after them, the other keyword
    args)`` of an experts module's call."""
    given = tuple(args) + tuple(kwargs[k] for k in names[len(args):] if k in kwargs)
    if len(given) < len(names):
        raise TypeError(f"an experts module under ExpertParallel is called "
                        f"experts({', '.join(names)}): "
                        + ("the rows grouped by expert and the number of rows of each expert"
                           if names == _NAMES else "the tokens' rows and the indices and "
                           "weights of each token's chosen experts"))
    return given, {k: v for k, v in kwargs.items() if k not in names}
