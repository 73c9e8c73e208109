"""``hp-run``: start N local ranks of a script with the rendezvous environment set.

Design note
-----------
One launcher process starts ``--nproc`` ranks of the same script on this node and hands each
the torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) that
``hyper_parallel.init_distributed`` reads, whichever framework HP_BACKEND selects.
Three rules shape the code:

* Every rank starts with ``start_new_session=True``, so it leads its own process group whose id
  is its pid.  Ending a rank is ``os.killpg(pid, ...)``: addressed by pid, never by name, and it
  also reaches the grandchildren the rank spawned (compilers, data workers).
* A failure anywhere ends everything: a collective whose peer died blocks forever, so survivors
  are terminated (SIGTERM, a grace period, then SIGKILL) rather than awaited.
* Output is relayed line by line by one thread per pipe, prefixed with the rank, so interleaved
  logs stay readable and no rank ever blocks on a full pipe.

``--bind-cores`` pins local rank i to its own slice of the cores the launcher may use
(``core_slices``), set in the child between fork and exec so that every thread the rank ever
starts (the framework's kernel and communication threads) inherits it. Unbound, the OS moves
ranks' threads between cores, and a thread that spins while waiting for a collective
(MindSpore's runtime does) can take a core from another rank's computation.

Ranks start quiet: the frameworks' native loggers (MindSpore's glog, torch's C++ log that
gloo writes through) are set to errors only, so the first screen is the user's own output.
A level the user set (``GLOG_v``, ``MS_SUBMODULE_LOG_v``, ``TORCH_CPP_LOG_LEVEL``) is kept, and ``--verbose`` keeps
the frameworks' defaults (``NATIVE_LOG_QUIET``), and says so to the ranks
(``NATIVE_LOG_VERBOSE``), whose ``init_distributed`` would otherwise quiet MindSpore's log
itself (hyper_parallel/platform/mindspore/native_log.py). MindSpore's start-up threads can log
before its level is read, so a quiet relay also drops the lines in MindSpore's own format
below error level (``_NATIVE_BELOW_ERROR``).

``find_free_port``, ``rank_environment``, ``core_slices`` and ``RankProcesses`` are the reusable
pieces; the test harness (tests/multirank.py) and the benchmarks drive them with log files
instead of pipes.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

TERM_GRACE_S = 5.0
CAN_BIND_CORES = hasattr(os, "sched_setaffinity")  # Linux; not macOS or Windows
TIMEOUT_EXIT_CODE = 124
_POLL_S = 0.05
_TAIL_LINES = 20
# the native loggers' "errors only" levels, per framework: MindSpore's glog (0 debug .. 3
# error; its DISTRIBUTED module logs INFO lines at start-up unless given a level of its own)
# and torch's C++ log (gloo's warnings go through it). A framework whose variables the user
# set any of is left as the user set it.
# "[INFO] DISTRIBUTED(pid,thread,python):time [file:line] ..." as MindSpore's C++ log writes it
_NATIVE_BELOW_ERROR = re.compile(rb"^\[(DEBUG|INFO|WARNING)\] [A-Z_]+\(\d+,\w+,")
NATIVE_LOG_QUIET = (
    {"GLOG_v": "3", "MS_SUBMODULE_LOG_v": "{DISTRIBUTED:3}"},
    {"TORCH_CPP_LOG_LEVEL": "ERROR"},
)
# set in a rank's environment: keep the frameworks' native logs at their default levels
NATIVE_LOG_VERBOSE = ("HP_NATIVE_LOG", "verbose")


def find_free_port(host: str = "127.0.0.1") -> int:
    """Let the OS pick an unused port, so concurrent runs on one machine do not collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rank_environment(rank: int, local_rank: int, world_size: int, local_world_size: int,
                     master_addr: str, master_port: int, backend: str | None = None,
                     base: dict[str, str] | None = None,
                     verbose: bool = False) -> dict[str, str]:
    """Environment of one rank: ``base`` (default ``os.environ``) plus the rendezvous variables.

    ``backend`` None keeps whatever HP_BACKEND the caller inherited. Unless ``verbose``, the
    native loggers are kept at errors only where ``base`` sets no level of its own; with
    it, at their defaults (``NATIVE_LOG_VERBOSE``).
    """
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(local_world_size), MASTER_ADDR=master_addr,
               MASTER_PORT=str(master_port), PYTHONUNBUFFERED="1")
    if backend is not None:
        env["HP_BACKEND"] = backend
    # N ranks each running one OpenMP thread per core would oversubscribe the CPUs N-fold.
    env.setdefault("OMP_NUM_THREADS", "1")
    if verbose:
        env[NATIVE_LOG_VERBOSE[0]] = NATIVE_LOG_VERBOSE[1]
    else:
        for levels in NATIVE_LOG_QUIET:
            if not any(name in env for name in levels):
                env.update(levels)
    return env


