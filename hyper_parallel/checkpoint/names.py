"""The names a checkpoint stores: the model's qualified names, or what ``key_map`` makes
of them.

[Note: key_map]
``key_map`` (on save, load and export) turns a model's qualified name into the name
stored in the files: a dict ``{model name: stored name}`` (names it does not list are
kept), or a function of the model name. ``None`` as the stored name leaves the value out:
not written on save, not read on load (the model keeps its own). Saving and loading with
the same map round-trips; loading a checkpoint written by a model named differently uses
the map that gives the writer's names. ``torch_nn_names`` is a ready map to the names
torch's ``nn`` layers use, for models written with MindSpore's ``nn`` layers on one side
and torch's on the other.
"""

from __future__ import annotations

from typing import Any, Callable

from hyper_parallel.checkpoint.index import CheckpointError
from hyper_parallel.checkpoint.split_names import SplitKey

# the attribute names of MindSpore's nn layers that torch's nn names otherwise
_MINDSPORE_TO_TORCH = {
    "embedding_table": "weight",   # nn.Embedding
    "gamma": "weight",             # nn.LayerNorm, nn.BatchNorm*d, nn.GroupNorm
    "beta": "bias",
    "moving_mean": "running_mean",  # nn.BatchNorm*d
    "moving_variance": "running_var",
}
# torch's BatchNorm counts its batches, which only momentum=None reads; MindSpore has no
# counterpart
_TORCH_ONLY = ("num_batches_tracked",)


def torch_nn_names(name: str) -> str | None:
    """A ready ``key_map``: the name ``name`` has in a model written with torch's ``nn``
    layers. On a MindSpore model it renames the attributes of MindSpore's layers
    (``embedding_table``, ``gamma``/``beta``, ``moving_mean``/``moving_variance``); on a
    torch model it leaves out ``num_batches_tracked``, which MindSpore's BatchNorm lacks.
    Use it on both sides of a move between the frameworks."""
    module, _, attr = name.rpartition(".")
    if attr in _TORCH_ONLY:
        return None
    attr = _MINDSPORE_TO_TORCH.get(attr, attr)
    return f"{module}.{attr}" if module else attr


def resolve(key_map: Any, model_names: list, splits: bool = False) -> dict:
    """``{model name: stored name}`` for ``model_names`` under ``key_map`` (names mapped to
    None left out); an error naming the problem, before anything is written or read, for a
    map that is neither a dict nor a function, gives something other than a string or
    None, names a value the model does not have, or gives two values one stored name.
    ``splits`` (export): a stored name may also be a ``SplitKey`` (split_names.py)."""
    if key_map is None:
        return {name: name for name in model_names}
    if isinstance(key_map, dict):
        unknown = sorted(set(key_map) - set(model_names))
        if unknown:
            raise CheckpointError(f"key_map names {', '.join(map(repr, unknown[:5]))}, which "
                                  f"the model does not have (its names are qualified "
                                  f"parameter and buffer names, e.g. {model_names[0]!r})")
        rename: Callable = lambda name: key_map.get(name, name)  # noqa: E731
    elif callable(key_map):
        rename = key_map
    else:
        raise TypeError(f"key_map must be a dict {{model name: stored name}} or a function of "
                        f"the model name, not {type(key_map).__name__}")
    stored, by_key = {}, {}
    for name in model_names:
        key = rename(name)
        if key is None:
            continue
        if isinstance(key, SplitKey) and not splits:
            raise CheckpointError(f"key_map gives a SplitKey for {name!r}: only export_full "
                                  f"writes a value as several tensors; a checkpoint stores "
                                  f"each value whole under one name")
        for leaf in _leaf_names(key):
            if not isinstance(leaf, str) or not leaf or leaf.startswith("optim."):
                raise CheckpointError(f"key_map gives {key!r} for {name!r}: a stored name is "
                                      f"a non-empty string not starting with 'optim.', or "
                                      f"None to leave the value out")
            if leaf in by_key:
                raise CheckpointError(f"key_map gives {by_key[leaf]!r} and {name!r} the same "
                                      f"stored name {leaf!r}; map them to different names")
            by_key[leaf] = name
        stored[name] = key
    return stored


def _leaf_names(key: Any) -> list:
    """The names a stored name or ``SplitKey`` writes."""
    if isinstance(key, SplitKey):
        return [leaf for part in key.parts for leaf in _leaf_names(part)]
    return [key]
