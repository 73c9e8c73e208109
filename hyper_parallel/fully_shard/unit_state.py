"""The states of one unit's parameters and the transitions between them, checked.

[Note: the four states]
What a unit's modules compute with is always in one of four states (``UnitState``):

- ``SHARDED``: the modules see the sharded parameters; the unit holds no full ones (a past
  graph may still hold some, see state.py "FullParams").
- ``UNSHARDED``: the modules compute with full parameters that one unshard node produced,
  and that node's backward has not run yet.
- ``FREED``: the unit's forward ended with ``reshard_after_forward``: the modules see the
  sharded parameters again and the full ones' memory is released where the platform can;
  autograd still holds them, and their gradient's arrival gathers them again.
- ``KEPT``: the node's backward ran and the full parameters stay
  (``reshard_after_backward=False``): the next forward makes a new node over them instead
  of gathering.

Every change of state goes through ``FSDPState._enter``, which checks it against
``TRANSITIONS``: an illegal one (a bug in the library, or a pattern it does not know) is a
RuntimeError naming the unit and both states, never a silently wrong gradient.
"""

from __future__ import annotations

import enum


class UnitState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"
    FREED = "freed"
    KEPT = "kept"


S, U, F, K = UnitState.SHARDED, UnitState.UNSHARDED, UnitState.FREED, UnitState.KEPT

#: (from, to) -> what makes that transition
TRANSITIONS = {
    (S, U): "unshard: all-gather, a new unshard node",
    (U, F): "end of forward with reshard_after_forward",
    (U, S): "reshard (explicit, end of backward, a forward without gradients)",
    (U, K): "backward ran, full parameters kept (reshard_after_backward=False)",
    (F, U): "re-gather: the gradient reached the outputs, or the module runs again",
    (F, S): "reshard (explicit, end of backward, the next iteration)",
    (F, K): "backward ran on full parameters that stayed allocated, kept",
    (K, U): "the next forward: a new node over the kept full parameters",
    (K, S): "reshard (explicit, the next iteration)",
    (S, K): "backward ran on full parameters re-gathered after a reshard, kept",
}


def check_transition(unit: str, old: UnitState, new: UnitState) -> None:
    """Raise if ``old`` -> ``new`` is not a transition of ``TRANSITIONS``."""
    if old is not new and (old, new) not in TRANSITIONS:
        legal = ", ".join(t.value for f, t in TRANSITIONS if f is old)
        raise RuntimeError(
            f"hyper_parallel: unit {unit!r} cannot go from {old.value} to {new.value} "
            f"(from {old.value} it can go to: {legal}). This is a bug in hyper_parallel or "
            f"a use it does not support: please report it with the code that runs the model")
