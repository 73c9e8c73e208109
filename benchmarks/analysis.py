"""From per-rank results to the figures of one configuration: medians, ratios, overhead.

[Note: the figures]
* step time: per measured step the maximum over ranks (a synchronous job runs at its
  slowest rank), then the median over steps;
* peak memory: the maximum over ranks of each rank's VmHWM in the measured steps;
* bytes per step: rank 0's counted bytes (every rank sends the same) divided by the measured
  steps, per collective and mesh dim, and divided by the theoretical minimum of workload.py
  (for DDP and MindSpore's DP baseline: every gradient's fp32 bytes all-reduced once);
* compute: the compute-only launches' step time (max over its concurrent processes; every
  round launches it, and its steps are pooled like the others');
* raw collectives: the minimal schedule issued back to back (raw_collectives.py), timed by
  every launch of hyper_parallel after its steps and pooled over them (median over every
  round of every launch); FSDP2 and hyper_parallel share it (same schedule), DDP and the DP
  baseline time their own;
* overhead = step - (compute + raw collectives), also in % of the step; negative means
  communication was overlapped with compute. Per round too (``overhead_pct_per_round``):
  each launch's median step against its own raw collectives, so a reader sees how far the
  figure moves between launches of identical code;
* paired overhead = step - (compute-only timed in the same launch + raw collectives): each
  distributed launch steps the plain model once more at its end, in the same processes and
  on the same cores (``compute_paired``, pooled like the steps). The separate compute-only
  launches are new processes with their own heap, started minutes apart from the step
  they are subtracted from, and on the 2-core machine a launch can run ~20% fast or slow
  as a whole; the same-launch figure moves with the step. Both are reported; per round
  too (``paired_overhead_pct_per_round``: each launch against its own compute and raw);
* alternated overhead = step - (compute + raw collectives), all timed in one launch
  step by step: after its sequential figures, each hyper_parallel launch runs rounds in
  which its own step, the plain model's compute-only step, the interleaved floor's step
  and one round of raw collectives each run once (``measure.alternated``), so the four
  come from the same minutes of the same processes and a slow stretch slows them alike.
  Per round the difference, then the median over the pooled rounds, in % of the median
  alternated step; per launch too. Split in two: the interleave cost = interleaved floor
  - (compute + raw collectives), what placing the collectives between the compute costs
  with no library code at all (the floor is the plain model with the minimal schedule
  issued from hooks where the step needs it, raw_collectives.py, "the interleaved
  floor"), and the library overhead = step - interleaved floor, the library's own cost:
  its Python, copies and waits. (Medians of per-round differences: the two parts add up
  to the whole only about.) The floor's collectives are synchronous: where the step
  overlaps them with compute (torch), the library overhead is negative by what the
  overlap hides;
* exposed communication = step - compute;
* round spread = (slowest - fastest launch's median step) / step, where an implementation
  was launched more than once (run.py's rounds): the noise of this run, which a difference
  between implementations or an overhead has to exceed to mean something;
* CPU overhead = step CPU - (compute CPU + raw collectives CPU), per rank (CPU time of the
  whole process, every thread), also in % of the step's CPU. Wall-clock overhead mixes the
  work an implementation adds with how the ranks' threads share the cores; the CPU
  figure counts only the work, so it stays meaningful where the ranks oversubscribe the
  machine. ``raw_cpu_per_wall`` says how busy the raw collectives keep a rank: near the
  cores each rank has, communication cannot hide behind compute, and the wall-clock
  overhead cannot go far below zero. Split by thread: the same difference for the thread
  that runs the step (``cpu_overhead_main_s``: Python and hooks, the copies, casts and
  scaling it does, the cost of issuing collectives) and the remainder, the framework's
  own threads (``cpu_overhead_threads_s``: mostly communication, e.g. the fixed cost of
  collectives beyond the minimal schedule's);
* loss check: the largest relative difference of rank 0's per-step losses to the reference
  implementation's. Same weights, data and averaging, so it should be ~1e-6 (fp32) or
  ~1e-2 (bf16); a large value means the comparison is not like for like.
"""

from __future__ import annotations

