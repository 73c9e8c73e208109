"""Joining and leaving the job's process group, for either framework.

``init_distributed()`` reads the variables ``hp-run`` (and torchrun) set: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT. It is a no-op when the user already joined the framework's own
way (``torch.distributed.init_process_group`` under torchrun, ``mindspore.communication.init``
under msrun); under msrun without that call it joins msrun's job the MindSpore way; and it
joins a one-rank group when none of the variables is set (a single process).

Whichever way the group was joined, a job of more than one rank gets a watchdog
(hyper_parallel/watchdog.py): a collective blocked past ``timeout_s`` (default
``DEFAULT_TIMEOUT_S``, or ``HP_TIMEOUT_S``) ends the process with an error naming it.
With ``debug_collectives`` (or ``HP_DEBUG=collectives``) the ranks also cross-check every
collective before issuing it (hyper_parallel/collective_check.py), and the final barrier of
``destroy_distributed``.

A launcher's job that the process never joined is refused by the core where it starts
(``require_joined_job``, launcher_job.py), not here.
"""

from __future__ import annotations

import os

from hyper_parallel import watchdog
from hyper_parallel.collective_check import CollectiveCheck, Issued
from hyper_parallel.platform import get_platform

DEFAULT_TIMEOUT_S = 300.0
DEBUG_FLAGS = ("collectives",)  # what HP_DEBUG may list (comma-separated)


def init_distributed(timeout_s: float | None = None, debug_collectives: bool | None = None) -> None:
    """Join the default process group of this process's framework (hyper_parallel.platform,
    [Note: which framework]), and watch its
    collectives: one blocked longer than ``timeout_s`` ends the process. ``debug_collectives``
    (default: whether ``HP_DEBUG`` lists ``collectives``): the ranks cross-check each
    collective before issuing it and raise where they differ, at the cost of one small
    all-gather per collective."""
    timeout = timeout_s if timeout_s is not None else float(os.environ.get("HP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    if timeout <= 0:
        raise ValueError(f"init_distributed: timeout_s must be positive, got {timeout:g}; "
                         "pass the seconds a collective may block before the job is ended")
    if debug_collectives is None:
        debug_collectives = "collectives" in _debug_flags()
    _join(timeout)
    platform = get_platform()
    if platform.world_size() > 1:
        watchdog.start(timeout, platform.rank(), platform.world_size())
    platform.collective_check = (CollectiveCheck(platform)
                                 if debug_collectives and platform.world_size() > 1 else None)


def _debug_flags() -> set:
    flags = {f.strip() for f in os.environ.get("HP_DEBUG", "").split(",") if f.strip()}
    unknown = sorted(flags - set(DEBUG_FLAGS))
    if unknown:
        raise ValueError(f"init_distributed: HP_DEBUG lists {unknown}, which hyper_parallel does "
                         f"not know; valid (comma-separated): {list(DEBUG_FLAGS)}")
    return flags


def _join(timeout: float) -> None:
    platform = get_platform()
    if platform.is_initialized() or platform.join_from_launcher_env():
        return
    if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ:
        # A plain single process: a one-rank group, so meshes and DTensors work unchanged.
        from hyper_parallel.launch import find_free_port

        platform.init_process_group(0, 1, "127.0.0.1", find_free_port(), timeout)
        return
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_distributed: environment variables {missing} are not set; start the script "
            "with `hp-run --nproc N script.py` (or torchrun), or set RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT yourself")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 <= rank < world_size:
        raise RuntimeError(f"init_distributed: RANK={rank} is outside [0, WORLD_SIZE={world_size})")
    platform.init_process_group(rank, world_size, os.environ["MASTER_ADDR"],
                                int(os.environ["MASTER_PORT"]), timeout)


def destroy_distributed() -> None:
    """Final barrier (so no rank exits while a peer still sends), then leave the group."""
    from hyper_parallel.checkpoint.save import finish_pending_saves  # they need the group
    finish_pending_saves()
    platform = get_platform()
    if not platform.is_initialized():
        return
    if platform.collective_check is not None:  # a rank that ran a step more raises here
        platform.collective_check.check(Issued("destroy_distributed's final barrier"), None)
        platform.collective_check = None
    platform.barrier()
    watchdog.stop()
    platform.destroy_process_group()
