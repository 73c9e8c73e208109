"""Multi-process test harness: run one function on N real ranks and collect the results.

Design note
-----------
Distributed code is only tested honestly on real processes joined in a real process group, so
every multi-rank test of the suite goes through ``run_ranks``.  It reuses the launcher's pieces
(``hyper_parallel.launch``) and differs from ``hp-run`` only in plumbing suited to pytest:

* the call travels through files in a private temp dir: ``args.pkl`` in, ``result.<rank>.pkl``
  or ``error.<rank>.txt`` out (written by tests/_rank_entry.py), so a target is any importable
  ``"module:function"`` and results are compared in the test process;
* rank output goes to ``rank<r>.log`` files rather than pipes, so nothing can block and no relay
  threads are needed;
* a failing rank ends all others at once (a peer blocked in a collective would otherwise wait
  for the timeout), and the RankFailure raised carries that rank's traceback and log tail;
* MindSpore ranks that outnumber the cores run ``mindspore.runtime.launch_blocking()``
  (``HP_TEST_MS_LAUNCH_BLOCKING=1``, read by tests/_rank_entry.py): in MindSpore's default
  asynchronous pipeline a waiting rank spins a core, and 4 ranks on 2 cores took 205 s for
  the HSDP 2x2 launch against 53 s blocking. A caller may ask for it with fewer ranks too:
  the suite's shared launches (tests/shared_launch.py), the forward patterns', the state
  dicts' and the checkpoints' do (2 ranks, the MindSpore optimizers' checkpoint round trips:
  13 s blocking against 48-71 s); the other launches (desync, faults, launchers, the soak
  run, the example's training) keep the default pipeline, so the suite still trains in
  parity under what users run.
* Those same launches (``FAST_MINDSPORE``) also run MindSpore's ``jit``-decorated functions
  op by op (``MS_JIT=0``, read by ``mindspore.jit`` at each call). What they decorate there
  is the optimizers' ``construct`` (``mindspore.experimental.optim``), compiled once per
  optimizer object: a launch that builds two optimizers per scenario spent three quarters
  of its time compiling them (the parity launch's nested, shard_dim1 and own_collectives
  scenarios on 2 ranks: 37 s, 27 of them in the compiler; 16 s with ``MS_JIT=0``). The
  update is the same arithmetic either way, and the launches above that keep the default
  still train under compiled optimizers.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hyper_parallel.launch import RankProcesses, find_free_port, rank_environment

REPO_ROOT = Path(__file__).resolve().parent.parent
# the environment of launches that train many small models (design note)
FAST_MINDSPORE = {"HP_TEST_MS_LAUNCH_BLOCKING": "1", "MS_JIT": "0"}
_TAIL_LINES = 40


class RankFailure(AssertionError):
    """A rank failed or the run timed out; an AssertionError so pytest reports a test failure."""


def run_ranks(target: str, world_size: int, backend: str, *args, timeout_s: float = 240,
              env: dict | None = None) -> list:
    """Run function `target` ("package.module:function", importable from the repo root) on
    `world_size` real processes with HP_BACKEND=backend; return the list of per-rank return
    values (index = rank).

    ``env`` adds to (or overrides) the inherited environment of every rank.  Raises RankFailure
    when a rank fails or ``timeout_s`` passes; no rank outlives the call either way.
    """
    with tempfile.TemporaryDirectory(prefix="hp-ranks-") as tmp:
        workdir = Path(tmp)
        with open(workdir / "args.pkl", "wb") as file:
            pickle.dump({"target": target, "args": args}, file)
        command = [sys.executable, "-m", "tests._rank_entry", str(workdir)]
        logs = [open(workdir / f"rank{rank}.log", "wb") for rank in range(world_size)]
        ranks = None
        try:
            ranks = RankProcesses([command] * world_size, _rank_envs(world_size, backend, env),
                                  cwd=REPO_ROOT, stdout=logs,
                                  stderr=[subprocess.STDOUT] * world_size)
            try:
                failed = ranks.wait(timeout_s)
            except TimeoutError:
                ended = ranks.terminate()
                tails = "".join(_log_section(workdir, rank) for rank in range(world_size))
                raise RankFailure(f"{target} timed out after {timeout_s:g} s on {world_size} "
                                  f"ranks; ended ranks {ended}{tails}") from None
            if failed is not None:
                code = ranks.procs[failed].returncode
                ended = ranks.terminate()
                raise RankFailure(f"{target}: rank {failed} failed with exit code {code}; "
                                  f"ended ranks {ended}{_error_section(workdir, failed)}"
                                  f"{_log_section(workdir, failed)}")
        finally:
            if ranks is not None:
                ranks.terminate()
            for log in logs:
                log.close()
        return [_load_result(workdir, rank) for rank in range(world_size)]


def _rank_envs(world_size: int, backend: str, extra: dict | None) -> list[dict[str, str]]:
    """Environments of all ranks; the repo root leads PYTHONPATH so targets import from it."""
    base = {**os.environ, **(extra or {})}
    if backend == "mindspore" and world_size > (os.cpu_count() or 1):
        base.setdefault("HP_TEST_MS_LAUNCH_BLOCKING", "1")
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), base.get("PYTHONPATH")) if p)
    port = find_free_port()
    return [rank_environment(rank, rank, world_size, world_size, "127.0.0.1", port, backend, base)
            for rank in range(world_size)]


def _error_section(workdir: Path, rank: int) -> str:
    path = workdir / f"error.{rank}.txt"
    text = path.read_text(errors="replace") if path.exists() else "(rank wrote no traceback)\n"
    return f"\n--- traceback of rank {rank} ---\n{text}"


def _log_section(workdir: Path, rank: int) -> str:
    lines = (workdir / f"rank{rank}.log").read_text(errors="replace").splitlines()[-_TAIL_LINES:]
    return f"\n--- last {len(lines)} log lines of rank {rank} ---\n" + "\n".join(lines)


def _load_result(workdir: Path, rank: int):
    path = workdir / f"result.{rank}.pkl"
    if not path.exists():
        raise RankFailure(f"rank {rank} exited 0 without writing a result"
                          f"{_log_section(workdir, rank)}")
    with open(path, "rb") as file:
        return pickle.load(file)


def run_plain_ranks(command: list, envs: list, logdir: Path, timeout_s: float) -> tuple:
    """``command`` started once per rank as a user starts a script (plain ``python``, the
    rendezvous variables in ``envs[rank]``, no harness entry): (each rank's exit code,
    each rank's output). Every rank is ended by pid whatever happens; a rank still running
    after ``timeout_s`` fails the call."""
    logs = [open(Path(logdir) / f"rank{rank}.log", "wb") for rank in range(len(envs))]
    ranks = RankProcesses([command] * len(envs), envs, cwd=REPO_ROOT, stdout=logs,
                          stderr=[subprocess.STDOUT] * len(envs))
    try:
        deadline = time.monotonic() + timeout_s
        codes = [proc.wait(max(1.0, deadline - time.monotonic())) for proc in ranks.procs]
    finally:
        ranks.terminate()
        for log in logs:
            log.close()
    return codes, [(Path(logdir) / f"rank{rank}.log").read_text(errors="replace")
                   for rank in range(len(envs))]
