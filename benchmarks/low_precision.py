"""Low-precision all-gather: all-gather bytes and step time with it on and off, both
frameworks, beside FSDP2 where it runs (low_precision_rank.py is one rank).

    python benchmarks/low_precision.py [--backend torch|mindspore|all] [--rounds N]

``make bench`` (run.py) runs it after the grid. Each framework is one launch of 2 ranks in
which every variant is built and stepped in alternated rounds; a ratio is taken per round
(variant / the full-precision ``hp`` of the same round) and reported as the median with
the spread (min to max) over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from launch_ranks import LaunchFailure, launch  # noqa: E402

JOB = {"vocab": 256, "dim": 128, "hidden": 512, "blocks": 4, "seq": 16, "batch": 4,
       "steps": 2, "warmup": 1, "rounds": 5}


def measure(backends: list, rounds: int = 5, bind_cores: bool = False,
            timeout_s: float = 900) -> dict:
    """``{backend: {variant: {"gather_bytes", "step_ms", "time_vs_hp": (median, min, max)}}}``
    or ``{backend: {"error": ...}}``."""
    out = {}
    for backend in backends:
        job = dict(JOB, rounds=rounds)
        try:
            ranks = launch("low_precision_rank.py", job, 2, backend, timeout_s, bind_cores)
        except LaunchFailure as exc:
            out[backend] = {"error": str(exc)}
            continue
        variants = [r["variants"] for r in ranks]
        # the slowest rank's time counts: a step ends when every rank's does
        base = [max(r["hp"]["step_s"][i] for r in variants) for i in range(rounds)]
        rows = {}
        for variant, figures in variants[0].items():
            times = [max(r[variant]["step_s"][i] for r in variants) for i in range(rounds)]
            ratios = [t / b for t, b in zip(times, base)]
            rows[variant] = {"gather_bytes": figures["gather_bytes"][-1],
                             "step_ms": 1e3 * statistics.median(times),
                             "time_vs_hp": (statistics.median(ratios), min(ratios), max(ratios))}
        out[backend] = rows
    return out


def report(results: dict) -> str:
    lines = ["| framework | variant | all-gather bytes / step | bytes vs hp | step ms | "
             "time vs hp (median, min-max) |", "| --- | --- | ---: | ---: | ---: | --- |"]
    for backend, rows in results.items():
        if "error" in rows:
            lines.append(f"| {backend} | FAILED: {rows['error'].splitlines()[0]} | | | | |")
            continue
        for variant, row in rows.items():
            med, lo, hi = row["time_vs_hp"]
            if variant.startswith("fsdp2"):  # torch's own collectives: hp does not count them
                nbytes, ratio = "not counted", ""
            else:
                nbytes = f"{row['gather_bytes']:,}"
                ratio = f"{row['gather_bytes'] / rows['hp']['gather_bytes']:.3f}"
            lines.append(f"| {backend} | {variant} | {nbytes} | {ratio} | "
                         f"{row['step_ms']:.1f} | {med:.2f} ({lo:.2f}-{hi:.2f}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/low_precision.py")
    parser.add_argument("--backend", choices=("torch", "mindspore", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    backends = ["torch", "mindspore"] if args.backend == "all" else [args.backend]
    results = measure(backends, max(args.rounds, 1))
    print(report(results))
    return 1 if any("error" in rows for rows in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
