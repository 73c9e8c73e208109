"""``context_parallel``: sequence buffers split over the context-parallel ranks, and
``scaled_dot_product_attention`` computed over the whole sequence while the context is open.

[Note: torch's shape, on both frameworks]
As torch's ``context_parallel(mesh, buffers=, buffer_seq_dims=, no_restore_buffers=)``: on
entry each buffer (input ids, targets, rotary tables, ...) is replaced in place by this
rank's share of it along its sequence dim (balance.py), and on exit given back its whole
values unless it is in ``no_restore_buffers``. Inside, attention called through
``scaled_dot_product_attention`` (on torch also ``torch.nn.functional.
scaled_dot_product_attention``, replaced while the context is open, as torch's is) attends
each local query to the keys of every rank: ring attention (ring.py) or the all-to-all
exchange of heads for sequence (all_to_all.py). Outside a context it is plain attention.

[Note: attention the context cannot see]
A model that computes attention by hand (its own softmax of q @ k^T) under the context
attends each query to the local keys only, and nothing in its tensors says so. The context
counts the attention calls it routes: one that closes without error having routed none
raises (the model's attention, if any, was computed by hand). A model that routes some
attention calls and computes others by hand is not detected.

The open context is the only state here, kept for the process (``_OPEN``, one at a time),
as torch's replaced function is: a model's attention finds it without being handed it, also
in a forward that autograd recomputes during backward (activation checkpointing), which a
framework may run on a thread of its own; so backward runs inside the context.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from hyper_parallel.context_parallel.all_to_all import all_to_all_attention
from hyper_parallel.context_parallel.balance import local_share, split_error
from hyper_parallel.context_parallel.blocks import as_float32, default_scale, plain_attention
from hyper_parallel.context_parallel.ring import ring_attention
from hyper_parallel.device_mesh import as_device_mesh
from hyper_parallel.platform import get_platform

STRATEGIES = ("ring", "all_to_all")


@dataclass
class _OpenContext:
    mesh: Any
    strategy: str
    local_length: int
    calls: int = 0


#: the open context, if any (at most one element)
_OPEN: list = []


def _checked_mesh(mesh: Any) -> Any:
    mesh = as_device_mesh(mesh)
    if mesh.ndim != 1:
        raise ValueError(f"hyper_parallel: context_parallel takes the 1-D context-parallel "
                         f"mesh, got {mesh}; pass its cp dim, e.g. mesh['cp']")
    return mesh


def _checked_buffers(buffers, seq_dims, no_restore, cp: int) -> int:
    """The sequence length every buffer shares, after checking them all."""
    p = get_platform()
    if len(buffers) != len(seq_dims):
        raise ValueError(f"hyper_parallel: context_parallel got {len(buffers)} buffers and "
                         f"{len(seq_dims)} buffer_seq_dims; give one sequence dim per buffer")
    for buffer in no_restore:
        if not any(buffer is b for b in buffers):
            raise ValueError("hyper_parallel: no_restore_buffers must be a subset of buffers "
                             "(the same tensor objects)")
    length = None
    for i, (buffer, dim) in enumerate(zip(buffers, seq_dims)):
        if not p.is_tensor(buffer):
            raise TypeError(f"hyper_parallel: context_parallel's buffers[{i}] is a "
                            f"{type(buffer).__name__}, not a tensor")
        shape = p.shape(buffer)
        if not -len(shape) <= dim < len(shape):
            raise ValueError(f"hyper_parallel: buffer_seq_dims[{i}] = {dim} is not a dim of "
                             f"buffers[{i}], of shape {shape}")
        if length is None:
            length = shape[dim]
            if split_error(length, cp):
                raise ValueError(f"hyper_parallel: buffers[{i}]: {split_error(length, cp)}")
        elif shape[dim] != length:
            raise ValueError(f"hyper_parallel: buffers[{i}] has {shape[dim]} elements along "
                             f"its sequence dim {dim} (shape {shape}), buffers[0] has "
                             f"{length}: every buffer holds the same sequence; check "
                             f"buffer_seq_dims")
    return length


@contextlib.contextmanager
def context_parallel(mesh: Any, *, buffers: Sequence[Any] | None = None,
                     buffer_seq_dims: Sequence[int] | None = None,
                     no_restore_buffers: set | None = None,
                     strategy: str = "ring") -> Iterator[None]:
    """Split ``buffers`` along ``buffer_seq_dims`` over the 1-D ``mesh`` (in place), and
    compute ``scaled_dot_product_attention`` over the whole sequence until the context
    closes (``strategy``: "ring" or "all_to_all"); then restore the buffers not in
    ``no_restore_buffers``."""
    buffers, seq_dims = list(buffers or []), list(buffer_seq_dims or [])
    no_restore = list(no_restore_buffers or [])
    if strategy not in STRATEGIES:
        raise ValueError(f"hyper_parallel: context_parallel's strategy is one of {STRATEGIES}, "
                         f"got {strategy!r}")
    if _OPEN:
        raise RuntimeError("hyper_parallel: a context_parallel context is already open; "
                           "close it before opening another")
    mesh = _checked_mesh(mesh)
    cp = mesh.size()
    length = _checked_buffers(buffers, seq_dims, no_restore, cp)
    p, rank = get_platform(), mesh.get_local_rank(0)
    originals = [None if any(b is n for n in no_restore) else p.clone(b) for b in buffers]
    with p.no_grad():
        shares = [local_share(b, d, rank, cp) for b, d in zip(buffers, seq_dims)]
        for buffer, share in zip(buffers, shares):
            p.replace_values(buffer, share)
    state = _OpenContext(mesh, strategy, None if length is None else length // cp)
    _OPEN.append(state)
    try:
        with p.route_framework_attention(scaled_dot_product_attention):
            yield
    finally:
        _OPEN.clear()
        with p.no_grad():
            for buffer, original in zip(buffers, originals):
                if original is not None:
                    p.replace_values(buffer, original)
    if state.calls == 0:
        raise RuntimeError(
            "hyper_parallel: no attention went through scaled_dot_product_attention while "
            "context_parallel was open: attention computed by hand attends each rank's "
            "queries to its local piece of the sequence only; call "
            "hp.scaled_dot_product_attention (on torch also "
            "torch.nn.functional.scaled_dot_product_attention) in the model")


def _refuse(attn_mask, dropout_p, enable_gqa, is_causal, q_len, k_len) -> None:
    if attn_mask is not None:
        raise NotImplementedError(
            "hyper_parallel: scaled_dot_product_attention takes is_causal=True or no mask; "
            "an attn_mask (padding, document boundaries) is not supported: under context "
            "parallelism it would have to be split with the sequence")
    if dropout_p:
        raise NotImplementedError("hyper_parallel: scaled_dot_product_attention has no "
                                  "attention dropout; pass dropout_p=0.0")
    if enable_gqa:
        raise NotImplementedError("hyper_parallel: scaled_dot_product_attention takes as many "
                                  "key/value heads as query heads; repeat them before the call")
    if is_causal and q_len != k_len:
        raise ValueError(f"hyper_parallel: is_causal needs as many queries as keys, got "
                         f"{q_len} and {k_len}")


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False) -> Any:
    """torch's ``scaled_dot_product_attention`` on (batch, heads, sequence, head dim)
    tensors: inside ``context_parallel`` over the whole sequence the buffers came from,
    outside it plain attention."""
    p = get_platform()
    q_shape, k_shape = p.shape(query), p.shape(key)
    _refuse(attn_mask, dropout_p, enable_gqa, is_causal, q_shape[-2], k_shape[-2])
    state = _OPEN[0] if _OPEN else None
    if state is None:
        return plain_attention(query, key, value, is_causal, scale)
    if state.local_length is not None and q_shape[-2] != state.local_length:
        raise ValueError(
            f"hyper_parallel: attention over {q_shape[-2]} positions under context_parallel, "
            f"whose buffers gave this rank {state.local_length}: the sequence reached the "
            f"attention unsplit (or split elsewhere); pass every sequence buffer (inputs, "
            f"rotary tables, ...) to context_parallel's buffers")
    if len(q_shape) != 4 or q_shape[:2] != k_shape[:2]:
        raise ValueError(f"hyper_parallel: attention under context_parallel takes (batch, "
                         f"heads, sequence, head dim) queries and keys of the same batch and "
                         f"heads, got {q_shape} and {k_shape}")
    cp = state.mesh.size()
    if state.strategy == "all_to_all" and q_shape[1] % cp:
        raise ValueError(f"hyper_parallel: all_to_all attention splits the {q_shape[1]} heads "
                         f"over {cp} context-parallel ranks; use a head count divisible by "
                         f"{cp}, or strategy='ring'")
    state.calls += 1
    q32, k32, v32 = as_float32(query, key, value)
    compute = ring_attention if state.strategy == "ring" else all_to_all_attention
    out = compute(q32, k32, v32, is_causal, default_scale(query, scale), state.mesh)
    return p.cast(out, p.dtype_of(query))
