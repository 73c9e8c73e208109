"""Rank-side measurement shared by both frameworks: step timing, peak memory, result files.

[Note: how a step is timed]
Each rank times its own steps with ``time.perf_counter``. Before every step (warm-up and
measured) the ranks meet at a barrier outside the timed region, so step i starts together
on every rank and the parent can take, per step, the maximum over ranks (the slowest rank
is the step time of a synchronous job), then the median over steps. The step function must
not return before the step's work is done (MindSpore queues work asynchronously: its step
ends with a pipeline sync).

[Note: peak memory]
Linux keeps a process's resident high-water mark in ``VmHWM`` (/proc/self/status).
Writing "5" to /proc/self/clear_refs resets it to the current resident size, so resetting
before the last warm-up step and reading after the measured ones gives the peak of the
steady state alone: model, gradients, optimizer state, gathered parameters, activations, buffers,
and the framework's own footprint (the same for every implementation of one framework).
Before the reset, ``malloc_trim(0)`` returns the pages that setup freed (the unsharded
model, the numpy initial values) to the OS: without it they stayed resident in glibc's heap
and the baseline of every sharded run carried ~0.5-1 GB that no implementation uses.
Allocator retention during the steps is still counted: it is real resident memory. The
trim hands back pages the steps reuse too, and the step after it faults them in again
(on torch the first step after the reset took 1.64x its launch's median for compute-only,
1.15x for FSDP2, 1.09x for hyper_parallel, whether 2 or 4 warm-up steps came before): that
step is the last warm-up step, so no measured step pays for the measurement.
Elsewhere (no /proc) the fields are null.

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
import resource
import sys
import time
import traceback
from pathlib import Path


def release_free_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the OS (glibc ``malloc_trim``),
    so the resident size counts live memory, not what setup freed (see the note on memory)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the baseline keeps whatever the allocator retained


def reset_peak_memory() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        return True
    except OSError:
        return False


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as file:
            for line in file:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return None


def peak_memory_mb() -> float | None:
    return _status_mb("VmHWM")


def resident_mb() -> float | None:
    return _status_mb("VmRSS")


def minor_faults() -> int:
    """Page faults served without I/O so far in this process: mostly first touches of
    freshly mapped memory, which the kernel zeroes page by page (the cost of allocating
    anew what could have been reused)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed_steps(step, warmup: int, steps: int, barrier=None, measured_context=None) -> dict:
    """Run ``warmup + steps`` steps; return measured times, losses and peak memory.

    ``step(i)`` runs step i and returns its loss as a float; ``barrier()`` (None for a
    process without peers) aligns the ranks before each step, outside the timed region.
    ``measured_context`` (a context manager, e.g. ``hp.track_comms()``) is entered around
    the measured steps only, after the warm-up. ``cpu_s``: the CPU time of the whole process
    (every thread: the framework's communication threads too) per measured step;
    ``main_cpu_s``: the part of it spent by the thread that runs the step (Python, hooks,
    the kernels it launches), the rest being the framework's own threads;
    ``minor_faults``: its page faults per measured step (``minor_faults``).
    """
    times, cpu, main_cpu, faults, losses = [], [], [], [], []
    peak_reset = baseline = None
    for i in range(warmup):
        if i == warmup - 1:
            # the reset trims the heap: the next step faults those pages back in, so it is
            # the last warm-up step, not a measured one (see "peak memory" above)
            peak_reset, baseline = reset_peak_memory(), resident_mb()
        if barrier is not None:
            barrier()
        losses.append(step(i))
    if warmup == 0:
        peak_reset, baseline = reset_peak_memory(), resident_mb()
    with measured_context if measured_context is not None else contextlib.nullcontext():
        for i in range(warmup, warmup + steps):
            if barrier is not None:
                barrier()
            start_faults = minor_faults()
            start, start_cpu, start_main = time.perf_counter(), time.process_time(), time.thread_time()
            loss = step(i)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            main_cpu.append(time.thread_time() - start_main)
            faults.append(minor_faults() - start_faults)
            losses.append(loss)
    return {"step_s": times, "cpu_s": cpu, "main_cpu_s": main_cpu, "minor_faults": faults,
            "losses": losses,
            "peak_mb": peak_memory_mb() if peak_reset else None,
            "rss_before_mb": baseline, "rss_after_mb": resident_mb()}


def comm_records(stats) -> list[dict]:
    """An ``hp.CommStats`` as JSON rows ``{op, wire, dim, calls, bytes}``."""
    return [{"op": op, "wire": wire, "dim": dim, "calls": rec.calls, "bytes": rec.nbytes}
            for (op, wire, dim), rec in sorted(stats.records.items())]


def timed_rounds(round_fn, warmup: int, rounds: int, barrier=None) -> list[float]:
    """Time ``rounds`` calls of ``round_fn()`` after ``warmup`` untimed ones, each after a
    barrier (the raw-collectives measurement)."""
    times = []
    for i in range(warmup + rounds):
        if barrier is not None:
            barrier()
        start = time.perf_counter()
        round_fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def alternated(phases: dict, warmup: int, rounds: int, barrier=None) -> dict:
    """``{name: [seconds]}``: ``rounds`` rounds (after ``warmup``) in which every phase
    (``name -> fn(i)``) runs once, each after a barrier, the order reversed every other
    round. Figures that are subtracted from one another are then timed in the same minutes
    of the same processes, step by step: a slow stretch of the machine slows them alike."""
    names = list(phases)
    times: dict = {name: [] for name in names}
    for i in range(warmup + rounds):
        for name in (names if i % 2 == 0 else names[::-1]):
            if barrier is not None:
                barrier()
            start = time.perf_counter()
            phases[name](i)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


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
