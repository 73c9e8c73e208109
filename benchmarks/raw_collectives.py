"""The communication floor of a step: its collectives issued back to back, with no compute.

[Note: what "raw collectives" means]
``time_schedule`` takes a schedule from workload.py (the minimal collectives of one step,
in issue order and at their real sizes) and issues it through the hyper_parallel platform
primitives (``all_gather_into``, ``reduce_scatter``, ``all_reduce``) on zero-filled flat
buffers made with ``platform.zeros``, each call synchronous, nothing else in between. One
round is one step's worth. Its median time is what the step's communication costs when
nothing overlaps it and no library code runs around it, so

    overhead = step - (compute-only step + raw collectives)

is the time an implementation spends beyond compute and the unavoidable communication:
Python work, copies, allocation, waiting. Overlap of communication with compute makes it
negative. On MindSpore CPU the primitives are the platform's composed ones (reduce-scatter
= all-reduce + own chunk, all-gather = list all-gather + concatenation), so this floor is
the platform's, not an ideal network's.

Each round's CPU time (the whole process, communication threads included, and the calling
thread's alone) is kept too: collectives that keep the CPU busy cannot be hidden behind
compute on a machine whose cores the ranks already fill (analysis.py, "CPU overhead").

Buffers are allocated once per distinct (op, size, dtype) and reused by every call of that
shape: the calls are synchronous, so sharing is safe and the memory stays small.
"""

from __future__ import annotations

import time

import measure


def time_schedule(hp, schedule: list[dict], groups: dict, warmup: int, rounds: int,
                  barrier=None, finish=None) -> dict:
    """Time ``rounds`` rounds of ``schedule``; also count what they sent with track_comms.

    ``groups`` maps a schedule dim ("shard", "replicate", "") to ``(group, group_size)``;
    ``finish()`` (MindSpore) waits for queued work at the end of each round.
    """
    p = hp.get_platform()
    buffers: dict = {}
    calls = []
    for entry in schedule:
        op, numel, dim = entry["op"], entry["numel"], entry["dim"]
        group, size = groups[dim]
        key = (op, numel, entry["dtype"], dim)
        if key not in buffers:
            dtype = p.dtype(entry["dtype"])
            if op == "all_gather":
                buffers[key] = (p.zeros((numel,), dtype), p.zeros((numel // size,), dtype))
            elif op == "reduce_scatter":
                buffers[key] = (p.zeros((numel // size,), dtype), p.zeros((numel,), dtype))
            else:
                buffers[key] = (p.zeros((numel,), dtype),)
        calls.append((op, group, dim, buffers[key]))

    def one_round():
        for op, group, dim, bufs in calls:
            if op == "all_gather":
                p.all_gather_into(bufs[0], bufs[1], group, dim=dim)
            elif op == "reduce_scatter":
                p.reduce_scatter(bufs[0], bufs[1], group, dim=dim)
            else:
                p.all_reduce(bufs[0], group, op="sum", dim=dim)
        if finish is not None:
            finish()

    cpu, main_cpu = [], []

    def cpu_timed_round():
        start, start_main = time.process_time(), time.thread_time()
        one_round()
        cpu.append(time.process_time() - start)
        main_cpu.append(time.thread_time() - start_main)

    with hp.track_comms() as window:
        times = measure.timed_rounds(cpu_timed_round, warmup, rounds, barrier)
    return {"round_s": times, "round_cpu_s": cpu[warmup:], "round_main_cpu_s": main_cpu[warmup:],
            "rounds_counted": warmup + rounds,
            "comm": measure.comm_records(window)}

