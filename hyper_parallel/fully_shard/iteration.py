"""The per-root iteration context: what one forward/backward of one root model shares.

[Note: why not globals]
Every unit under one root points to the same IterationContext, created by the root at its
first forward. Two models wrapped independently have two roots and two contexts, so their
pending work, flags and final callbacks can never mix. Nothing here is class-level.
"""

from __future__ import annotations

from typing import Any


class IterationContext:
    """All units of one root, in pre-order (root first), and the end-of-backward callback."""

    def __init__(self, platform: Any, states: list):
        self.platform = platform
        self.states = states
        self._final_callback_queued = False

    def begin_forward(self) -> None:
        """The root's forward starts a new iteration: drop full parameters left from the
        last one (unless kept on purpose, by an explicit unshard or reshard_after_backward=False)."""
        for state in self.states:
            state.begin_iteration()

    def ensure_final_callback(self) -> None:
        """Queue ``finish_backward`` once per backward pass (call only during backward)."""
        if not self._final_callback_queued:
            self._final_callback_queued = True
            self.platform.queue_backward_final_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """After the whole backward: every unit reshards (units whose backward never ran
        included), so the optimizer and the next forward see sharded parameters."""
        self._final_callback_queued = False
        for state in self.states:
            state.finish_backward()
