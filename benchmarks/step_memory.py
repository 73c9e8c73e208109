"""What a training step adds to memory, per added block, sharded against unsharded, on
both frameworks: the measure of FSDP's memory promise.

[Note: per added block, against the framework's own unsharded step]
A framework's allocator keeps memory its own way (MindSpore's CPU pool never hands memory
back; glibc does at once under a low ``MALLOC_MMAP_THRESHOLD_``), and the framework itself
takes hundreds of MB, so absolute peaks compare badly across frameworks. What compares is
the *slope*: how much more a step adds for each added block, found by launching the same
model at several depths (a least-squares line through the per-depth figures), and the ratio
of the sharded slope to the same framework's unsharded slope. A fully sharded step should
add about a gradient shard per block (a 1/N of an unsharded step's full gradient); a step
that holds every block's full parameters until backward adds a whole block more.

Each (framework, mode, depth) is one launch of ``world`` ranks (step_memory_rank.py); the
figure of a launch is the largest over its ranks. Also reported: the bytes the sharded
model's full parameters hold at the end of forward (only the root's, where every other
unit reshards), and the median step time (steps after the first).

    python benchmarks/step_memory.py                  # both frameworks, depths 6 12 18
    python benchmarks/step_memory.py --backend mindspore --blocks 6 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (HERE, HERE.parent):  # report.py reads the example's sizes
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from launch_ranks import launch  # noqa: E402
from report import publish  # noqa: E402

RESULTS = HERE / "results"
# FSDP's promise on both frameworks alike: MindSpore's sharded/plain slope ratio at most
# this many times torch's (a framework's own allocator moves its ratio a little)
GOAL_MS_OVER_TORCH = 1.25


def _slope(xs: list, ys: list) -> float:
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    return (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
            / sum((x - mean_x) ** 2 for x in xs))


def measure(backends: list, blocks: list, dim: int, batch: int, steps: int, world: int,
            timeout_s: float, ms_pipeline: str = "blocking", progress=print) -> dict:
    """Every launch's figures and each framework's per-block slopes and ratio."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed blocks leave the resident size
    runs = []
    for backend in backends:
        for mode in ("plain", "sharded"):
            for depth in blocks:
                job = {"backend": backend, "mode": mode, "blocks": depth, "dim": dim,
                       "batch": batch, "steps": steps, "ms_pipeline": ms_pipeline}
                ranks = launch("step_memory_rank.py", job, world, backend, timeout_s,
                               bind_cores=True)
                run = {**job, "step_added_mb": max(r["step_added_mb"] for r in ranks),
                       "step_ms": 1e3 * max(statistics.median(r["step_s"][1:]) for r in ranks),
                       "held_after_forward_mb": max(
                           (max(r["held_after_forward"], default=0) for r in ranks),
                           default=0) / 2**20}
                runs.append(run)
                progress(f"  {backend:9s} {mode:7s} {depth:3d} blocks: step adds "
                         f"{run['step_added_mb']:7.1f} MB, step {run['step_ms']:7.0f} ms"
                         + (f", full parameters held after forward "
                            f"{run['held_after_forward_mb']:.1f} MB" if mode == "sharded" else ""))
    slopes = {}
    for backend in backends:
        per_mode = {}
        for mode in ("plain", "sharded"):
            mine = [r for r in runs if r["backend"] == backend and r["mode"] == mode]
            per_mode[mode] = _slope([r["blocks"] for r in mine], [r["step_added_mb"] for r in mine])
        per_mode["ratio"] = per_mode["sharded"] / per_mode["plain"]
        slopes[backend] = per_mode
    return {"dim": dim, "batch": batch, "steps": steps, "world": world, "runs": runs,
            "slopes": slopes}


def report(result: dict) -> str:
    mb_per_block = result["dim"] ** 2 * 4 / 2**20
    lines = [f"Per added block (Linear({result['dim']}, {result['dim']}) fp32, "
             f"{mb_per_block:.0f} MiB of weights), {result['world']} ranks, a step's added peak:",
             "", "| framework | plain (unsharded) MB/block | fully_shard MB/block | sharded / plain |",
             "| --- | --- | --- | --- |"]
    for backend, s in result["slopes"].items():
        lines.append(f"| {backend} | {s['plain']:.1f} | {s['sharded']:.1f} | {s['ratio']:.2f} |")
    if {"torch", "mindspore"} <= set(result["slopes"]):
        ms_ratio = result["slopes"]["mindspore"]["ratio"] / result["slopes"]["torch"]["ratio"]
        verdict = "met" if ms_ratio <= GOAL_MS_OVER_TORCH else "MISSED"
        lines += ["", f"MindSpore's sharded/plain ratio is {ms_ratio:.2f}x torch's (goal: at "
                      f"most {GOAL_MS_OVER_TORCH}x: {verdict})."]
    lines += ["", "| framework | mode | blocks | step adds MB | step ms | full params held after forward MB |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in result["runs"]:
        held = f"{r['held_after_forward_mb']:.1f}" if r["mode"] == "sharded" else "—"
        lines.append(f"| {r['backend']} | {r['mode']} | {r['blocks']} | {r['step_added_mb']:.1f} "
                     f"| {r['step_ms']:.0f} | {held} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("torch", "mindspore", "all"), default="all")
    parser.add_argument("--blocks", type=int, nargs="+", default=[6, 12, 18])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--ms-pipeline", choices=("blocking", "async"), default="blocking",
                        help="MindSpore's PyNative execution (as run.py's option)")
    parser.add_argument("--out", type=Path, default=RESULTS / "step_memory.json")
    args = parser.parse_args()
    if len(set(args.blocks)) < 2:
        parser.error("--blocks needs at least two depths to measure a per-block slope")
    backends = ["torch", "mindspore"] if args.backend == "all" else [args.backend]
    result = measure(backends, args.blocks, args.dim, args.batch, args.steps, args.world,
                     args.timeout, args.ms_pipeline)
    publish(result, report(result), args.out)


if __name__ == "__main__":
    main()
