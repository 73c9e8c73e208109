"""The unit state machine's table (unit_state.py): every state is reachable from SHARDED
and can get back to it, and an illegal transition is an error naming the unit and both
states. The transitions a training step really takes are checked by the forward-pattern
suite (every unit ends each step SHARDED) and by every parity run (an illegal one raises)."""

from __future__ import annotations

import pytest

from hyper_parallel.fully_shard.unit_state import TRANSITIONS, UnitState, check_transition


def _reachable(start: UnitState, edges) -> set:
    seen, todo = {start}, [start]
    while todo:
        state = todo.pop()
        for old, new in edges:
            if old is state and new not in seen:
                seen.add(new)
                todo.append(new)
    return seen


def test_every_state_is_reachable_and_can_return_to_sharded():
    assert _reachable(UnitState.SHARDED, TRANSITIONS) == set(UnitState)
    backwards = [(new, old) for old, new in TRANSITIONS]
    assert _reachable(UnitState.SHARDED, backwards) == set(UnitState)


def test_legal_transitions_and_staying_put_pass():
    for old, new in TRANSITIONS:
        check_transition("blocks.0", old, new)
    for state in UnitState:
        check_transition("blocks.0", state, state)


@pytest.mark.parametrize("old,new", [(o, n) for o in UnitState for n in UnitState
                                     if o is not n and (o, n) not in TRANSITIONS])
def test_an_illegal_transition_names_the_unit_and_both_states(old, new):
    with pytest.raises(RuntimeError) as raised:
        check_transition("blocks.3", old, new)
    message = str(raised.value)
    assert "'blocks.3'" in message and f"from {old.value} to {new.value}" in message
