"""``register_fsdp_forward_method``: run a unit's forward hooks around another method.

[Note: why a method needs registering]
The hooks that gather a unit's full parameters before its forward, and reshard them after
it, are installed on the module's call (``forward`` on torch, ``construct`` on MindSpore):
a method called directly, such as ``model.generate(...)``, bypasses them and computes with
the sharded parameters. Registering the method replaces it, on that instance only, by a
wrapper that runs the unit's pre-forward hook, the method, then its post-forward hook,
exactly as a call of the module would (FSDP2's function of the same name). Units the method
calls run their own hooks as usual.
"""

from __future__ import annotations

import functools
from typing import Any

from hyper_parallel.fully_shard.fsdp_module import FSDPModule
from hyper_parallel.fully_shard.state import STATE_ATTR

_REGISTERED = "_hp_forward_method_of"  # on a wrapper: the module it was registered on


def register_fsdp_forward_method(module: Any, method_name: str) -> None:
    """Make ``module.<method_name>()`` run the unit's pre-forward and post-forward hooks
    around the method, as a forward does. A no-op on a module that is not a fully_shard
    unit, so the same code runs with and without ``fully_shard``. ``ValueError`` when the
    module has no such method."""
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r} to register "
                         f"as a forward method")
    if getattr(method, _REGISTERED, None) is module:
        return  # registered already: its hooks must not run twice per call

    @functools.wraps(method)
    def run_with_forward_hooks(*args, **kwargs):
        state = module.__dict__[STATE_ATTR]
        changed = state.pre_forward(module, args, kwargs)
        if changed is not None:
            args, kwargs = changed
        output = method(*args, **kwargs)
        hooked = state.post_forward(module, args, kwargs, output)
        return output if hooked is None else hooked

    setattr(run_with_forward_hooks, _REGISTERED, module)
    # an instance attribute shadows the class's method (torch Module and MindSpore Cell
    # alike); object.__setattr__ keeps a Cell's own __setattr__ from inspecting it
    object.__setattr__(module, method_name, run_with_forward_hooks)
