"""The job a launcher declared, and the check that this process joined it.

[Note: a launcher's job not joined]
A launcher says how many ranks the job has: ``WORLD_SIZE`` (hp-run, torchrun),
``MS_WORKER_NUM`` (msrun; it also sets ``RANK_SIZE``, as Ascend rank-table scripts do).
A process whose launcher said more than one rank but which joined no group (it never
called ``init_distributed``), or joined a group of one, would train alone: MindSpore
would run every rank as an independent "rank 0 of 1", torch fails deep inside its mesh
code. ``require_joined_job`` turns that into an error naming the fix, at ``fully_shard``
and ``init_device_mesh``, before anything changes. A plain process that no launcher
started keeps its world of one.
"""

from __future__ import annotations

import os

#: the variables by which launchers declare the job's number of ranks, first found wins
LAUNCHER_WORLD_SIZE_VARS = ("WORLD_SIZE", "MS_WORKER_NUM", "RANK_SIZE")


def launcher_world_size() -> tuple[str, int] | None:
    """``(variable, ranks)``: the job size a launcher declared in this process's
    environment; None where no launcher declared one (or a value is not a number)."""
    for variable in LAUNCHER_WORLD_SIZE_VARS:
        value = os.environ.get(variable, "").strip()
        if value:
            return (variable, int(value)) if value.isdigit() else None
    return None


def require_joined_job(caller: str, platform) -> None:
    """Raise where a launcher declared a job of several ranks that this process has not
    joined ([Note: a launcher's job not joined])."""
    declared = launcher_world_size()
    if declared is None or declared[1] <= 1:
        return
    variable, ranks = declared
    if not platform.is_initialized():
        raise RuntimeError(
            f"{caller}: the launcher started a job of {ranks} ranks ({variable}={ranks}) but this "
            f"process has not joined it; call hp.init_distributed() first (at the top of the "
            f"script, on every rank)")
    if platform.world_size() == 1:
        raise RuntimeError(
            f"{caller}: the launcher started a job of {ranks} ranks ({variable}={ranks}) but this "
            f"process joined a process group of 1 rank; join the launcher's job with "
            f"hp.init_distributed() instead (it reads {variable} and the rendezvous variables)")
