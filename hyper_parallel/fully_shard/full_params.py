"""The full parameters one unshard node produced, and whether their memory is allocated.

[Note: FullParams: one all-gather's full parameters]
Each unshard node's outputs are one ``FullParams``: the tensors, whether their memory is
allocated (``live``, shared by every FullParams over the same memory) and whether the
node's backward ran (``spent``). The unit holds its current one; earlier ones live as long
as the pre-backward hooks of the graphs that used them. The node holds its FullParams
weakly: its outputs are the FullParams' tensors, and a strong reference would be a cycle
through autograd's native node that Python's collector cannot see (every iteration's node
would leak). A node's backward releases its own FullParams if it is still referenced,
never the unit's current one, and reduces the gradients either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyper_parallel.fully_shard.post_forward import PostForwardShards


class Memory:
    """Whether some full parameters' memory is allocated; shared by the FullParams that
    alias the same memory (a kept unit's next node), so releasing one shows on all."""

    def __init__(self) -> None:
        self.live = True
        # kept while released: per parameter group, its post-forward shards or None
        self.post_forward: list[PostForwardShards | None] | None = None


class FullParams:
    """The full parameters one unshard node produced (see the note "FullParams")."""

    def __init__(self, memory: Memory | None = None):
        self.tensors: list = []    # one per parameter of the unit (``FSDPState.params``)
        self.per_group: list = []  # the same tensors cut per parameter group
        self.memory = memory if memory is not None else Memory()
        self.spent = False  # the node's backward ran, or no forward will (an explicit unshard)

    @property
    def live(self) -> bool:
        return self.memory.live

    def fills(self, full: FullParams) -> bool:
        """Whether these, a unit's current full parameters, are a kept set whose values can
        fill ``full``'s released memory (state.py, the note "one kept set")."""
        return self is not full and self.live and self.spent and self.memory is not full.memory


def aliases(platform: Any, params: list, fulls: list) -> list:
    """New tensor objects over ``fulls``' memory (one per FSDPParam of ``params``), for a
    kept unit's new node; a gather codec learns which of its full parameters each one
    aliases (it releases and rebuilds them)."""
    out = []
    for fsdp_param, tensor in zip(params, fulls):
        out.append(platform.alias(tensor))
        if fsdp_param.gather_codec is not None:
            fsdp_param.gather_codec.aliased(tensor, out[-1])
    return out


def copy_from_kept(platform: Any, full: FullParams, kept: FullParams) -> None:
    """Restore ``full``'s released memory with the kept set's values, no all-gather
    (state.py, the note "one kept set")."""
    for tensor, source in zip(full.tensors, kept.tensors):
        platform.restore_storage(tensor)
        platform.copy_into(tensor, source)
