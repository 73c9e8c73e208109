"""``python benchmarks/run.py``: hyper_parallel against FSDP2, DDP and compute-only, in one run.

[Note: the run]
Every configuration (configs.py) is one launch of N local ranks (launch_ranks.py) in which
every implementation is built and stepped in alternated rounds (measure.py); nothing heavy
runs in this process, which never imports a framework. Launches run one at a time, each
with a timeout, with a progress line per configuration. A failed launch is reported in the
table and the JSON, the run goes on, and the exit code is 1. At the end: the headline table
(report.py) on stdout, ``<out>/latest.json`` with everything measured, and
``<out>/latest.png`` if matplotlib is importable.

``--full`` runs the full grid instead of the headline one (written as ``full.json`` /
``full.png``); ``--quick`` is the smoke run the test suite executes: tiny models, 1 + 2
rounds, one launch per workload and framework, written as ``quick.*``. It tests that the
pipeline runs, not speed. After the grid: the step memory (not in ``--quick``), tensor
parallelism against FSDP (tensor_parallel.py; the tiny model in ``--quick``), context
parallelism against one process (context_parallel.py; not in ``--quick``), the
low-precision all-gather (low_precision.py; not in ``--quick``) and expert parallelism
against FSDP (expert_parallel.py; not in ``--quick``).
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
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (HERE, HERE.parent):  # sibling modules; examples/ at the repository root
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from hyper_parallel.launch import CAN_BIND_CORES  # noqa: E402

import analysis  # noqa: E402
import configs  # noqa: E402
import launch_ranks  # noqa: E402
import low_precision  # noqa: E402
import report  # noqa: E402
import step_memory  # noqa: E402
import pipelining  # noqa: E402
import tensor_parallel  # noqa: E402
import expert_parallel  # noqa: E402
import context_parallel  # noqa: E402

RANK_SCRIPTS = {"torch": "rank_torch.py", "mindspore": "rank_mindspore.py"}


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="benchmarks/run.py",
        description="Benchmark hyper_parallel fully_shard against torch FSDP2, DDP, a data-parallel "
                    "baseline and compute-only, on CPU (gloo / mccl).")
    grid = parser.add_mutually_exclusive_group()
    grid.add_argument("--full", action="store_true",
                      help="the full grid (every mesh, reshard_after_forward, precision and "
                           "model; larger models, more rounds) instead of the headline grid")
    grid.add_argument("--quick", action="store_true",
                      help="smoke run: tiny models, 1 + 2 rounds, one launch per workload and framework")
    parser.add_argument("--backend", choices=("torch", "mindspore", "all"), default="all")
    parser.add_argument("--only", metavar="SUBSTRING", action="append", default=[],
                        help="run only configurations whose name contains SUBSTRING (repeatable: any)")
    parser.add_argument("--rounds", type=int, help="measured alternated rounds per configuration "
                                                   "(default: the grid's)")
    parser.add_argument("--out", type=Path, default=HERE / "results",
                        help="directory for the JSON and PNG (default benchmarks/results)")
    parser.add_argument("--no-bind-cores", dest="bind_cores", action="store_false",
                        default=CAN_BIND_CORES,
                        help="leave the ranks unbound (default on Linux: local rank i is bound "
                             "to its own slice of the cores, as hp-run --bind-cores does)")
    parser.add_argument("--ms-pipeline", choices=("blocking", "async"), default="blocking",
                        help="MindSpore PyNative execution, for every MindSpore phase alike: "
                             "blocking (default, ms.runtime.launch_blocking()) or async "
                             "(MindSpore's own default; see benchmarks/README.md)")
    parser.add_argument("--no-step-memory", dest="step_memory", action="store_false",
                        help="skip the per-block step memory measurement (step_memory.py; "
                             "never in --quick)")
    parser.add_argument("--no-tensor-parallel", dest="tensor_parallel", action="store_false",
                        help="skip tensor parallelism against FSDP (tensor_parallel.py)")
    parser.add_argument("--no-expert-parallel", dest="expert_parallel", action="store_false",
                        help="skip expert parallelism against FSDP (expert_parallel.py; never "
                             "in --quick)")
    parser.add_argument("--no-pipelining", dest="pipelining", action="store_false",
                        help="skip pipelining against FSDP (pipelining.py; never in --quick)")
    parser.add_argument("--no-context-parallel", dest="context_parallel", action="store_false",
                        help="skip context parallelism against one process "
                             "(context_parallel.py)")
    parser.add_argument("--no-low-precision", dest="low_precision", action="store_false",
                        help="skip the low-precision all-gather measurement (low_precision.py; "
                             "never in --quick)")
    parser.add_argument("--list", action="store_true", help="print the selected configurations and exit")
    return parser.parse_args(argv)


def _grid_kind(args) -> str:
    return "quick" if args.quick else "full" if args.full else "headline"


def _select(args) -> list:
    grid = configs.build_grid(_grid_kind(args))
    if args.backend != "all":
        grid = [c for c in grid if c.backend == args.backend]
    if args.only:
        grid = [c for c in grid if any(s in c.name for s in args.only)]
    if args.rounds is not None:
        grid = [replace(c, rounds=args.rounds) for c in grid]
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


def _measured(label: str, what: str, measure_call) -> dict:
    """``measure_call()``'s figures, announced as ``label: what``; a launch that fails is
    reported and recorded, and the run goes on to the next comparison."""
    print(f"{label}: {what}", flush=True)
    try:
        return measure_call()
    except launch_ranks.LaunchFailure as exc:
        print(f"{label}: FAILED: {str(exc).splitlines()[0]}", flush=True)
        return {"error": str(exc)}


def _run_step_memory(args, backends: list) -> dict:
    """What a training step adds to memory per added block, sharded against unsharded
    (step_memory.py; the full grid measures more depths)."""
    blocks = [4, 8, 12] if args.full else [4, 8]
    return _measured(
        "step memory", f"Linear(2048, 2048) blocks at depths {blocks}, plain and sharded, "
        f"{', '.join(backends)}",
        lambda: step_memory.measure(backends, blocks, dim=2048, batch=8, steps=3, world=2,
                                    timeout_s=900, ms_pipeline=args.ms_pipeline))


def _run_tensor_parallel(args, backends: list) -> dict:
    """The example LM at dp2 x tp2 against FSDP over 4 ranks (tensor_parallel.py): size
    small, 6 rounds; tiny and 2 rounds in --quick."""
    shape = dict(size="tiny", batch=4, seq=32, warmup=0, rounds=2) if args.quick else \
        dict(size="small", batch=8, seq=128, warmup=1, rounds=args.rounds or 6)
    return _measured(
        "tensor parallelism", f"example LM {shape['size']}, dp2 x tp2 against FSDP 4, "
        f"{', '.join(backends)}",
        lambda: tensor_parallel.measure(backends, timeout_s=1800, **shape))


def _run_expert_parallel(args, backends: list) -> dict:
    """The example LM with experts at dp2 x ep2 against FSDP over 4 ranks
    (expert_parallel.py): size tiny, 4 rounds."""
    return _measured(
        "expert parallelism", f"example LM tiny with experts, dp2 x ep2 against FSDP 4, "
        f"{', '.join(backends)}",
        lambda: expert_parallel.measure(backends, "tiny", batch=8, seq=32, warmup=1,
                                        rounds=args.rounds or 4, timeout_s=1800))


def _run_pipelining(backends: list) -> dict:
    """pp2 x dp2 under GPipe and 1F1B against FSDP over 4 ranks (pipelining.py)."""
    return _measured(
        "pipelining", f"pp2 x dp2 (GPipe, 1F1B) against FSDP 4, {', '.join(backends)}",
        lambda: pipelining.measure(backends, dict(pipelining.DEFAULT_JOB), timeout_s=1800))


def _run_context_parallel(args, backends: list) -> dict:
    """The example LM at cp2 against one process (context_parallel.py): size small,
    sequences of 256, 4 rounds."""
    return _measured(
        "context parallelism", f"example LM small, cp2 against one process, "
        f"{', '.join(backends)}",
        lambda: context_parallel.measure(backends, "small", batch=2, seq=256, warmup=1,
                                         rounds=args.rounds or 4, timeout_s=1800))


def _run_config(index: int, total: int, cfg, t_run: float, bind_cores: bool,
                ms_pipeline: str) -> dict:
    """One launch: every implementation of ``cfg`` in the same processes; its row."""
    print(f"[{index}/{total}] {cfg.name} ({cfg.world_size} ranks; {', '.join(cfg.impls)}; "
          f"{cfg.warmup} + {cfg.rounds} rounds): start at {time.monotonic() - t_run:.0f} s",
          flush=True)
    started = time.monotonic()
    job = {"config": cfg.to_json(), "comm_timeout_s": cfg.timeout_s,
           "schedule": analysis.minimum_schedule(cfg), "ms_pipeline": ms_pipeline}
    row = {"config": cfg.to_json()}
    try:
        ranks = launch_ranks.launch(RANK_SCRIPTS[cfg.backend], job, cfg.world_size, cfg.backend,
                                    cfg.timeout_s, bind_cores)
        row["figures"] = analysis.derive(cfg, ranks)
        row["cores_per_rank"] = [r.get("cores") for r in ranks]
        ref = configs.REFERENCE[cfg.backend]
        ratio = row["figures"]["ratios"].get(f"hp_vs_{ref}", {}).get("median")
        detail = f"hp/{configs.IMPL_LABELS[ref]} time {ratio:.2f}" if ratio else "done"
    except launch_ranks.LaunchFailure as exc:
        row["error"] = str(exc)
        detail = "FAILED: " + str(exc).splitlines()[0]
    row["launch_s"] = time.monotonic() - started
    print(f"[{index}/{total}] {cfg.name}: {row['launch_s']:.1f} s, {detail}", flush=True)
    return row


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
    kind = _grid_kind(args)
    stem = {"headline": "latest"}.get(kind, kind)
    print(f"hyper_parallel benchmark: {len(grid)} configurations ({kind} grid) on "
          f"{os.cpu_count()} cores, ranks {'bound to cores' if args.bind_cores else 'unbound'}",
          flush=True)
    library_at_start = _library_fingerprint()
    t_run = time.monotonic()
    rows = [_run_config(i, len(grid), cfg, t_run, args.bind_cores, args.ms_pipeline)
            for i, cfg in enumerate(grid, 1)]
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "grid": kind,
        "filters": {"backend": args.backend, "only": args.only, "rounds": args.rounds},
        "wall_s": time.monotonic() - t_run,
        "environment": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "machine": platform.machine(), "versions": _versions(),
                        "bind_cores": args.bind_cores, "mindspore_pipeline": args.ms_pipeline},
        "library": {"start": library_at_start, "end": _library_fingerprint()},
        "configurations": rows,
    }
    backends = ["torch", "mindspore"] if args.backend == "all" else [args.backend]
    if args.step_memory and not args.quick:
        doc["step_memory"] = _run_step_memory(args, backends)
        doc["wall_s"] = time.monotonic() - t_run
    if args.tensor_parallel:
        doc["tensor_parallel"] = _run_tensor_parallel(args, backends)
    if args.expert_parallel and not args.quick:
        doc["expert_parallel"] = _run_expert_parallel(args, backends)
    if args.pipelining and not args.quick:
        doc["pipelining"] = _run_pipelining(backends)
    if args.context_parallel and not args.quick:
        doc["context_parallel"] = _run_context_parallel(args, backends)
        doc["wall_s"] = time.monotonic() - t_run
    if args.low_precision and not args.quick:
        print(f"low-precision all-gather: {', '.join(backends)}, alternated rounds", flush=True)
        doc["low_precision"] = low_precision.measure(backends, bind_cores=args.bind_cores)
        doc["wall_s"] = time.monotonic() - t_run
    doc["library"]["changed_during_run"] = (doc["library"]["start"]["sources_sha256"]
                                            != doc["library"]["end"]["sources_sha256"])
    json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"
    report.write_json(doc, json_path)
    print()
    print(report.markdown(doc))
    if "step_memory" in doc:
        print()
        print(doc["step_memory"].get("error") or step_memory.report(doc["step_memory"]))
    if "tensor_parallel" in doc:
        print()
        print(doc["tensor_parallel"].get("error") or tensor_parallel.report(doc["tensor_parallel"]))
    if "expert_parallel" in doc:
        print()
        print(doc["expert_parallel"].get("error") or expert_parallel.report(doc["expert_parallel"]))
    if "pipelining" in doc:
        print()
        print(doc["pipelining"].get("error") or pipelining.report(doc["pipelining"]))
    if "context_parallel" in doc:
        print()
        print(doc["context_parallel"].get("error")
              or context_parallel.report(doc["context_parallel"]))
    if "low_precision" in doc:
        print()
        print(low_precision.report(doc["low_precision"]))
    print()
    print(f"wrote {json_path}")
    print(report.write_png(doc, png_path))
    if doc["library"]["changed_during_run"]:
        print("WARNING: hyper_parallel's sources changed during the run; launches measured "
              "different versions of the library (see 'library' in the JSON)")
    print(f"total wall time {doc['wall_s']:.0f} s")
    failed = any("error" in row for row in rows) or any(
        "error" in doc.get(part, {}) for part in ("step_memory", "tensor_parallel",
                                                  "expert_parallel")) or \
        any("error" in lp for lp in doc.get("low_precision", {}).values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
