"""Pipeline parallelism measured on both frameworks, same shapes: hp.pipelining at
pp 2 x dp 2 (GPipe and 1F1B) against FSDP over the same 4 ranks.

[Note: what is measured]
One launch of 4 ranks per framework (pipelining_rank.py), every model in the same
processes, steps alternated:

- step time of each pipeline against FSDP 4, per round (a round's time is the slowest
  rank's), the median and quartiles of the ratio;
- the bubble: the fraction of a step a rank spends waiting for a stage's message, per
  schedule (median over rounds of the mean over ranks), beside the schedule's
  theoretical idle fraction ``(S - 1) / (n + S - 1)`` for ``S`` stages and ``n``
  micro-batches (the same for GPipe and 1F1B);
- the peak resident set of one step of each schedule per rank (CPU: the process's, with
  every model of the launch in it; the difference between the schedules is what one
  step adds).

    python benchmarks/pipelining.py                       # both frameworks (make bench runs it)
    python benchmarks/pipelining.py --backend torch --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (HERE, HERE.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from alternated import round_ratio, slowest_rounds  # noqa: E402
from analysis import spread  # noqa: E402
from launch_ranks import launch  # noqa: E402

RESULTS = HERE / "results"
STAGES = 2


def measure(backends: list, job: dict, timeout_s: float, progress=print) -> dict:
    out = {"job": job, "theoretical_bubble": (STAGES - 1) / (job["microbatches"] + STAGES - 1),
           "backends": {}}
    for backend in backends:
        ranks = launch("pipelining_rank.py", job, 4, backend, timeout_s, bind_cores=True)
        rounds = range(job["rounds"])
        slowest = slowest_rounds(ranks, ("fsdp4", "gpipe", "1f1b"), key="step_s")
        figures = {"step_s": {kind: spread(t) for kind, t in slowest.items()}}
        for kind in ("gpipe", "1f1b"):
            figures[f"{kind}_vs_fsdp4"] = round_ratio(slowest, kind, "fsdp4")
            figures[f"{kind}_bubble"] = spread(
                [statistics.mean(r["wait_s"][kind][i] / r["step_s"][kind][i] for r in ranks)
                 for i in rounds])
            figures[f"{kind}_peak_mb"] = [r["peak_mb"].get(kind) for r in ranks]
        out["backends"][backend] = figures
        progress(f"  {backend}: step / FSDP 4: GPipe {figures['gpipe_vs_fsdp4']['median']:.2f}, "
                 f"1F1B {figures['1f1b_vs_fsdp4']['median']:.2f}; bubble GPipe "
                 f"{figures['gpipe_bubble']['median']:.2f}, 1F1B "
                 f"{figures['1f1b_bubble']['median']:.2f} (theory "
                 f"{out['theoretical_bubble']:.2f}); peak MB per rank GPipe "
                 f"{figures['gpipe_peak_mb']}, 1F1B {figures['1f1b_peak_mb']}", flush=True)
    return out


def report(result: dict) -> str:
    """The markdown table of ``measure``'s result."""
    lines = ["| | FSDP 4 step | GPipe / FSDP 4 | 1F1B / FSDP 4 | bubble GPipe | bubble 1F1B |",
             "| --- | --- | --- | --- | --- | --- |"]

    def shown(x):
        return f"{x['median']:.2f} [{x['q1']:.2f}-{x['q3']:.2f}]"
    for backend, f in result["backends"].items():
        lines.append(f"| {backend} | {f['step_s']['fsdp4']['median']:.2f} s | "
                     f"{shown(f['gpipe_vs_fsdp4'])} | {shown(f['1f1b_vs_fsdp4'])} | "
                     f"{shown(f['gpipe_bubble'])} | {shown(f['1f1b_bubble'])} |")
    lines.append(f"\nbubble: the fraction of a step a rank waits in a receive; theory "
                 f"{result['theoretical_bubble']:.2f} (MindSpore CPU: a receive's wait "
                 f"returns at once, not measured)")
    return "\n".join(lines)


DEFAULT_JOB = {"rounds": 6, "warmup": 2, "width": 512, "hidden": 1024, "blocks": 8,
               "batch": 512, "microbatches": 4}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "mindspore", "both"), default="both")
    for name, value in DEFAULT_JOB.items():
        parser.add_argument(f"--{name}", type=int, default=value)
    args = parser.parse_args(argv)
    backends = ["torch", "mindspore"] if args.backend == "both" else [args.backend]
    job = {name: getattr(args, name) for name in DEFAULT_JOB}
    result = measure(backends, job, timeout_s=1800)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipelining.json").write_text(json.dumps(result, indent=1))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
