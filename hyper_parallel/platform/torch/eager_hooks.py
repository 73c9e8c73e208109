"""The library's hooks run eagerly, outside any region torch.compile traces.

[Note: hooks and torch.compile]
``torch.compile`` of a module (``module.compile()`` or ``torch.compile(module)``) calls the
module's forward hooks from torch's own (untraced) ``Module._call_impl``, but dynamo still
compiles every Python frame called from there that is not marked otherwise: without a mark
it would trace the library's pre/post-forward hooks, the unshard node, logging, storage
release and the backward callback, breaking the graph at each of them. Like FSDP2, every
entry point from torch into the library is wrapped with ``torch.compiler.disable``
(recursive): dynamo skips the frame and everything it calls, so the hooks run eagerly and
the compiled graph holds the module's own computation only. The backward-side entry points
(the unshard node's backward, gradient hooks, the end-of-backward callback) run in eager
autograd; they are wrapped too so that a traced backward (compiled autograd) skips them the
same way.

``torch.compiler.disable`` imports dynamo (under a second, once per process, as FSDP2's hooks
do on their first call); it is imported when the first hook is registered, not with the
platform.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

_REASON = "hyper_parallel hooks run eagerly"


def eager(fn: Callable) -> Callable:
    """``fn`` that dynamo never traces, nor anything it calls (for hooks registered once)."""
    return torch.compiler.disable(fn, recursive=True, reason=_REASON)


@functools.cache
def _eager_trampoline() -> Callable:
    return eager(lambda fn, *args: fn(*args))


def call_eagerly(fn: Callable, *args):
    """``fn(*args)`` outside any traced region; for callables made per call (a closure per
    gradient hook), where wrapping each one would cost more than the call."""
    return _eager_trampoline()(fn, *args)