import statistics

import configs
import workload

SHARDED_IMPLS = ("hp", "fsdp2")
# CPU time per step as the ranks record it -> its figure: the whole process, the stepping thread
_STEP_CPU = (("cpu_s", "step_cpu"), ("main_cpu_s", "step_main_cpu"))
_RAW_CPU = (("round_cpu_s", "cpu_s"), ("round_main_cpu_s", "main_cpu_s"))


def summarize_launch(ranks: list[dict], steps: int) -> dict:
    """Collapse one launch's per-rank results (index = rank)."""
    per_rank = [r["timing"]["step_s"] for r in ranks]
    step_max = [max(times) for times in zip(*per_rank)]
    peaks = [r["timing"]["peak_mb"] for r in ranks]
    out = {
        "step_s": statistics.median(step_max),
        "step_max_over_ranks_s": step_max,
        "step_s_per_rank": per_rank,
        "peak_mb": max(peaks) if all(p is not None for p in peaks) else None,
        "peak_mb_per_rank": peaks,
        # resident size when the peak was reset (before the last warm-up step): what the steps started from
        "rss_before_mb_per_rank": [r["timing"].get("rss_before_mb") for r in ranks],
        "losses_rank0": ranks[0]["timing"]["losses"],
        "setup_s": max(r["setup_s"] for r in ranks),
        "cores_per_rank": [r.get("cores") for r in ranks],  # what each rank was bound to
    }
    for key, name in _STEP_CPU:
        per_rank_cpu = [r["timing"].get(key) for r in ranks]
        if all(per_rank_cpu):  # per step, the mean over ranks: the work one rank does
            out[f"{name}_per_step_s"] = [statistics.fmean(c) for c in zip(*per_rank_cpu)]
            out[f"{name}_s"] = statistics.median(out[f"{name}_per_step_s"])
    faults = [r["timing"].get("minor_faults") for r in ranks]
    if all(f is not None for f in faults):  # per step, the mean over ranks
        out["minor_faults_per_step"] = statistics.median(statistics.fmean(f) for f in zip(*faults))
    if "comm" in ranks[0]:
        out["comm_source"] = ranks[0].get("comm_source")
        out["comm_per_step"] = _per_step(ranks[0]["comm"], steps)
        out["comm_same_on_all_ranks"] = all(r.get("comm") == ranks[0]["comm"] for r in ranks)
    for name in ("raw", "raw_reduce_scatters", "raw_same_size_all_gathers"):
        if name in ranks[0]:
            rounds = [max(ts) for ts in zip(*(r[name]["round_s"] for r in ranks))]
            out[name] = {"s": statistics.median(rounds), "round_max_over_ranks_s": rounds,
                         "comm_per_round": _per_step(ranks[0][name]["comm"],
                                                     ranks[0][name]["rounds_counted"])}
            for key, figure in _RAW_CPU:
                if all(key in r[name] for r in ranks):
                    cpu = [statistics.fmean(c) for c in zip(*(r[name][key] for r in ranks))]
                    out[name].update({figure: statistics.median(cpu), key: cpu})
    if "compute_paired" in ranks[0]:
        paired = [max(ts) for ts in zip(*(r["compute_paired"]["step_s"] for r in ranks))]
        out["compute_paired"] = {"s": statistics.median(paired), "step_max_over_ranks_s": paired}
    if "alternated" in ranks[0]:
        rounds = {name: [max(ts) for ts in zip(*(r["alternated"][name] for r in ranks))]
                  for name in ranks[0]["alternated"]}
        out["alternated"] = {"rounds_max_over_ranks_s": rounds,
                             "rounds_per_launch": [len(rounds["step"])]}
        out["interleaved_comm_per_step"] = _per_step(ranks[0]["interleaved_comm"], 1)
    if "ddp_bucket_bytes" in ranks[0]:
        out["ddp_bucket_bytes"] = ranks[0]["ddp_bucket_bytes"]
    return out


