"""The routed call form of an experts module: Hugging Face's (transformers 5) experts,
called ``experts(hidden_states, top_k_index, top_k_weights)``, one row per token, with the
indices and weights of each token's ``k`` chosen experts, and returning the weighted sum
of their outputs per token (``Qwen3MoeExperts``, ``MixtralExperts``: ``gate_up_proj``
``(E, 2I, H)``, ``down_proj`` ``(E, H, I)``).

[Note: the routed form around the exchange]
The dispatch and combine of dispatch.py move rows grouped by expert. Around them, the
routed call is taken apart and put back together:

- ``to_grouped``: each (token, choice) slot becomes one row, the slots sorted by expert
  (stable, so one process's order), and the rows and per-expert counts go through
  ``dispatch``. The experts module then runs on the rows its local experts receive,
  called in its own form: ``hidden_states`` the rows, ``top_k_index`` each row's local
  expert (one choice per row), ``top_k_weights`` ones. It returns each row's expert output.
- ``from_grouped``: after ``combine`` the outputs are back in sorted order on the rank
  that sent them; they are put back in slot order, weighted by ``top_k_weights`` and
  summed over each token's ``k`` slots, as the module would have done for its token.

A slot whose index is ``num_experts`` (the form's sentinel, the value transformers'
own expert parallelism gives a slot routed elsewhere) contributes nothing: it sends no
row and its output is zero. The module's ``num_experts`` attribute, which its forward
reads for that sentinel and for its per-expert counts, becomes the local number of
experts, as its parameters now hold.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.platform import get_platform

GROUPED, ROUTED = "grouped", "routed"


def call_form(module: Any) -> str:
    """``ROUTED`` when the module's forward takes three inputs (rows, top-k indices,
    top-k weights), ``GROUPED`` otherwise (rows, per-expert counts: torchtitan's form)."""
    try:
        params = inspect.signature(get_platform().forward_function(module)).parameters
    except (TypeError, ValueError):
        return GROUPED
    required = [p for p in params.values() if p.default is p.empty and p.kind in
                (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return ROUTED if len(required) == 3 else GROUPED


def routed_names(module: Any) -> tuple:
    """The names of the routed form's three inputs in the module's forward."""
    params = inspect.signature(get_platform().forward_function(module)).parameters
    return tuple(name for name, p in params.items() if p.kind in
                 (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))[:3]


@dataclass(frozen=True)
class Slots:
    """What ``from_grouped`` needs of one call: the position of each (token, choice) slot
    among the sorted rows (a sentinel's slot: the row after them), the weights and the
    tokens' shape and dtype."""

    position: Any      # numpy (tokens * k,) int64
    weights: Any
    tokens: int
    k: int
    dtype: Any


def _rows_at(rows: Any, index: np.ndarray) -> Any:
    """``rows[index]`` along dim 0, differentiable."""
    p = get_platform()
    width = int(p.shape(rows)[1])
    at = p.from_numpy(np.ascontiguousarray(np.broadcast_to(index[:, None], (index.size, width))))
    return p.take_along_dim(rows, at, 0)


def to_grouped(hidden: Any, top_k_index: Any, top_k_weights: Any, experts: int) -> tuple:
    """``(rows grouped by expert, per-expert counts, Slots)`` of one routed call over
    ``experts`` experts (the whole layer's)."""
    p = get_platform()
    index = np.asarray(p.to_numpy(top_k_index)).astype(np.int64)
    tokens, k = index.shape
    flat = index.ravel()
    if flat.size and (flat.min() < 0 or flat.max() > experts):
        raise ValueError(f"ExpertParallel: top_k_index holds {int(flat.min())} .. "
                         f"{int(flat.max())}; expected expert indices 0 .. {experts - 1} "
                         f"(or {experts}, the sentinel of a slot without expert)")
    order = np.argsort(flat, kind="stable")
    sent = int((flat < experts).sum())
    position = np.empty(flat.size, np.int64)
    position[order] = np.arange(flat.size)
    counts = np.bincount(flat[flat < experts], minlength=experts)
    rows = _rows_at(hidden, order[:sent] // k)
    slots = Slots(np.minimum(position, sent), top_k_weights, tokens, k, p.dtype_of(hidden))
    return rows, p.from_numpy(counts), slots


def local_call(rows: Any, local_counts: Any, weights_dtype: Any) -> tuple:
    """The routed form's inputs for the rows the local experts received: each row's local
    expert (one choice per row) and a weight of one."""
    p = get_platform()
    counts = np.asarray(p.to_numpy(local_counts)).astype(np.int64)
    index = np.repeat(np.arange(counts.size, dtype=np.int64), counts)[:, None]
    ones = p.cast(p.from_numpy(np.ones((index.size, 1), np.float32)), weights_dtype)
    return p.from_numpy(index), ones


def from_grouped(rows: Any, slots: Slots) -> Any:
    """Each token's weighted sum of its slots' outputs, ``rows`` being the sorted rows'
    outputs back on this rank."""
    p = get_platform()
    width = int(p.shape(rows)[1])
    padded = p.cat([rows, p.zeros((1, width), p.dtype_of(rows))], 0)  # the sentinel's row
    per_slot = p.reshape(_rows_at(padded, slots.position), (slots.tokens, slots.k, width))
    weights = p.reshape(p.cast(slots.weights, p.dtype_of(rows)), (slots.tokens, slots.k, 1))
    summed = p.sum_dim(p.multiply(per_slot, weights), 1)
    return p.cast(p.reshape(summed, (slots.tokens, width)), slots.dtype)
