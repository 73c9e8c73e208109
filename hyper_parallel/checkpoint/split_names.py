"""``SplitKey``: an export ``key_map`` value that writes one model value as several tensors.

[Note: why a value splits on export]
A model may hold in one parameter what a Hugging Face checkpoint stores as several
tensors: a mixture of experts' grouped experts ``(num_experts, ...)`` (torchtitan's
``GroupedExperts``, transformers 5's experts module) against the per-expert tensors of a
family's checkpoint (``model.layers.0.mlp.experts.3.gate_proj.weight``), and a fused
projection (``gate_up_proj``, the gate's rows then the up projection's) against its two
halves. ``SplitKey(dim, parts)`` cuts the value along ``dim`` into ``len(parts)`` equal
pieces, piece ``i`` written under ``parts[i]`` (a name, or a ``SplitKey`` of that piece in
turn); ``squeeze`` drops ``dim`` from the pieces (one expert each), ``transpose`` swaps a
piece's last two dims (a ``(in, out)`` matmul weight written as a linear layer's
``(out, in)`` weight). ``per_expert_keys`` builds the usual one. Only ``export_full`` takes a
``SplitKey``: a checkpoint stores each value whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.checkpoint.index import CheckpointError


@dataclass(frozen=True)
class SplitKey:
    """Write a value as ``len(parts)`` pieces cut along ``dim`` (see the module note)."""

    dim: int
    parts: tuple
    squeeze: bool = False
    transpose: bool = False

    def __post_init__(self):
        object.__setattr__(self, "parts", tuple(self.parts))
        if not self.parts or not all(isinstance(p, (str, SplitKey)) and p for p in self.parts):
            raise CheckpointError(f"SplitKey({self.dim}, {self.parts!r}): give one or more parts, "
                                  f"each a stored name or a SplitKey")

    def leaves(self, shape: tuple, what: str) -> list:
        """``[(stored name, shape)]`` of the tensors ``self`` writes for a value of
        ``shape`` (``what``: the model name, for the error); an error if it does not cut."""
        shape = tuple(shape)
        dim = self.dim + len(shape) if self.dim < 0 else self.dim
        n = len(self.parts)
        if not 0 <= dim < len(shape) or shape[dim] % n or (self.squeeze and shape[dim] != n):
            raise CheckpointError(
                f"export_full: key_map splits {what} {shape} along dim {self.dim} into {n} "
                f"parts{' of one' if self.squeeze else ''}; that dim must exist and "
                f"{'equal' if self.squeeze else 'divide evenly into'} {n}")
        piece = shape[:dim] + ((shape[dim] // n,) if not self.squeeze else ()) + shape[dim + 1:]
        if self.transpose:
            if len(piece) < 2:
                raise CheckpointError(f"export_full: key_map transposes the pieces of {what}, "
                                      f"which have fewer than 2 dims {piece}")
            piece = piece[:-2] + (piece[-1], piece[-2])
        out = []
        for part in self.parts:
            out += part.leaves(piece, what) if isinstance(part, SplitKey) else [(part, piece)]
        return out

    def pieces(self, array: np.ndarray) -> list:
        """``[(stored name, array)]``: ``array`` cut as ``leaves`` describes."""
        out = []
        for part, piece in zip(self.parts, np.split(array, len(self.parts), axis=self.dim)):
            if self.squeeze:
                piece = np.squeeze(piece, axis=self.dim)
            if self.transpose:
                piece = np.swapaxes(piece, -1, -2)
            out += part.pieces(piece) if isinstance(part, SplitKey) else [(part, piece)]
        return out


def per_expert_keys(names: Any, num_experts: int, *, transpose: bool = False) -> SplitKey:
    """The ``SplitKey`` of a grouped experts parameter ``(num_experts, ...)`` into one tensor
    per expert, named ``names`` with ``{expert}`` replaced by the expert's index; several
    names (e.g. the gate's and the up projection's): each expert's piece is cut along its
    first dim into that many, in order (a fused ``gate_up_proj``). ``transpose``: each
    expert's piece has its last two dims swapped first."""
    names = (names,) if isinstance(names, str) else tuple(names)
    if not names or any(not isinstance(n, str) or "{expert}" not in n for n in names):
        raise CheckpointError(f"per_expert_keys({names!r}, ...): give one or more names, each "
                              f"holding '{{expert}}'")
    experts = []
    for e in range(num_experts):
        mine = tuple(n.replace("{expert}", str(e)) for n in names)
        experts.append(mine[0] if len(mine) == 1 else SplitKey(0, mine))
    return SplitKey(0, tuple(experts), squeeze=True, transpose=transpose)