def core_slices(local_world_size: int, cores=None) -> list[frozenset[int]]:
    """The cores each local rank is bound to: ``cores`` (default: those this process may run
    on) split into ``local_world_size`` contiguous, disjoint slices of equal size, in core
    order; cores left over by the division stay unused, so no rank gets more than another.
    With more ranks than cores, consecutive ranks share a core (ranks 0 and 1 of 4 on 2 cores
    share the first), since a slice cannot be smaller than one core."""
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be at least 1, got {local_world_size}")
    if not CAN_BIND_CORES:
        raise NotImplementedError("binding ranks to cores needs os.sched_setaffinity, which "
                                  "this OS does not have (Linux has it); start the ranks unbound")
    ordered = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if not ordered:
        raise ValueError("no cores to bind ranks to")
    if local_world_size > len(ordered):
        return [frozenset({ordered[i * len(ordered) // local_world_size]})
                for i in range(local_world_size)]
    width = len(ordered) // local_world_size
    return [frozenset(ordered[i * width:(i + 1) * width]) for i in range(local_world_size)]


class RankProcesses:
    """The local ranks' processes (``procs[i]`` is local rank i), each leading its own group."""

    def __init__(self, commands: list[list[str]], envs: list[dict[str, str]], *, cwd=None,
                 stdout: list | None = None, stderr: list | None = None,
                 cores: list | None = None):
        """Start one process per command.

        ``stdout``/``stderr`` are per-rank Popen targets (files, ``subprocess.STDOUT``); the
        default is pipes, readable as ``procs[i].stdout`` / ``procs[i].stderr``. ``cores``:
        per rank, the set of cores it is bound to from before its first instruction (e.g.
        ``core_slices(len(commands))``); None leaves the ranks unbound.
        """
        count = len(commands)
        stdout = stdout or [subprocess.PIPE] * count
        stderr = stderr or [subprocess.PIPE] * count
        if cores is not None and (len(cores) != count or not all(cores)):
            raise ValueError(f"cores must give each of the {count} ranks a non-empty set of "
                             f"cores, got {cores!r}")
        binds = [None] * count if cores is None else [_binder(frozenset(c)) for c in cores]
        self.procs: list[subprocess.Popen] = []
        try:
            for command, env, out, err, bind in zip(commands, envs, stdout, stderr, binds,
                                                    strict=True):
                self.procs.append(subprocess.Popen(command, env=env, cwd=cwd, stdout=out,
                                                   stderr=err, start_new_session=True,
                                                   preexec_fn=bind))
        except BaseException:
            self.terminate()  # a half-started world would only hang at rendezvous
            raise

    def wait(self, timeout: float | None = None) -> int | None:
        """Return None once every rank exited 0, or the index of the first rank seen failing.

        Raises TimeoutError when neither happens within ``timeout`` seconds.  Ranks are polled
        together, not waited one by one, so a late rank's failure is noticed while an earlier
        rank still hangs waiting for it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [proc.poll() for proc in self.procs]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                return failed[0]
            if all(code == 0 for code in codes):
                return None
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"ranks still running after {timeout:g} s")
            time.sleep(_POLL_S)

    def terminate(self, grace_s: float = TERM_GRACE_S) -> list[int]:
        """End every rank (SIGTERM, then SIGKILL after ``grace_s``); return those that were running.

        Groups of ranks that already exited are signalled too, to end grandchildren they left
        behind.  A group id stays reserved while any member lives; an empty group is only hit
        again if its pid was reused for a new group leader, which cyclic pid allocation makes
        vanishingly unlikely within one run.
        """
        running = [i for i, proc in enumerate(self.procs) if proc.poll() is None]
        self._signal_groups(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._signal_groups(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        return running

    def _signal_groups(self, sig: int) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # the group is already empty


def _binder(cores: frozenset[int]):
    """What the child runs between fork and exec: one system call, no locks, no imports."""
    def bind() -> None:
        os.sched_setaffinity(0, cores)
    return bind


class _Interrupted(BaseException):
    """SIGINT/SIGTERM reached the launcher; unwinds ``main`` so its cleanup ends the ranks."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _ignore_signals() -> None:
    """From here on the launcher only cleans up; a (second) Ctrl-C must not cut that short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _on_signal(signum, _frame):
    _ignore_signals()
    raise _Interrupted(signum)


def _relay(pipe, prefix: bytes, sink, lock: threading.Lock,
           tail: collections.deque | None, quiet: bool) -> None:
    """Copy ``pipe`` to ``sink`` line by line under ``prefix``; keep the last lines in ``tail``.

    The lock keeps lines of different ranks from interleaving mid-line. ``quiet`` drops the
    framework's native lines below error level.
    """
    for line in iter(pipe.readline, b""):
        if quiet and _NATIVE_BELOW_ERROR.match(line):
            continue
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            sink.write(prefix + line)
            sink.flush()
        if tail is not None:
            tail.append(line.decode(errors="replace").rstrip("\n"))
    pipe.close()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="hp-run", description="Start N local ranks of a Python script for hyper_parallel.")
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start on this node")
    parser.add_argument("--backend", choices=("torch", "mindspore"),
                        help="sets HP_BACKEND for the ranks (default: inherited)")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="index of this node (default 0)")
    parser.add_argument("--master-addr", default="127.0.0.1", help="address of rank 0's node")
    parser.add_argument("--master-port", type=int,
                        help="rendezvous port (default: a free port; required if --nnodes > 1)")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help=f"end all ranks and exit {TIMEOUT_EXIT_CODE} after SECONDS")
    parser.add_argument("--bind-cores", action="store_true",
                        help="bind each local rank to its own equal slice of the cores hp-run "
                             "may use (ranks share cores when there are more ranks than cores)")
    parser.add_argument("--verbose", action="store_true",
                        help="keep the frameworks' native logging at their own default levels "
                             "(by default the ranks' MindSpore and gloo logs show errors only)")
    parser.add_argument("script", help="Python script every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    if args.nnodes < 1:
        parser.error(f"--nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1 and args.master_port is None:
        parser.error("--master-port is required when --nnodes > 1: all nodes must use the same "
                     "port, so it cannot be picked at random on each")
    if args.bind_cores and not CAN_BIND_CORES:
        parser.error("--bind-cores needs os.sched_setaffinity, which this OS does not have")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout:g}")
    if not os.path.isfile(args.script):
        parser.error(f"script not found: {args.script}")
    return args


def _run(args: argparse.Namespace) -> int:
    """Start the ranks, relay their output, and turn how they ended into an exit code."""
    first = args.node_rank * args.nproc
    port = args.master_port if args.master_port is not None else find_free_port()
    envs = [rank_environment(first + i, i, args.nnodes * args.nproc, args.nproc,
                             args.master_addr, port, args.backend, verbose=args.verbose)
            for i in range(args.nproc)]
    command = [sys.executable, args.script, *args.script_args]
    cores = core_slices(args.nproc) if args.bind_cores else None
    ranks = RankProcesses([command] * args.nproc, envs, cores=cores)
    tails = [collections.deque(maxlen=_TAIL_LINES) for _ in ranks.procs]
    relays: list[threading.Thread] = []
    timed_out, failed = False, None
    # the user asked for MindSpore's log by setting its level: relay it whole
    drop_native = not args.verbose and not any(name in os.environ for name in NATIVE_LOG_QUIET[0])
    try:
        lock = threading.Lock()
        for i, proc in enumerate(ranks.procs):
            prefix = f"[rank {first + i}] ".encode()
            for pipe, sink, tail in ((proc.stdout, sys.stdout.buffer, None),
                                     (proc.stderr, sys.stderr.buffer, tails[i])):
                relay = threading.Thread(target=_relay, args=(pipe, prefix, sink, lock, tail,
                                                               drop_native),
                                         daemon=True)
                relay.start()
                relays.append(relay)
        failed = ranks.wait(args.timeout)
    except TimeoutError:
        timed_out = True
    finally:
        _ignore_signals()
        ended = [first + i for i in ranks.terminate()]
        for relay in relays:  # a pipe still held open by a stray process must not hold us up
            relay.join(TERM_GRACE_S)
    if timed_out:
        print(f"hp-run: timed out after {args.timeout:g} s; ended ranks {ended}", file=sys.stderr)
        return TIMEOUT_EXIT_CODE
    if failed is None:
        return 0
    code = ranks.procs[failed].returncode
    how = f"exit code {code}" if code > 0 else f"signal {signal.Signals(-code).name}"
    lines = [f"hp-run: rank {first + failed} failed with {how}; ended ranks {ended}",
             f"hp-run: last {len(tails[failed])} lines of rank {first + failed}'s stderr:",
             *(f"    {line}" for line in tails[failed])]
    print("\n".join(lines), file=sys.stderr)
    return code if code > 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hp-run``; returns 0, the failed rank's exit code, 124 or 128 + signal."""
    args = _parse_args(argv)
    # the caller's handlers come back on return: main() called in a process that goes on
    # (a test, a notebook) must leave its Ctrl-C as it found it
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    for signum in previous:
        signal.signal(signum, _on_signal)
    try:
        return _run(args)
    except _Interrupted as exc:
        print(f"hp-run: interrupted by {signal.Signals(exc.signum).name}; all ranks ended",
              file=sys.stderr)
        return 128 + exc.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
