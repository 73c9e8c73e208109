"""Walking the tensors of a module's inputs and outputs (nested tuples, lists, dicts)."""

from __future__ import annotations

from typing import Any

_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


def tensors_in(platform: Any, tree: Any):
    """Every tensor in ``tree``, depth first."""
    if platform.is_tensor(tree):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from tensors_in(platform, item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from tensors_in(platform, item)


def cast_floating(platform: Any, tree: Any, dtype: Any) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (the rest as it is)."""
    if platform.is_tensor(tree):
        floating = tuple(platform.dtype(n) for n in _FLOAT_NAMES if n in platform.dtype_names)
        return platform.cast(tree, dtype) if platform.dtype_of(tree) in floating else tree
    if isinstance(tree, tuple):
        return tuple(cast_floating(platform, item, dtype) for item in tree)
    if isinstance(tree, list):
        return [cast_floating(platform, item, dtype) for item in tree]
    if isinstance(tree, dict):
        return {key: cast_floating(platform, item, dtype) for key, item in tree.items()}
    return tree
