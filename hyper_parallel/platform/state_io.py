"""The optional part of the contract for state dicts and checkpoints: optimizer state read
and written, and buffers.

[Note: why a part of its own]
``fully_shard`` never needs these: only the state dicts and the checkpoints
(hyper_parallel/checkpoint/) do. A platform that
implements ``StateIO`` gets them all; a new platform can train first and add this later.
"""

from __future__ import annotations

import abc
from typing import Any, Callable


class StateIO(abc.ABC):
    """Optimizer state and buffers of one framework."""

    @abc.abstractmethod
    def optimizer_state(self, optimizer: Any) -> list:
        """Every state tensor of ``optimizer`` as ``(state name, parameter or None, local
        tensor)``: per-parameter state (moments) with the parameter it belongs to, the
        optimizer's own values (step counters) with None. The tensor is the live one a load
        writes with ``copy_into`` (torch: a DTensor's local part). State an optimizer has
        not created yet (torch before its first step) is not listed."""

    def create_optimizer_state(self, optimizer: Any) -> Callable[[], None] | None:
        """Make ``optimizer`` create its state (zeros) if it has none yet, so that a load can
        write it; return what undoes that, or None where nothing was created (the default:
        a framework whose optimizers create their state on construction)."""
        return None

    def buffers(self, module: Any) -> list:
        """``[(attr_name, tensor), ...]``: the state registered directly on ``module`` that
        is not a parameter and that a checkpoint stores (torch's persistent buffers); the
        default, none, is for a framework that keeps such state in parameters (MindSpore's
        ``requires_grad=False`` Parameters)."""
        return []

    @abc.abstractmethod
    def optimizer_params(self, optimizer: Any) -> list:
        """The parameters ``optimizer`` updates, in its order; TypeError for an object that
        is not one of this framework's optimizers."""

    @abc.abstractmethod
    def optimizer_options(self, optimizer: Any, param: Any) -> dict:
        """The options ``optimizer`` applies to ``param`` (its parameter group's: torch's
        ``amsgrad``, ``momentum``, ...); a move between optimizer classes reads them to
        leave out state the target keeps only under an option (checkpoint/optimizers.py)."""

    @abc.abstractmethod
    def set_optimizer_state(self, optimizer: Any, param: Any, values: dict) -> None:
        """Write ``values`` into ``optimizer``'s state. With a ``param``, its state becomes
        ``{name: value}``: a tensor shaped like ``local_tensor(param)`` (cast to the state's
        dtype), or a number for a per-parameter scalar (torch's ``step``, made as the
        framework's optimizers make it); ``{}`` leaves it with none where a framework's
        optimizers create state at their first step (torch). With ``param=None``, the
        optimizer's own values named in ``values`` (numbers) are set. The names are those
        ``optimizer_state`` lists; where an optimizer's state is fixed at construction
        (MindSpore), another name is a KeyError and nothing is written."""
