"""From one launch's per-rank results to the figures of its configuration.

[Note: the figures]
* step time of a phase, per measured round: the maximum over ranks (a synchronous job runs
  at its slowest rank); the figure is the **median over rounds**, its spread the
  **interquartile range** (the 25th and 75th percentiles over rounds, inclusive method);
* ratios (hp / FSDP2, hp / DDP, hp / DP baseline, hp / interleaved floor): per round, the
  two phases' times of that round divided, then the median and IQR over rounds. A ratio
  of one round compares two steps taken seconds apart in the same processes;
* library cost = hp / interleaved floor - 1 (median over rounds): what hyper_parallel adds
  beyond the same compute and the minimal collectives placed where the step needs them,
  with no library code (raw_collectives.py). Interleave cost = floor / (compute + raw
  collectives) - 1, per round: what placing the collectives between the compute costs by
  itself, a platform figure no library can remove;
* tokens/s (decoder): the global batch's tokens (ranks x sequences x length) per median
  step;
* peak memory of a phase: per rank ``base + persistent + transient`` (measure.py, "peak
  memory"), the maximum over ranks;
* bytes per step: what rank 0 counted in one step, per collective and mesh dim, and for
  the MLP divided by the theoretical minimum of workload.py;
* loss check: the largest relative difference of rank 0's per-step losses to the
  reference's. Same weights, data and averaging, so ~1e-6 (fp32) or ~1e-2 (bf16); a large
  value means the comparison is not like for like.
"""

from __future__ import annotations

import statistics

import configs
import workload

# ratio name -> (numerator phase, denominator phase)
RATIOS = {"hp_vs_fsdp2": ("hp", "fsdp2"), "hp_vs_ddp": ("hp", "ddp"), "hp_vs_dp": ("hp", "dp"),
          "hp_vs_floor": ("hp", "floor")}


def spread(values: list) -> dict:
    """``{"median", "q1", "q3"}`` of ``values`` (inclusive quartiles; one value: all three)."""
    if len(values) == 1:
        return {"median": values[0], "q1": values[0], "q3": values[0]}
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": median, "q1": q1, "q3": q3}


def minimum_schedule(cfg: configs.Config) -> list[dict]:
    """The minimal collectives of one sharded step of the MLP (empty for the decoder)."""
    if cfg.is_lm:
        return []
    replicate = cfg.mesh[0] if cfg.is_hsdp else 1
    return workload.shard_schedule(cfg.dims, cfg.mesh[-1], replicate,
                                   regather_in_backward=cfg.reshard_after_forward,
                                   usage_counts=cfg.backend == "torch",
                                   param_dtype=cfg.param_dtype, reduce_dtype="float32")


def derive(cfg: configs.Config, ranks: list[dict]) -> dict:
    """The figures of one configuration from its ranks' results (index = rank)."""
    rounds = {name: [max(ts) for ts in zip(*(r["times"][name] for r in ranks))]
              for name in ranks[0]["times"]}
    tokens = cfg.tokens_per_step
    phases = {}
    for name, times in rounds.items():
        fig = {"step": spread(times), "rounds_s": times}
        peaks = [_peak(r, name) for r in ranks]
        fig["peak_mb"] = max(peaks) if None not in peaks else None
        fig["peak_mb_per_rank"] = peaks
        if tokens and name not in ("raw",):
            fig["tokens_per_s"] = tokens / fig["step"]["median"]
        fig["cpu_s"] = statistics.median(
            statistics.fmean(c) for c in zip(*(r["cpu"][name] for r in ranks)))
        phases[name] = fig
    ratios = {key: _ratio(rounds[a], rounds[b]) for key, (a, b) in RATIOS.items()
              if a in rounds and b in rounds}
    out = {"phases": phases, "ratios": ratios, "order": ranks[0]["order"],
           "setup_s": {name: max(r["setup_s"][name] for r in ranks) for name in rounds}}
    ref = configs.REFERENCE[cfg.backend]
    if ref in phases and phases[ref]["peak_mb"] and phases.get("hp", {}).get("peak_mb"):
        out["peak_hp_vs_ref"] = phases["hp"]["peak_mb"] / phases[ref]["peak_mb"]
    if "floor" in rounds and "hp" in rounds:
        out["library_cost_pct"] = {k: 100.0 * (v - 1.0) for k, v in ratios["hp_vs_floor"].items()
                                   if k in ("median", "q1", "q3")}
    if {"floor", "compute", "raw"} <= set(rounds):
        out["interleave_cost_pct"] = spread(
            [100.0 * (f / (c + r) - 1.0) for f, c, r in
             zip(rounds["floor"], rounds["compute"], rounds["raw"])])
    out["comm"] = {name: _per_step(rows) for name, rows in ranks[0]["comm"].items()}
    out["comm_same_on_all_ranks"] = all(r["comm"] == ranks[0]["comm"] for r in ranks)
    minimum = workload.schedule_bytes(minimum_schedule(cfg))
    if minimum:
        out["min_bytes_per_step"] = minimum
        out["bytes_vs_min"] = {name: _bytes_ratio(per_step, minimum)
                               for name, per_step in out["comm"].items()}
    losses = ranks[0]["losses"]
    out["loss_rel_diff_vs_ref"] = {
        name: _loss_diff(losses[name], losses[ref]) for name in losses
        if ref in losses and name in ("hp", "fsdp2", "ddp", "dp") and name != ref}
    return out


def _ratio(numerator: list, denominator: list) -> dict:
    per_round = [a / b for a, b in zip(numerator, denominator)]
    return {**spread(per_round), "rounds": per_round}


def _peak(rank: dict, name: str) -> float | None:
    parts = (rank["base_mb"], rank["persistent_mb"][name], rank["transient_mb"][name])
    return None if None in parts else sum(parts)


def _per_step(records: list[dict]) -> dict:
    """``{op: {dim: {"calls", "bytes", "wire"}}}`` of one counted step."""
    out: dict = {}
    for rec in records:
        entry = out.setdefault(rec["op"], {}).setdefault(rec["dim"], {"calls": 0, "bytes": 0, "wire": []})
        entry["calls"] += rec["calls"]
        entry["bytes"] += rec["bytes"]
        if rec["wire"] not in entry["wire"]:
            entry["wire"].append(rec["wire"])
    return out


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
