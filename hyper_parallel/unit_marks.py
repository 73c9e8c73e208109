"""The marks fully_shard leaves on what it manages, kept below every parallelism.

Tensor parallelism comes before fully_shard and must refuse a module fully_shard already
manages. It reads these marks rather than importing fully_shard, which reads tensor
parallelism's layouts: the two packages import one way (fully_shard over
tensor_parallel).
"""

from __future__ import annotations

from typing import Any

#: on a unit's module: its FSDPState
STATE_ATTR = "_hp_state"
#: on a sharded parameter: the unit that owns it
SHARDED_BY = "_hp_sharded_by"


def is_unit(module: Any) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` itself."""
    return STATE_ATTR in vars(module)


def is_sharded(param: Any) -> bool:
    """Whether ``param`` is a sharded parameter some unit manages."""
    return getattr(param, SHARDED_BY, None) is not None
