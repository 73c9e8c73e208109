"""What a save may replace or remove: only directories this library wrote.

[Note: ours]
A save to ``path`` replaces ``path`` and uses two siblings: ``path.saving``, where the
ranks write, and ``path.old``, the previous checkpoint during the swap (save.py). A
directory is ours when it is a real directory (not a symbolic link) that holds only
regular files with the names a save writes (``index.json``, ``saving.json``,
``rank-NNNNN.safetensors``, ``rank-NNNNN.json``) and a marker whose ``format`` is this
library's: ``index.json`` (a published checkpoint) or ``saving.json`` (a save in
progress, written first into ``path.saving``). Before anything is written, every rank
checks (``check_target``): ``path`` must be new, an empty directory or ours; a leftover
``path.saving`` or ``path.old`` (from a save that failed or was killed) must be ours, and
is then cleared. Anything else (a file, a link, a directory holding other files, the
process's working directory or one above it) is refused with a ``CheckpointError`` naming
it and the fix. Removing deletes the files by name, markers last, then the empty directory
(``os.rmdir``), never recursively: a removal cut short leaves a directory still
recognisably ours, and a file that appears meanwhile makes it fail rather than vanish.
"""

from __future__ import annotations

import json
import os
import re

from hyper_parallel.checkpoint.index import FORMAT, INDEX_FILE, CheckpointError, write_json

STAGING_MARKER = "saving.json"
_OUR_NAMES = re.compile(r"index\.json|saving\.json|rank-\d{5}\.(safetensors|json)")
_FIX = "pick a new or empty directory for the checkpoint"


def is_ours(path: str) -> bool:
    """Whether ``path`` is a directory a save of this library wrote (see the note)."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    for name in os.listdir(path):
        file = os.path.join(path, name)
        if not _OUR_NAMES.fullmatch(name) or os.path.islink(file) or not os.path.isfile(file):
            return False
    return any(_marked(os.path.join(path, marker)) for marker in (INDEX_FILE, STAGING_MARKER))


def _marked(file: str) -> bool:
    if not os.path.isfile(file):
        return False
    try:
        with open(file, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def check_target(path: str) -> None:
    """Refuse a save to absolute ``path`` that would replace or remove what is not ours."""
    real, cwd = os.path.realpath(path), os.path.realpath(os.getcwd())
    if cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep):
        raise CheckpointError(f"cannot save a checkpoint to {path}: it is this process's "
                              f"working directory or holds it, which a save would replace; "
                              f"nothing was written: {_FIX}, e.g. "
                              f"{os.path.join(path, 'checkpoint')}")
    if os.path.islink(path):
        raise CheckpointError(f"cannot save a checkpoint to {path}: it is a symbolic link, "
                              f"which a save would replace; nothing was written: {_FIX}")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointError(f"cannot save a checkpoint to {path}: a file of that name "
                              f"exists, which a save would replace; nothing was written: {_FIX}")
    if os.path.isdir(path) and os.listdir(path) and not is_ours(path):
        found = sorted(os.listdir(path))
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise CheckpointError(f"cannot save a checkpoint to {path}: it is a directory that "
                              f"is not a hyper_parallel checkpoint (it holds {shown}), which a "
                              f"save would replace; nothing was written: {_FIX}")
    for sibling, role in ((path + ".saving", "where a save writes before it publishes"),
                          (path + ".old", "where a save keeps the previous checkpoint while "
                                          "it swaps")):
        if os.path.lexists(sibling) and not is_ours(sibling):
            raise CheckpointError(f"cannot save a checkpoint to {path}: {sibling} exists and "
                                  f"is not a hyper_parallel checkpoint's, and a save uses that "
                                  f"name ({role}); nothing was written: move it away, or "
                                  f"{_FIX}")


def remove_ours(path: str) -> None:
    """Remove directory ``path``, checked to be ours now: its files, markers last."""
    if not is_ours(path):
        raise CheckpointError(f"{path} is not a hyper_parallel checkpoint's directory (any "
                              f"more): it was left in place")
    markers = (INDEX_FILE, STAGING_MARKER)
    for name in sorted(os.listdir(path), key=lambda name: name in markers):
        os.remove(os.path.join(path, name))
    os.rmdir(path)


def make_staging(staging: str) -> None:
    """Rank 0: a fresh ``path.saving`` (a leftover of ours cleared), marked as ours."""
    if os.path.lexists(staging):
        remove_ours(staging)
    os.makedirs(staging)
    write_json(os.path.join(staging, STAGING_MARKER), {"format": FORMAT})


def swap_in(staging: str, path: str) -> None:
    """Rank 0, once ``staging`` is complete: publish it at ``path``, replacing an empty
    directory or a checkpoint of ours there (renames: ``path`` holds one whole checkpoint
    or the other at any moment, except between the two renames, when ``path.old`` does)."""
    os.remove(os.path.join(staging, STAGING_MARKER))
    old = path + ".old"
    if os.path.lexists(old):
        remove_ours(old)
    check_target(path)  # what is at path may have changed since the save began
    if os.path.isdir(path) and os.listdir(path):
        os.rename(path, old)
        os.rename(staging, path)
        remove_ours(old)
    else:
        os.rename(staging, path)  # an empty directory at path is replaced in the rename
