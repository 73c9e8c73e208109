"""The checkpoint functions' arguments, checked before anything is read or written.

A wrong argument (a string for the model, a path that is not one) would otherwise surface
as an AttributeError deep inside, or after files were touched; here it is a ``TypeError``
naming the function, the argument and what it takes. Every rank is given the same
arguments, so every rank raises before any collective.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyper_parallel.platform import Platform


def check_path(function: str, path: Any) -> str:
    """``path`` as an absolute path: a non-empty string or ``os.PathLike`` of one."""
    value = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(value, str) or not value:
        raise TypeError(f"{function}(path=...) takes the checkpoint directory as a non-empty "
                        f"string or os.PathLike, not {type(path).__name__} {path!r:.80}")
    return os.path.abspath(value)


def check_bool(function: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{function}({name}=...) takes True or False, not {value!r:.80}")


def check_model(platform: Platform, function: str, model: Any, optimizer: Any = None) -> None:
    """``model`` a module of this framework; ``optimizer`` None or one of its optimizers."""
    try:
        platform.named_modules(model)
    except (AttributeError, TypeError):
        raise TypeError(f"{function}(model=...) takes the {platform.name} model (the module "
                        f"fully_shard was applied to), not {type(model).__name__} "
                        f"{model!r:.80}") from None
    if optimizer is None:
        return
    try:
        platform.optimizer_params(optimizer)
    except (AttributeError, TypeError) as error:
        raise TypeError(f"{function}(optimizer=...) takes None or the {platform.name} "
                        f"optimizer built on the model's parameters: {error}") from None
