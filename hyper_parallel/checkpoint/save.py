"""``save_checkpoint``: every rank writes what it owns, in parallel; rank 0 publishes it.

[Note: atomic publish]
Every rank first checks that the save replaces or removes nothing that is not ours
(ownership.py) and the ranks agree. Ranks write into ``<path>.saving`` (rank 0 clears a
stale one of ours first): a safetensors file of the tensors the rank writes (layout.py),
with each tensor's checksum (files.py), and a partial index. Once every rank reports (an
all-reduce of failure flags, which doubles as the barrier), rank 0 merges the partial
indexes into ``index.json`` and swaps directories: ``path`` -> ``path.old``,
``path.saving`` -> ``path``, then removes ``path.old``. A rank that fails or dies before
the swap leaves the previous checkpoint at ``path`` as it was; a failure reported by any
rank makes every rank raise. The directory must be one filesystem every rank sees.

[Note: asynchronous save]
With ``async_save=True`` the call copies this rank's regions to host memory (numpy, new
memory), agrees that every rank did, starts a thread that writes the file and the partial
index (numpy and file I/O only, never a framework or collective call), and returns a
``SaveHandle``. The agreement and the publish, which are collectives, run on the calling
thread in ``SaveHandle.wait()``, which the process's next save or load calls first, and
``destroy_distributed`` before it leaves the group; until then the previous checkpoint
stays at ``path``, and a rank that dies mid-write leaves it there as a synchronous save
does. A save still pending when the interpreter exits is finished by an ``atexit`` hook
(every rank exiting normally runs it, so the collectives meet). Where it cannot be (the
group already left, a peer gone), the failure reaches the user as a failed job: the hook
prints an error naming the path left unpublished and ends the process with exit code
``UNPUBLISHED_EXIT_CODE``, as an exception would have. An exception in an exit hook
does not change the exit code, so the hook ends the process itself (``os._exit``, after
flushing the standard streams); the exit hooks registered before it (the frameworks') are
skipped then, as they may wait forever on a peer that is gone. What stays on disk is
what any failed save leaves: the previous checkpoint at ``path``, and ``path.saving``
without an ``index.json``, which no load takes for a checkpoint and the next save to
``path`` clears.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from hyper_parallel.checkpoint import files
from hyper_parallel.checkpoint.arguments import check_bool, check_path
from hyper_parallel.checkpoint.index import (
    INDEX_FILE, CheckpointError, add_slice, merge, moment_key, new_partial, rank_file,
    write_json,
)
from hyper_parallel.checkpoint.ownership import check_target, is_ours, make_staging, \
    remove_ours, swap_in
from hyper_parallel.checkpoint.layout import dtype_name, to_array, written_here
from hyper_parallel.checkpoint.stages import (
    held_groups, model_parts, optimizer_states, pp_rank_of,
)
from hyper_parallel.platform import get_platform

if TYPE_CHECKING:
    from hyper_parallel.platform import Platform

UNPUBLISHED_EXIT_CODE = 1  # the exit code of a process whose exit hook could not publish
# this process's asynchronous saves whose wait() has not run: writes in flight, like the
# threads doing them, belong to the process, and every rank starts the same ones in order
_IN_FLIGHT: list = []


def save_checkpoint(path: str, model: Any, optimizer: Any = None, extra: Any = None,
                    key_map: Any = None, async_save: bool = False,
                    pp_mesh: Any = None) -> SaveHandle | None:
    """Write ``model``'s parameters and buffers (and ``optimizer``'s state, and
    JSON-serialisable ``extra``) to directory ``path``, replacing what is there only
    once every rank has written its part. ``key_map``: the stored name of each model name
    (names.py). Every rank calls it, between steps. ``async_save``: return once this
    rank's part is copied to host memory, with a ``SaveHandle``; the files are written in
    the background and published by ``handle.wait()``, the next save or load, or
    ``destroy_distributed``. ``path`` must be new, an empty directory or a checkpoint of
    ours (ownership.py). A pipelined run passes this rank's model parts (a module or a
    list), their optimizer (one, or a list with one per part) and ``pp_mesh`` (stages.py)."""
    path = check_path("save_checkpoint", path)
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as error:
        raise TypeError(f"save_checkpoint(extra=...) must be JSON-serialisable: {error}") from None
    check_bool("save_checkpoint", "async_save", async_save)
    platform = get_platform()
    pp_rank = pp_rank_of(pp_mesh)
    groups = held_groups(platform, model_parts(platform, "save_checkpoint", model, optimizer),
                         key_map)
    held = [h for part, _ in groups for h in part]
    # state an optimizer keeps that a checkpoint cannot store is an error before any write
    kind, state = optimizer_states(platform, groups)
    finish_pending_saves()
    mine = written_here(platform, held, pp_rank)
    # every rank sees the same directory: each refuses a target that is not ours itself
    refused = _attempt(lambda: check_target(path))
    if agree_on_failure(platform, refused is not None):
        raise refused or CheckpointError(f"saving {path} was refused on another rank (it "
                                         f"sees something there that is not a checkpoint "
                                         f"of ours); nothing was written")
    staging, rank = path + ".saving", platform.rank()
    failure = _attempt(lambda: make_staging(staging)) if rank == 0 else None
    failed = agree_on_failure(platform, failure is not None)
    snapshot = []
    if not failed:
        failure = _attempt(lambda: snapshot.append(
            _snapshot(platform, rank, mine, kind, state)))
    if not async_save:
        if not failed and failure is None:
            failure = _attempt(lambda: _write(staging, rank, *snapshot[0]))
        _finish(platform, path, staging, extra, failure, failed)
        return None
    failed = failed or agree_on_failure(platform, failure is not None)
    if failed:
        _finish(platform, path, staging, extra, failure, failed)
    handle = SaveHandle(platform, path, staging, extra)
    handle._start(lambda: _write(staging, rank, *snapshot[0]))
    _IN_FLIGHT.append(handle)
    atexit.unregister(_finish_at_exit)  # registered once, after the framework's own hooks
    atexit.register(_finish_at_exit)
    return handle


class SaveHandle:
    """An asynchronous ``save_checkpoint`` whose files are being written in the background.
    ``wait()``, which every rank calls (it agrees and publishes), finishes it: it returns
    once the checkpoint is at its path, or raises as a synchronous save would, leaving the
    previous checkpoint there. The process's next save or load calls it first, and
    ``destroy_distributed`` and the interpreter's exit finish what is still pending."""

    def __init__(self, platform: Platform, path: str, staging: str, extra: Any):
        self._platform, self.path, self._staging, self._extra = platform, path, staging, extra
        self._thread, self._failure, self._done = None, None, False
        # the ranks that must agree before it is published
        self._grouped = platform.is_initialized() and platform.world_size() > 1

    def _start(self, write) -> None:
        def run():
            self._failure = _attempt(write)

        self._thread = threading.Thread(target=run, name="hyper_parallel checkpoint write",
                                        daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """Whether this rank's files are written (``wait()`` still publishes them)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        if self._done:
            return
        self._done = True
        if self in _IN_FLIGHT:
            _IN_FLIGHT.remove(self)
        self._thread.join()
        if self._grouped and not self._platform.is_initialized():
            raise CheckpointError(f"the asynchronous save to {self.path} cannot be published: "
                                  f"this process left the process group before it finished "
                                  f"(call handle.wait() or hp.destroy_distributed(), which "
                                  f"finishes it, before leaving); {self._staging} holds the "
                                  f"unpublished files, {self.path} is unchanged")
        _finish(self._platform, self.path, self._staging, self._extra, self._failure, 0)


def finish_pending_saves() -> None:
    """Finish this process's asynchronous saves, oldest first (every rank calls it; so does
    ``destroy_distributed``, before it leaves the group)."""
    while _IN_FLIGHT:
        _IN_FLIGHT[0].wait()


def _finish_at_exit() -> None:
    """At interpreter exit: finish what is pending; where a save cannot be published, say
    which path it left and end the process with ``UNPUBLISHED_EXIT_CODE`` ([Note:
    asynchronous save])."""
    failed = False
    while _IN_FLIGHT:
        handle = _IN_FLIGHT[0]
        try:
            handle.wait()
        except Exception as error:  # noqa: BLE001 - reported here, then the exit code says it
            failed = True
            print(f"hyper_parallel: ERROR: the asynchronous save to {handle.path} was not "
                  f"published before the interpreter exited: {error}", file=sys.stderr,
                  flush=True)
    if failed:
        sys.stdout.flush()
        os._exit(UNPUBLISHED_EXIT_CODE)


def _finish(platform: Platform, path: str, staging: str, extra: Any,
            failure: Exception | None, failed: int) -> None:
    """Once every rank wrote its part: agree, publish (rank 0), agree; raise on failure."""
    rank = platform.rank()
    if not failed:
        failed = agree_on_failure(platform, failure is not None)
    if not failed:
        if rank == 0:
            failure = _attempt(lambda: _publish(platform, path, staging, extra))
        failed = agree_on_failure(platform, failure is not None)
    if failed:
        if rank == 0 and is_ours(staging):
            _attempt(lambda: remove_ours(staging))
        if failure is not None:
            raise failure
        raise CheckpointError(f"saving {path} failed on {failed} other rank(s); the previous "
                              f"checkpoint there is unchanged")


def _attempt(step) -> Exception | None:
    """Run ``step``; its exception, to be reported to every rank before it is raised."""
    try:
        step()
    except Exception as error:  # noqa: BLE001 - every rank must hear of any failure
        return error
    return None


def agree_on_failure(platform: Platform, failed: bool) -> int:
    """How many ranks report a failure (an all-reduce: also a barrier)."""
    if platform.world_size() == 1 or not platform.is_initialized():
        return int(failed)
    flag = platform.from_numpy(np.array([1.0 if failed else 0.0], np.float32))
    platform.all_reduce(flag, None, "sum").wait()
    return int(round(float(platform.to_numpy(flag)[0])))


def _snapshot(platform: Platform, rank: int, held: list, kind: str | None,
              state: tuple | None) -> tuple:
    """This rank's regions of the ``held`` values it writes, copied to host memory as
    numpy, and its partial index: ``([(stored name, dtype name, array)], partial)``.
    ``kind``, ``state``: the optimizer's class and ``read_state``'s (None without one)."""
    entries = []  # (stored name, Held, dtype name, this rank's region as numpy)
    partial = new_partial(kind)
    per_param = {}
    if state is not None:
        per_param, partial["optimizer"]["own"] = state
    with platform.no_grad():
        for h in held:
            entries.append((h.key, h, h.dtype, to_array(platform, h, h.local(platform))))
            if id(h.param) not in per_param:
                continue
            tensors, numbers = per_param[id(h.param)]
            partial["optimizer"]["state"][h.key] = {"tensors": sorted(tensors),
                                                    "scalars": numbers}
            for name, tensor in sorted(tensors.items()):
                entries.append((moment_key(name, h.key), h,
                                dtype_name(platform, platform.dtype_of(tensor)),
                                to_array(platform, h, tensor)))
    file = rank_file(rank, ".safetensors")
    for key, h, dtype, array in entries:
        add_slice(partial, key, dtype, h.shape, file, h.offsets, array.shape)
    return [(key, dtype, array) for key, _, dtype, array in entries], partial


def _write(staging: str, rank: int, entries: list, partial: dict) -> None:
    """This rank's file and partial index (no framework call: it may run in a thread)."""
    if entries:
        sums = files.write_file(os.path.join(staging, rank_file(rank, ".safetensors")),
                                {key: (dtype, array) for key, dtype, array in entries})
        for key, entry in partial["tensors"].items():
            for stored in entry["slices"]:  # this rank's own: one per key
                stored["checksum"] = sums[key]
    write_json(os.path.join(staging, rank_file(rank, ".json")), partial)


def _publish(platform: Platform, path: str, staging: str, extra) -> None:
    """Rank 0, once every rank wrote: the index, then the directory swap."""
    partial_files = sorted(f for f in os.listdir(staging)
                           if f.startswith("rank-") and f.endswith(".json"))
    partials = []
    for name in partial_files:
        with open(os.path.join(staging, name), encoding="utf-8") as file:
            partials.append(json.load(file))
    write_json(os.path.join(staging, INDEX_FILE),
               merge(partials, platform.name, platform.world_size(), extra))
    for name in partial_files:
        os.remove(os.path.join(staging, name))
    swap_in(staging, path)
