"""Start the ranks of one benchmark launch, bounded in time, and collect their JSON results.

[Note: plumbing]
The same pieces as ``hp-run`` and the test harness (``hyper_parallel.launch``): a free port
per launch, the torchrun-style environment per rank, ``RankProcesses`` that starts each rank
in its own session and ends them by process group id (never by name). What differs:

* the job travels as ``job.json`` in a private directory and every rank answers with
  ``result.<rank>.json`` or ``error.<rank>.txt`` (benchmarks/measure.py): no pickles, no
  tensors cross a process boundary;
* output goes to ``rank<r>.log`` files, so nothing blocks on a pipe, and a failure report
  carries the failed rank's traceback and log tail;
* every launch has a timeout; on timeout or the first failed rank every rank is ended.

Each rank also gets ``OMP_NUM_THREADS=1`` (the launcher's default, and torch ranks call
``torch.set_num_threads(1)``), and ``GLOG_v=3`` which silences MindSpore's C++ logging.
With ``bind_cores`` (run.py's default) local rank i is bound to ``core_slices(world)[i]``
from its start, as ``hp-run --bind-cores`` does, for every implementation alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hyper_parallel.launch import RankProcesses, core_slices, find_free_port, rank_environment

HERE = Path(__file__).resolve().parent
_TAIL_LINES = 30


class LaunchFailure(RuntimeError):
    """A rank failed, wrote no result, or the launch timed out."""


def launch(script: str, job: dict, world: int, backend: str, timeout_s: float,
           bind_cores: bool) -> list[dict]:
    """Run ``benchmarks/<script>`` on ``world`` local ranks; return their results by rank."""
    with tempfile.TemporaryDirectory(prefix="hp-bench-") as tmp:
        workdir = Path(tmp)
        job_path = workdir / "job.json"
        job_path.write_text(json.dumps(job))
        port = find_free_port()
        base = {**os.environ, "GLOG_v": "3", "OMP_NUM_THREADS": "1", "HP_BACKEND": backend}
        envs = [rank_environment(r, r, world, world, "127.0.0.1", port, backend, base)
                for r in range(world)]
        command = [sys.executable, str(HERE / script), str(job_path)]
        logs = [open(workdir / f"rank{r}.log", "wb") for r in range(world)]
        ranks = None
        try:
            ranks = RankProcesses([command] * world, envs, cwd=HERE.parent, stdout=logs,
                                  stderr=[subprocess.STDOUT] * world,
                                  cores=core_slices(world) if bind_cores else None)
            try:
                failed = ranks.wait(timeout_s)
            except TimeoutError:
                ended = ranks.terminate()
                tails = "".join(_log_tail(workdir, r) for r in range(world))
                raise LaunchFailure(f"{script} timed out after {timeout_s:g} s on {world} ranks; "
                                    f"ended ranks {ended}{tails}") from None
            if failed is not None:
                code = ranks.procs[failed].returncode
                ended = ranks.terminate()
                raise LaunchFailure(f"{script}: rank {failed} failed with exit code {code}; ended "
                                    f"ranks {ended}{_error(workdir, failed)}{_log_tail(workdir, failed)}")
        finally:
            if ranks is not None:
                ranks.terminate()
            for log in logs:
                log.close()
        results = []
        for r in range(world):
            path = workdir / f"result.{r}.json"
            if not path.exists():
                raise LaunchFailure(f"{script}: rank {r} exited 0 without a result{_log_tail(workdir, r)}")
            results.append(json.loads(path.read_text()))
        return results


def _error(workdir: Path, rank: int) -> str:
    path = workdir / f"error.{rank}.txt"
    text = path.read_text(errors="replace") if path.exists() else "(no traceback written)\n"
    return f"\n--- traceback of rank {rank} ---\n{text}"


def _log_tail(workdir: Path, rank: int) -> str:
    path = workdir / f"rank{rank}.log"
    lines = path.read_text(errors="replace").splitlines()[-_TAIL_LINES:] if path.exists() else []
    return f"\n--- last {len(lines)} log lines of rank {rank} ---\n" + "\n".join(lines)