def pool_rounds(summaries: list[dict]) -> dict:
    """One implementation's launches of one configuration (run.py's rounds) as one: the
    measured steps of all rounds pooled (median over all of them), the highest peak, the
    raw-collective rounds of all launches pooled the same way (each launch times its own
    after its steps: pooling them keeps the floor from the same stretch of the run as the
    steps it is subtracted from); the bytes from the first launch, as every round sends the
    same."""
    if len(summaries) == 1 or any("error" in s for s in summaries):
        failed = [s for s in summaries if "error" in s]
        return failed[0] if failed else summaries[0]
    out = dict(summaries[0])
    steps = [t for s in summaries for t in s["step_max_over_ranks_s"]]
    peaks = [s["peak_mb"] for s in summaries]
    for _, name in _STEP_CPU:
        if all(f"{name}_per_step_s" in s for s in summaries):
            cpu = [t for s in summaries for t in s[f"{name}_per_step_s"]]
            out.update({f"{name}_s": statistics.median(cpu), f"{name}_per_step_s": cpu})
    for name in ("raw", "raw_reduce_scatters", "raw_same_size_all_gathers"):
        if all(name in s for s in summaries):
            out[name] = _pool_raw([s[name] for s in summaries])
    if all("compute_paired" in s for s in summaries):
        paired = [t for s in summaries for t in s["compute_paired"]["step_max_over_ranks_s"]]
        out["compute_paired"] = {"s": statistics.median(paired), "step_max_over_ranks_s": paired,
                                 "s_per_launch": [s["compute_paired"]["s"] for s in summaries]}
    if all("alternated" in s for s in summaries):
        alternated = [s["alternated"] for s in summaries]
        out["alternated"] = {
            "rounds_max_over_ranks_s": {
                name: [t for a in alternated for t in a["rounds_max_over_ranks_s"][name]]
                for name in alternated[0]["rounds_max_over_ranks_s"]},
            "rounds_per_launch": [n for a in alternated for n in a["rounds_per_launch"]]}
    out.update(step_s=statistics.median(steps), step_max_over_ranks_s=steps,
               step_s_per_round=[s["step_s"] for s in summaries],
               peak_mb=max(peaks) if all(p is not None for p in peaks) else None,
               launch_s=sum(s.get("launch_s", 0.0) for s in summaries), rounds=len(summaries))
    return out


def _pool_raw(per_launch: list[dict]) -> dict:
    """One raw-collectives figure from every launch's rounds (``s_per_launch``: each
    launch's own median, in launch order)."""
    out = dict(per_launch[0])
    rounds = [t for raw in per_launch for t in raw["round_max_over_ranks_s"]]
    out.update(s=statistics.median(rounds), round_max_over_ranks_s=rounds,
               s_per_launch=[raw["s"] for raw in per_launch])
    for key, figure in _RAW_CPU:
        if all(key in raw for raw in per_launch):
            cpu = [c for raw in per_launch for c in raw[key]]
            out.update({figure: statistics.median(cpu), key: cpu})
    return out


def _per_step(records: list[dict], steps: int) -> dict:
    """``{op: {dim: {"calls", "bytes", "wire"}}}`` per step."""
    out: dict = {}
    for rec in records:
        entry = out.setdefault(rec["op"], {}).setdefault(rec["dim"], {"calls": 0, "bytes": 0, "wire": []})
        entry["calls"] += rec["calls"] / steps
        entry["bytes"] += rec["bytes"] / steps
        if rec["wire"] not in entry["wire"]:
            entry["wire"].append(rec["wire"])
    return out


def minimum_schedule(cfg: configs.Config, impl: str) -> list[dict]:
    dims = cfg.dims
    if impl in SHARDED_IMPLS:
        replicate = cfg.mesh[0] if cfg.is_hsdp else 1
        return workload.shard_schedule(dims, cfg.mesh[-1], replicate,
                                       regather_in_backward=(cfg.reshard_after_forward
                                                             and cfg.backend == "torch"),
                                       param_dtype=cfg.param_dtype, reduce_dtype=cfg.reduce_dtype)
    if impl in ("ddp", "dp"):
        return [{"op": "all_reduce", "dim": "", "dtype": "float32",
                 "numel": workload.parameter_count(dims)}]
    return []


