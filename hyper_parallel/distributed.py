"""Joining and leaving the job's process group, for either framework.

``init_distributed()`` reads the variables ``hp-run`` (and torchrun) set: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT. It is a no-op when the user already joined the framework's own
way (``torch.distributed.init_process_group`` under torchrun, ``mindspore.communication.init``
under msrun); under msrun without that call it joins msrun's job the MindSpore way; and it
joins a one-rank group when none of the variables is set (a single process).
"""

from __future__ import annotations

import os

from hyper_parallel.platform import get_platform

DEFAULT_TIMEOUT_S = 300.0


def init_distributed(timeout_s: float | None = None) -> None:
    """Join the default process group of the framework HP_BACKEND selects."""
    platform = get_platform()
    if platform.is_initialized() or platform.join_from_launcher_env():
        return
    timeout = timeout_s if timeout_s is not None else float(os.environ.get("HP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
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
    platform = get_platform()
    if not platform.is_initialized():
        return
    platform.barrier()
    platform.destroy_process_group()
