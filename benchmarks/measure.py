"""Rank-side measurement shared by both frameworks: alternated phases, memory, result files.

[Note: every implementation in the same processes]
One launch measures every implementation of a configuration (hyper_parallel, FSDP2, DDP,
compute-only, ...; a "phase" each). The ranks build each phase's model in turn, then run
rounds in which every phase steps once, the order reversed every other round (A B C,
C B A, A B C, ...), each step after a barrier outside the timed region. So the figures
compared with one another come from the same minutes of the same processes: a slow stretch
of the machine slows them alike, and a phase is never favoured by always coming first.
Every phase steps through the same batches in the same order (step i reads batch
i mod N), so their losses can be compared step by step.

[Note: peak memory, attributed per phase]
The phases share one process, so its resident high-water mark (``VmHWM``) alone cannot say
which phase needed what. Each phase's peak is therefore assembled from three readings, each
taken after ``malloc_trim`` (which hands the C heap's free pages back to the OS, so the
resident size counts live memory):

* ``base_mb``: the resident size before any phase is built (framework, process group, data);
* ``persistent_mb``: how much the resident size grew while the phase was built and took
  its first step (parameters, optimizer state, buffers the implementation keeps);
* ``transient_mb``: the high-water mark during one more step, reset just before it
  (``echo 5 > /proc/self/clear_refs``), above the resident size at the reset (gradients,
  activations, gathered parameters, communication buffers).

peak = base + persistent + transient, as if the phase ran alone. What a process does once,
the first time a code path runs (lazy imports, kernel and autograd caches, the process
group's buffers), would land on whichever phase is built first; so before the base reading
every phase is built on a tiny model, stepped twice and dropped (priming). The memory step runs
after the timed rounds: the trim before it makes that step fault its pages back in, which
would slow a timed step. Elsewhere (no /proc) the fields are null.

[Note: results travel as JSON files]
A rank writes ``result.<rank>.json`` atomically (write, then rename) and nothing else
crosses the process boundary: no tensors, no pickles. A failure writes ``error.<rank>.txt``
with the traceback and exits 1. The process ends with ``os._exit`` so that no framework
atexit hook can hang on a peer that already left.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path


def release_free_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the OS (glibc ``malloc_trim``)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the readings keep whatever the allocator retained


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as file:
            for line in file:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return None


def trimmed_resident_mb() -> float | None:
    release_free_memory()
    return _status_mb("VmRSS")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        return True
    except OSError:
        return False


def alternate(steps: dict, first: int, warmup: int, rounds: int, barrier=None) -> dict:
    """Run ``warmup + rounds`` rounds in which every phase (``name -> step(i)``, returning its
    loss) steps once, the order reversed every other round; return the measured rounds'
    ``times`` (seconds) and process ``cpu`` seconds per phase, every round's ``losses``, and
    the ``order`` of each measured round."""
    names = list(steps)
    out = {"times": {n: [] for n in names}, "cpu": {n: [] for n in names},
           "losses": {n: [] for n in names}, "order": []}
    for k in range(warmup + rounds):
        order = names if k % 2 == 0 else names[::-1]
        for name in order:
            if barrier is not None:
                barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = steps[name](first + k)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            out["losses"][name].append(loss)
            if k >= warmup:
                out["times"][name].append(elapsed)
                out["cpu"][name].append(cpu)
        if k >= warmup:
            out["order"].append(list(order))
    return out


def measure_phases(builders: dict, warmup: int, rounds: int, barrier=None,
                   counters: dict | None = None, primers: dict | None = None) -> dict:
    """Build every phase (``name -> build()`` returning its ``step(i)``), take its first step,
    run the alternated rounds, then one memory step and one counted step per phase.

    ``counters`` maps a phase to a context manager factory ``counter(rows)`` that appends what
    the step sent (``comm_records`` rows) to ``rows``; the counted step runs last.
    ``primers`` are builders of the same phases on a tiny model, each built and stepped twice
    and dropped before anything is measured (the note on peak memory).
    """
    for build in (primers or {}).values():
        step = build()
        for i in range(2):
            if barrier is not None:
                barrier()
            step(i)
        del step
    base = trimmed_resident_mb()
    steps, persistent, setup_s = {}, {}, {}
    for name, build in builders.items():
        before, start = trimmed_resident_mb(), time.perf_counter()
        steps[name] = build()
        if barrier is not None:
            barrier()
        steps[name](0)
        setup_s[name] = time.perf_counter() - start
        after = trimmed_resident_mb()
        persistent[name] = None if None in (before, after) else after - before
    result = alternate(steps, 1, warmup, rounds, barrier)
    index = 1 + warmup + rounds
    transient = {}
    for name, step in steps.items():
        at_reset = trimmed_resident_mb()
        reset = _reset_peak()
        if barrier is not None:
            barrier()
        step(index)
        high = _status_mb("VmHWM") if reset else None
        transient[name] = None if None in (high, at_reset) else max(0.0, high - at_reset)
    comm = {}
    for name, counter in (counters or {}).items():
        rows: list = []
        if barrier is not None:
            barrier()
        with counter(rows):
            steps[name](index + 1)
        comm[name] = rows
    result.update(base_mb=base, persistent_mb=persistent, transient_mb=transient,
                  setup_s=setup_s, comm=comm)
    return result


def comm_records(stats) -> list[dict]:
    """An ``hp.CommStats`` as JSON rows ``{op, wire, dim, calls, bytes}``."""
    return [{"op": op, "wire": wire, "dim": dim, "calls": rec.calls, "bytes": rec.nbytes}
            for (op, wire, dim), rec in sorted(stats.records.items())]


@contextlib.contextmanager
def track_into(hp, out: list):
    """``hp.track_comms()`` around a block; its records land in ``out`` (comm_records rows)."""
    with hp.track_comms() as window:
        yield
    out.extend(comm_records(window))


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def rank_main(run) -> None:
    """``python rank_<framework>.py JOB.json``: call ``run(job, rank, world)`` and write its
    dict to ``result.<rank>.json`` next to the job file (or the traceback to error.<rank>.txt)."""
    job_path = Path(sys.argv[1])
    rank, world = rank_and_world()
    code = 0
    try:
        job = json.loads(job_path.read_text())
        result = run(job, rank, world)
        result["rank"] = rank
        result["cores"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        partial = job_path.parent / f"result.{rank}.json.partial"
        partial.write_text(json.dumps(result))
        os.replace(partial, job_path.parent / f"result.{rank}.json")
    except BaseException:  # noqa: BLE001 - the parent reports the traceback
        (job_path.parent / f"error.{rank}.txt").write_text(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