def derive(cfg: configs.Config, launches: dict) -> dict:
    """Per-implementation figures of one configuration (``launches``: impl -> summary)."""
    ref_name = configs.REFERENCE[cfg.backend]
    ref = launches.get(ref_name, {})
    compute = launches.get("compute", {}).get("step_s")
    compute_cpu = launches.get("compute", {}).get("step_cpu_s")
    compute_main_cpu = launches.get("compute", {}).get("step_main_cpu_s")
    raw_of = {"hp": "hp", "fsdp2": "hp", "ddp": "ddp", "dp": "dp"}
    figures = {}
    for impl, launch in launches.items():
        if "error" in launch:
            figures[impl] = {"error": launch["error"]}
            continue
        step = launch["step_s"]
        fig = {"step_s": step, "peak_mb": launch["peak_mb"]}
        rounds = launch.get("step_s_per_round")
        if rounds and len(rounds) > 1:
            # how far this run's own launches disagree: the noise any difference must beat
            fig["round_spread_pct"] = 100.0 * (max(rounds) - min(rounds)) / step
        if ref.get("step_s") and impl != ref_name:
            fig["step_vs_ref"] = step / ref["step_s"]
        if ref.get("peak_mb") and launch.get("peak_mb"):
            fig["peak_vs_ref"] = launch["peak_mb"] / ref["peak_mb"]
        if impl != "compute" and compute is not None:
            fig["compute_s"] = compute
            fig["exposed_comm_s"] = step - compute
            raw_launch = launches.get(raw_of.get(impl, ""), {}).get("raw", {})
            raw = raw_launch.get("s")
            if raw is not None:
                fig["raw_collectives_s"] = raw
                fig["overhead_s"] = step - (compute + raw)
                fig["overhead_pct"] = 100.0 * fig["overhead_s"] / step
                per_launch = raw_launch.get("s_per_launch")
                if impl == raw_of.get(impl) and rounds and per_launch and len(per_launch) == len(rounds):
                    # each launch against its own raw rounds: how far the figure itself moves
                    fig["overhead_pct_per_round"] = [100.0 * (s - compute - r) / s
                                                     for s, r in zip(rounds, per_launch)]
                paired = launch.get("compute_paired")
                if paired is not None:
                    fig["compute_paired_s"] = paired["s"]
                    fig["paired_overhead_s"] = step - (paired["s"] + raw)
                    fig["paired_overhead_pct"] = 100.0 * fig["paired_overhead_s"] / step
                    both = paired.get("s_per_launch")
                    if impl == raw_of.get(impl) and rounds and per_launch and both \
                            and len(both) == len(rounds) == len(per_launch):
                        fig["paired_overhead_pct_per_round"] = [
                            100.0 * (s - c - r) / s for s, c, r in zip(rounds, both, per_launch)]
            step_cpu, raw_cpu = launch.get("step_cpu_s"), raw_launch.get("cpu_s")
            if None not in (step_cpu, raw_cpu, compute_cpu) and step_cpu > 0:
                fig["step_cpu_s"], fig["compute_cpu_s"], fig["raw_cpu_s"] = step_cpu, compute_cpu, raw_cpu
                fig["raw_cpu_per_wall"] = raw_cpu / raw
                fig["cpu_overhead_s"] = step_cpu - (compute_cpu + raw_cpu)
                fig["cpu_overhead_pct"] = 100.0 * fig["cpu_overhead_s"] / step_cpu
                mains = (launch.get("step_main_cpu_s"), compute_main_cpu, raw_launch.get("main_cpu_s"))
                if None not in mains:
                    # the same difference for the stepping thread alone; the rest of the CPU
                    # overhead is the framework's threads (communication)
                    fig["cpu_overhead_main_s"] = mains[0] - (mains[1] + mains[2])
                    fig["cpu_overhead_threads_s"] = fig["cpu_overhead_s"] - fig["cpu_overhead_main_s"]
        if "alternated" in launch:
            fig.update(_alternated_figures(launch["alternated"]))
        if "comm_per_step" in launch:
            minimum = workload.schedule_bytes(minimum_schedule(cfg, impl))
            fig["bytes_vs_min"] = _bytes_ratio(launch["comm_per_step"], minimum)
            fig["min_bytes_per_step"] = minimum
        if ref.get("losses_rank0") and impl not in ("compute", ref_name):
            fig["loss_rel_diff_vs_ref"] = _loss_diff(launch["losses_rank0"], ref["losses_rank0"])
        figures[impl] = fig
    if cfg.backend == "mindspore" and "hp" in launches and "error" not in launches["hp"]:
        figures["hp"]["composed_reduce_scatter"] = _rs_factor(cfg, launches["hp"])
    return figures


