"""hyper_parallel's units as torch's own code sees them: instances of FSDP2's ``FSDPModule``.

[Note: recognised by torch]
Code written around FSDP2 finds its units with ``isinstance(m, torch.distributed.fsdp.
FSDPModule)`` and then drives them through the public methods (torch's pipeline schedules:
``unshard(async_op=True)``, ``reshard()``, ``set_requires_gradient_sync``,
``set_is_last_backward``, ``set_reshard_after_backward``; Lightning Fabric's
``no_backward_sync``: ``set_requires_gradient_sync``). A unit's class therefore ends in
``FSDP2Unit``, a subclass of torch's ``FSDPModule``: ``FSDP<Class>`` is
``(hyper_parallel.FSDPModule, Class, FSDP2Unit)``, so hyper_parallel's methods come first,
then the module's own class (at ``__mro__[2]``, where torch's ``FSDPModule.__new__``
reads the original class: ``type(unit)(...)``, a slice of a sharded ``nn.Sequential``,
makes a plain module, as under FSDP2), then torch's ``FSDPModule``, whose methods the two
before shadow.

[Note: what torch reaches for behind the methods]
Two callers go past the methods:

- torch's pipeline stage (``PipelineStage.perform_reduce_grad``, after every microbatch's
  backward ran with gradient sync off) reads ``fully_shard.state(stage)._state_ctx.
  all_states[*]._fsdp_param_groups[*].post_backward()`` and then
  ``_root_post_backward_final_callback()``. ``PipelineReduction`` is what
  ``fully_shard.state`` finds on a unit: no parameter groups of FSDP2's kind, and a final
  callback that reduces what the microbatches accumulated, once per unit, waits for it and
  reshards (the core's ``reduce_accumulated``). It also makes torch's ``fully_shard`` on
  a unit stop at once with torch's own "already been applied" error.
- ``FSDPModule._get_fsdp_state`` (FSDPMemTracker) wants FSDP2's state objects, which a
  unit has none of: it raises a NotImplementedError naming the caller's way out instead of
  an AttributeError deep inside torch. ``_set_unshard_async_op``, the one private FSDP2
  switch training scripts call, is accepted instead: what it asks of FSDP2 (all-gather
  buffers allocated on the current stream, not a side stream's) is how hyper_parallel
  always gathers.

[Note: torch's fully_shard over units]
torch's ``fully_shard`` on a module that holds units manages the parameters of every
submodule it finds composable with it, and finds a subtree composable unless the
composable-API registry of its module names ``replicate``: that is how FSDP2 leaves a
subtree to another API. A unit's registry names ``replicate`` for that reason alone, so
FSDP2 leaves the unit's parameters to it (without it FSDP2 takes the unit's DTensor
parameters for tensor-parallel ones and fails in its own mesh code). torch's
``replicate`` on a unit then stops with torch's "already been applied" error.

The other way round, a module FSDP2 sharded is an instance of torch's ``FSDPModule`` but
not of ``FSDP2Unit``: ``native_unit_api`` names FSDP2 for it, and ``hp.fully_shard``
refuses it (its DTensor parameters would otherwise read as tensor-parallel ones).
"""

from __future__ import annotations

from typing import Callable

from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
# From where torch defines them, not the public ``torch.distributed.fsdp`` names: code
# written for FSDP2 runs on hyper_parallel by rebinding ``torch.distributed.fsdp.fully_shard``
# to ``hp.fully_shard``, possibly before this module is first imported.
from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torch_fully_shard


class FSDP2Unit(TorchFSDPModule):
    """The last base of a hyper_parallel unit's class on torch (see the note)."""

    def _get_fsdp_state(self):
        raise NotImplementedError(
            f"{type(self).__name__} is a hyper_parallel fully_shard unit: it holds no FSDP2 "
            f"state (FSDPParamGroup, FSDPState), which this torch code reads. torch's "
            f"pipeline schedules and code that uses FSDPModule's public methods work on it; "
            f"for communication counts use hp.track_comms(), for memory "
            f"torch.distributed._tools.MemTracker or the device's own memory statistics")


    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted, nothing to change (see the note)."""
        if not isinstance(async_op, bool):
            raise TypeError(f"_set_unshard_async_op takes a bool, got {type(async_op).__name__}")


class PipelineReduction:
    """What ``torch.distributed.fsdp.fully_shard.state(unit)`` returns for a hyper_parallel
    unit: the two things torch's pipeline stage asks of FSDP2's state (see the note)."""

    _fsdp_param_groups = ()  # the reduction happens in the final callback, once per unit

    def __init__(self, reduce_accumulated: Callable[[], None]):
        self._reduce_accumulated = reduce_accumulated

    @property
    def _state_ctx(self) -> PipelineReduction:
        return self

    @property
    def all_states(self) -> tuple:
        return (self,)

    def _root_post_backward_final_callback(self) -> None:
        self._reduce_accumulated()


def present_unit(module, reduce_accumulated: Callable[[], None]) -> None:
    """Let ``torch_fully_shard.state(module)`` find a ``PipelineReduction``, and torch's
    ``fully_shard`` over the unit leave it alone (see the notes)."""
    states = module.__dict__.setdefault(STATE_KEY, {})
    # keyed by the function ``contract`` decorated, as ``fully_shard.state`` reads it
    states[torch_fully_shard.__wrapped__] = PipelineReduction(reduce_accumulated)
    module.__dict__.setdefault(REGISTRY_KEY, {}).setdefault("replicate", RegistryItem())


def native_unit_api(module) -> str | None:
    """"torch's fully_shard (FSDP2)" for a module FSDP2 made a unit, else None."""
    if isinstance(module, TorchFSDPModule) and not isinstance(module, FSDP2Unit):
        return "torch's fully_shard (FSDP2)"
    return None
