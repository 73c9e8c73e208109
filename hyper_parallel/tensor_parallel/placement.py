"""Where a tensor-parallel value lives on a 1-D mesh: ``Shard(dim)``, ``Replicate()``, and
the internal ``Partial()`` (each rank holds a summand), with torch's names and meaning.

[Note: placements are values]
A placement is a frozen value: two ``Shard(1)`` are equal, ``Shard(-1)`` is resolved
against a tensor's number of dims only where a tensor is at hand (``normalized``), as
torch resolves it when it redistributes. ``Partial`` is never given by a user: it is
what a row-wise layer's local product is before its reduction.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass


class Placement:
    """The base of the three placements (torch's ``Placement``)."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Shard(Placement):
    """Each rank holds the ``dim``-th slice of the whole tensor, in rank order, equal sizes."""

    dim: int

    def __post_init__(self):
        try:
            dim = operator.index(self.dim)
        except TypeError:
            dim = None
        if dim is None or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim): dim must be an int (the tensor dim split over the "
                            f"mesh, negative counts from the last); got {self.dim!r}")
        object.__setattr__(self, "dim", dim)  # a numpy integer as a plain int

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or self.dim == dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank holds the whole tensor."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    """Every rank holds a summand of the whole tensor (internal: a row-wise local product)."""

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Partial(sum)"


def normalized(placement: Placement, ndim: int) -> Placement:
    """``placement`` with a negative shard dim resolved against ``ndim`` dims."""
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


def check_placement(value, what: str, allow_none: bool = False) -> None:
    """A named error for anything that is not ``Shard(d)`` or ``Replicate()``."""
    if value is None and allow_none:
        return
    if not isinstance(value, (Shard, Replicate)):
        raise TypeError(f"{what} must be hyper_parallel.tensor_parallel.Shard(dim) or "
                        f"Replicate(); got {value!r}")
