"""``set_gather_codec``: the parameters a unit gathers with a ``GatherCodec``
(gather_codec.py, [Note: gather codecs]), chosen by the user before ``fully_shard``."""

from __future__ import annotations

from typing import Any, Callable

from hyper_parallel.fully_shard.gather_codec import GATHER_CODEC_ATTR, GatherCodec
from hyper_parallel.fully_shard.param import SHARDED_BY
from hyper_parallel.platform import get_platform, module_framework


def set_gather_codec(module: Any, codec: GatherCodec | None,
                     predicate: Callable[[str, Any], bool] | None = None) -> None:
    """Gather ``module``'s parameters with ``codec`` (None: as usual), before
    ``fully_shard``. ``predicate(name, param)`` picks the parameters (default: those of two
    or more dims, the weights of linear and embedding layers; norms and biases are small
    and sensitive). Checks everything before it marks anything."""
    if module_framework(module) is None:
        raise TypeError(f"set_gather_codec takes a module (torch nn.Module or MindSpore "
                        f"nn.Cell), got {type(module).__name__}")
    if codec is not None and not isinstance(codec, GatherCodec):
        raise TypeError(f"codec must be a hyper_parallel GatherCodec (e.g. hp.CastGather("
                        f"'bfloat16'), hp.Int8RowGather()) or None, got {type(codec).__name__}")
    if predicate is not None and not callable(predicate):
        raise TypeError(f"predicate must be a function of (name, param), got {predicate!r}")
    platform = get_platform(module)
    chosen = []
    for prefix, sub in platform.named_modules(module):
        for name, param in platform.direct_params(sub):
            fqn = f"{prefix}.{name}" if prefix else name
            if getattr(param, SHARDED_BY, None) is not None:
                raise ValueError(f"parameter {fqn!r} is already sharded by fully_shard: call "
                                 f"set_gather_codec before fully_shard")
            if predicate(fqn, param) if predicate is not None else len(platform.shape(param)) >= 2:
                chosen.append(param)
    for param in chosen:
        object.__setattr__(param, GATHER_CODEC_ATTR, codec)
