"""``python benchmarks/run.py``: hyper_parallel against FSDP2, DDP and compute-only, in one run.

[Note: the run]
For each configuration of the grid (configs.py) every implementation is one launch of N
local ranks (launch_ranks.py) that trains the same model on the same data and writes JSON
results; nothing heavy runs in this process, which never imports a framework. Launches run
one at a time (they would otherwise compete for the 2 cores), each with a timeout, and a
progress line is printed when a configuration starts and ends (and one per launch), with
elapsed seconds. A failed launch is reported in the table and the JSON, the run goes on,
and the exit code is 1. At the end: the markdown tables (report.py) on stdout,
``<out>/latest.json`` with everything measured, and ``<out>/latest.png`` if matplotlib is
importable.

``--quick`` is the smoke run CI executes: a tiny model on 2 ranks, 1 warm-up and 2 measured
steps, one torch and one MindSpore configuration, written as ``quick.json``/``quick.png`` so
it never overwrites the full run's ``latest.*``. It tests that the pipeline runs, not speed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # sibling modules, also when run.py is imported from elsewhere
    sys.path.insert(0, str(HERE))

from hyper_parallel.launch import CAN_BIND_CORES  # noqa: E402

import analysis  # noqa: E402
import configs  # noqa: E402
import launch_ranks  # noqa: E402
import report  # noqa: E402

RANK_SCRIPTS = {"torch": "rank_torch.py", "mindspore": "rank_mindspore.py"}


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="benchmarks/run.py",
        description="Benchmark hyper_parallel fully_shard against torch FSDP2, DDP, a data-parallel "
                    "baseline and compute-only, on CPU (gloo / mccl).")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny model, 2 ranks, 1+2 steps, one config per backend")
    parser.add_argument("--grid", choices=("pruned", "full"), default="pruned",
                        help="pruned (default, ~26-45 min on 2 cores) or the full torch product")
    parser.add_argument("--tiny", action="store_true",
                        help="the selected grid on a tiny model with 1+2 steps (checks every code path)")
    parser.add_argument("--backend", choices=("torch", "mindspore", "all"), default="all")
    parser.add_argument("--only", metavar="SUBSTRING", action="append", default=[],
                        help="run only configurations whose name contains SUBSTRING (repeatable: any)")
    parser.add_argument("--out", type=Path, default=HERE / "results",
                        help="directory for the JSON and PNG (default benchmarks/results)")
    parser.add_argument("--ms-pipeline", choices=("blocking", "async"), default="blocking",
                        help="MindSpore PyNative execution for every MindSpore implementation alike: "
                             "blocking (default, ms.runtime.launch_blocking(): on a CPU with about "
                             "one core per rank the async pipeline's waits spin a core and starve "
                             "the ranks) or async (MindSpore's own default)")
    parser.add_argument("--rounds", type=int,
                        help="launches of hyper_parallel, of its reference (alternating, A B B A "
                             "...) and of compute-only per configuration; their steps are pooled "
                             "(default: 3 for torch, 4 for MindSpore, whose launches are short)")
    parser.add_argument("--no-bind-cores", dest="bind_cores", action="store_false",
                        default=CAN_BIND_CORES,
                        help="leave the ranks unbound (default on Linux: every launch binds its "
                             "local rank i to its own slice of the cores, as hp-run --bind-cores "
                             "does; elsewhere ranks are unbound)")
    parser.add_argument("--list", action="store_true", help="print the selected configurations and exit")
    return parser.parse_args(argv)


def _select(args) -> list:
    grid = configs.build_grid("quick" if args.quick else args.grid)
    if args.backend != "all":
        grid = [c for c in grid if c.backend == args.backend]
    if args.only:
        grid = [c for c in grid if any(s in c.name for s in args.only)]
    if args.tiny:
        grid = [configs.shrink(c) for c in grid]
    return grid


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "mindspore", "numpy", "hyper_parallel", "matplotlib"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _library_fingerprint() -> dict:
    """A hash of hyper_parallel's sources and, where this is a git checkout, its commit and
    whether the package has uncommitted changes (read-only git): taken at the start and the
    end of a run, it shows whether the library was edited while the run measured it (an
    editable install picks up edits at each launch)."""
    import hyper_parallel

    root = Path(hyper_parallel.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    out = {"sources_sha256": digest.hexdigest()[:16], "commit": None, "dirty": None}
    try:
        git = ["git", "-C", str(root.parent)]
        out["commit"] = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(git + ["status", "--porcelain", "--", str(root)],
                                capture_output=True, text=True, timeout=10, check=True).stdout
        out["dirty"] = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def _launch_plan(cfg, index: int, rounds: int) -> list:
    """The launches of one configuration in order. hyper_parallel and its reference run
    back to back ``rounds`` times, the order flipped each round (and from one configuration
    to the next): A B B A. A drift in the machine's load, or a penalty for whichever launch
    comes first, then weighs on both sides alike. Compute-only runs every round too: the
    overhead subtracts it, and one slow or fast launch of it would move every overhead of
    the configuration. DDP, a side reference, runs once."""
    ref = configs.REFERENCE[cfg.backend]
    plan = []
    for round_index in range(rounds):
        order = list(cfg.impls)
        if (index + round_index) % 2 == 0 and "hp" in order and ref in order:
            i, j = order.index("hp"), order.index(ref)
            order[i], order[j] = order[j], order[i]
        plan += [impl for impl in order if round_index == 0 or impl in ("hp", ref, "compute")]
    return plan


def _run_config(index: int, total: int, cfg, cache: dict, t_run: float,
                ms_pipeline: str, rounds: int, bind_cores: bool) -> tuple[dict, int]:
    """Launch (or reuse) every implementation of ``cfg``; return its row and the failures."""
    print(f"[{index}/{total}] {cfg.name} ({cfg.world_size} ranks, {len(cfg.dims) - 1} blocks): "
          f"start (run {time.monotonic() - t_run:.0f} s)", flush=True)
    started = time.monotonic()
    plan = _launch_plan(cfg, index, rounds)
    rounds_of: dict = {}
    sources, failures = {}, 0
    for impl in plan:
        key = configs.Impl(cfg, impl).run_key
        if key in cache:
            if impl not in sources:
                rounds_of[impl], sources[impl] = [cache[key][0]], cache[key][1]
                print(f"    {configs.IMPL_LABELS[impl]}: reused from {sources[impl]}", flush=True)
            continue
        t0 = time.monotonic()
        # the minimal schedule the rank times as its raw collectives: the same list the
        # measured bytes are divided by (analysis.py)
        job = {"config": cfg.to_json(), "impl": impl, "comm_timeout_s": cfg.timeout_s,
               "schedule": analysis.minimum_schedule(cfg, impl), "ms_pipeline": ms_pipeline}
        try:
            ranks = launch_ranks.launch(RANK_SCRIPTS[cfg.backend], job, cfg.world_size, cfg.backend,
                                        cfg.timeout_s, bind_cores)
            summary = analysis.summarize_launch(ranks, cfg.steps)
            detail = f"median step {summary['step_s'] * 1000:.0f} ms"
        except launch_ranks.LaunchFailure as exc:
            summary, failures = {"error": str(exc)}, failures + 1
            detail = "FAILED: " + str(exc).splitlines()[0]
        summary["launch_s"] = time.monotonic() - t0
        rounds_of.setdefault(impl, []).append(summary)
        sources[impl] = cfg.name
        print(f"    {configs.IMPL_LABELS[impl]}: {summary['launch_s']:.1f} s, {detail}", flush=True)
    launches = {impl: analysis.pool_rounds(summaries) for impl, summaries in rounds_of.items()}
    for impl, summary in launches.items():
        cache.setdefault(configs.Impl(cfg, impl).run_key, (summary, sources[impl]))
    figures = analysis.derive(cfg, launches)
    hp = figures.get("hp", {})
    ratio = hp.get("step_vs_ref")
    print(f"[{index}/{total}] {cfg.name}: done in {time.monotonic() - started:.1f} s"
          + (f" (hp/{configs.IMPL_LABELS[configs.REFERENCE[cfg.backend]]} time {ratio:.2f})"
             if ratio is not None else ""), flush=True)
    row = {"config": cfg.to_json(), "figures": figures, "launches": launches,
           "launch_order": plan,
           "launch_source": sources}
    return row, failures


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        print(f"--rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    grid = _select(args)
    if not grid:
        print("no configuration matches the filters", file=sys.stderr)
        return 2
    if args.list:
        for cfg in grid:
            print(cfg.name)
        return 0
    stem = "quick" if args.quick or args.tiny else "latest"
    print(f"hyper_parallel benchmark: {len(grid)} configurations on {os.cpu_count()} cores "
          f"({'quick' if args.quick else args.grid} grid; ranks "
          f"{'bound to cores' if args.bind_cores else 'unbound'})", flush=True)
    if not args.quick and args.grid == "pruned":
        print(f"note: {configs.PRUNING_NOTE}", flush=True)
    library_at_start = _library_fingerprint()
    t_run = time.monotonic()
    cache: dict = {}
    rows, failures = [], 0
    for index, cfg in enumerate(grid, 1):
        row, failed = _run_config(index, len(grid), cfg, cache, t_run, args.ms_pipeline,
                                  args.rounds or configs.DEFAULT_ROUNDS[cfg.backend],
                                  args.bind_cores)
        rows.append(row)
        failures += failed
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "grid": "quick" if args.quick else args.grid,
        "rounds": {backend: args.rounds or configs.DEFAULT_ROUNDS[backend]
                   for backend in sorted({cfg.backend for cfg in grid})},
        "grid_note": None if args.quick or args.grid == "full" else configs.PRUNING_NOTE,
        "filters": {"backend": args.backend, "only": args.only},
        "wall_s": time.monotonic() - t_run,
        "environment": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "machine": platform.machine(), "versions": _versions(),
                        "mindspore_pipeline": args.ms_pipeline,
                        "bind_cores": args.bind_cores},
        "library": {"start": library_at_start, "end": _library_fingerprint()},
        "configurations": rows,
    }
    doc["library"]["changed_during_run"] = (doc["library"]["start"]["sources_sha256"]
                                            != doc["library"]["end"]["sources_sha256"])
    json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"
    report.write_json(doc, json_path)
    print()
    print(report.markdown(doc))
    print()
    print(f"wrote {json_path}")
    print(report.write_png(doc, png_path))
    if doc["library"]["changed_during_run"]:
        print("WARNING: hyper_parallel's sources changed during the run; launches measured "
              "different versions of the library (see 'library' in the JSON)")
    print(f"total wall time {doc['wall_s']:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