def _alternated_figures(alternated: dict) -> dict:
    """The overhead from the alternated rounds (note "alternated overhead" at the top): per
    round the difference of that round's phases (each the max over ranks), then the median
    over every round of every launch; in % of the median alternated step. Per launch too."""
    rounds = alternated["rounds_max_over_ranks_s"]
    step, compute, raw, floor = rounds["step"], rounds["compute"], rounds["raw"], rounds["interleaved"]
    differences = {
        "alternated_overhead": [s - c - r for s, c, r in zip(step, compute, raw)],
        "interleave_cost": [f - c - r for f, c, r in zip(floor, compute, raw)],
        "library_overhead": [s - f for s, f in zip(step, floor)]}
    median = statistics.median
    fig = {"alternated_step_s": median(step), "alternated_compute_s": median(compute),
           "alternated_raw_s": median(raw), "interleaved_s": median(floor)}
    for name, values in differences.items():
        fig[f"{name}_s"] = median(values)
        fig[f"{name}_pct"] = 100.0 * fig[f"{name}_s"] / fig["alternated_step_s"]
    sizes = alternated["rounds_per_launch"]
    if len(sizes) > 1:
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        for name in ("alternated_overhead", "library_overhead"):
            fig[f"{name}_pct_per_round"] = [
                100.0 * median(differences[name][a:a + n]) / median(step[a:a + n])
                for a, n in zip(starts, sizes)]
    return fig


def _bytes_ratio(measured: dict, minimum: dict) -> dict:
    """``{op: {dim: measured / minimum}}`` over every op either side has (missing = 0)."""
    out: dict = {}
    for op in sorted(set(measured) | set(minimum)):
        for dim in sorted(set(measured.get(op, {})) | set(minimum.get(op, {}))):
            got = measured.get(op, {}).get(dim, {}).get("bytes", 0)
            need = minimum.get(op, {}).get(dim, 0)
            out.setdefault(op, {})[dim] = (got / need) if need else (None if got else 1.0)
    return out


def _loss_diff(losses: list, ref: list) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))


#: wire op of the composed reduce-scatter -> bytes a rank sends / a native (ring)
#: reduce-scatter's: a ring all-reduce is a reduce-scatter then an all-gather (2x); the
#: exchange (two ranks only; a flat all-gather on the world group, else a list one) sends
#: the half the peer owns, as a native one does (1x).
_SENT_BYTES_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "all_gather_list": 1.0}


def _rs_factor(cfg: configs.Config, hp_launch: dict) -> dict:
    """What composing the reduce-scatter costs on MindSpore CPU (benchmarks/README.md,
    "MindSpore's composed reduce-scatter")."""
    out = {"world_size": cfg.world_size, "group_size": cfg.mesh[-1]}
    rs = hp_launch.get("comm_per_step", {}).get("reduce_scatter", {}).get("shard")
    if rs:
        out["wire"] = rs["wire"]
        # bytes each rank sends against a native (ring) reduce-scatter's (n-1)/n of the input
        factors = [_SENT_BYTES_FACTOR[w] for w in rs["wire"] if w in _SENT_BYTES_FACTOR]
        if factors:
            out["sent_bytes_factor"] = max(factors)
    scat = hp_launch.get("raw_reduce_scatters", {}).get("s")
    gath = hp_launch.get("raw_same_size_all_gathers", {}).get("s")
    if scat and gath:
        out["composed_rs_s"], out["same_size_all_gather_s"] = scat, gath
        out["time_factor"] = scat / gath
    return out
