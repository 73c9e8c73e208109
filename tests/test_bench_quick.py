"""`make bench --quick` runs end to end (a smoke test that the benchmark works, not a timing).

Two rounds per backend are the fewest that still show the alternation (A B, then B A)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_parallel.launch import CAN_BIND_CORES, core_slices

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 2


@pytest.mark.timeout(420)
def test_quick_benchmark_runs_and_reports(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick",
               "--rounds", str(ROUNDS), "--out", str(tmp_path)]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = list(tmp_path.glob("*.json"))
    assert results, f"no JSON written in {tmp_path}: {proc.stdout[-2000:]}"
    data = json.loads(results[0].read_text())
    assert data, "the results file is empty"
    assert "|" in proc.stdout, "no markdown table printed"
    assert data["environment"]["bind_cores"] is CAN_BIND_CORES  # bound wherever the OS can
    for row in data["configurations"]:
        cfg, launches = row["config"], row["launches"]
        for impl, launch in launches.items():  # every launch bound rank r to its own slice
            if CAN_BIND_CORES:
                assert launch["cores_per_rank"] == [sorted(c) for c in core_slices(cfg["world_size"])], impl
        ref = "fsdp2" if cfg["backend"] == "torch" else "dp"
        rounds = ROUNDS
        assert data["rounds"][cfg["backend"]] == rounds
        for impl in ("hp", ref, "compute"):
            # the backend's rounds pooled: every measured step of every launch
            assert launches[impl]["rounds"] == rounds, (cfg["name"], impl)
            assert len(launches[impl]["step_max_over_ranks_s"]) == rounds * cfg["steps"]
            assert row["launch_order"].count(impl) == rounds, (cfg["name"], impl)
        # hyper_parallel and its reference back to back, the order flipped each round (A B B
        # A ...); compute-only closes every round
        pairs = [x for x in row["launch_order"] if x in ("hp", ref)]
        pairs = [pairs[i:i + 2] for i in range(0, len(pairs), 2)]
        assert all(later == earlier[::-1] for earlier, later in zip(pairs, pairs[1:])), row["launch_order"]
        assert row["launch_order"][-1] == "compute"
        # CPU figures: pooled over the rounds, and the overhead is their difference
        hp = row["figures"]["hp"]
        assert len(launches["hp"]["step_cpu_per_step_s"]) == rounds * cfg["steps"]
        assert hp["step_cpu_s"] > 0 and hp["raw_cpu_s"] > 0 and hp["compute_cpu_s"] > 0
        assert abs(hp["cpu_overhead_s"] - (hp["step_cpu_s"] - hp["compute_cpu_s"] - hp["raw_cpu_s"])) < 1e-9
        # ... split into the stepping thread's part and the other threads' (they add up)
        main = launches["hp"]["step_main_cpu_s"]
        assert 0 < main <= hp["step_cpu_s"] and len(launches["hp"]["step_main_cpu_per_step_s"]) == rounds * cfg["steps"]
        assert hp["cpu_overhead_main_s"] == main - (launches["compute"]["step_main_cpu_s"]
                                                    + launches["hp"]["raw"]["main_cpu_s"])
        assert abs(hp["cpu_overhead_main_s"] + hp["cpu_overhead_threads_s"] - hp["cpu_overhead_s"]) < 1e-9
        per_round = launches["hp"]["step_s_per_round"]
        assert hp["round_spread_pct"] == 100.0 * (max(per_round) - min(per_round)) / hp["step_s"]
        # raw collectives: every launch's rounds pooled, each launch's overhead on its own
        raw = launches["hp"]["raw"]
        assert len(raw["s_per_launch"]) == rounds and len(raw["round_max_over_ranks_s"]) == rounds * cfg["steps"]
        assert len(raw["round_cpu_s"]) == rounds * cfg["steps"]
        assert hp["raw_collectives_s"] == raw["s"] == statistics.median(raw["round_max_over_ranks_s"])
        assert hp["overhead_pct_per_round"] == [
            100.0 * (s - hp["compute_s"] - r) / s for s, r in zip(per_round, raw["s_per_launch"])]
        # compute-only stepped again at the end of every distributed launch, pooled; the paired
        # overhead subtracts it instead, launch by launch too
        paired = launches["hp"]["compute_paired"]
        assert len(paired["s_per_launch"]) == rounds
        assert len(paired["step_max_over_ranks_s"]) == rounds * cfg["steps"]
        assert hp["compute_paired_s"] == paired["s"] == statistics.median(paired["step_max_over_ranks_s"])
        assert hp["paired_overhead_s"] == hp["step_s"] - (paired["s"] + raw["s"])
        assert hp["paired_overhead_pct_per_round"] == [
            100.0 * (s - c - r) / s for s, c, r in zip(per_round, paired["s_per_launch"], raw["s_per_launch"])]
        assert "compute_paired" in launches[ref] and "compute_paired" not in launches["compute"]
        # the alternated rounds: hp's step, compute-only, the interleaved floor (the plain
        # model with the minimal schedule hooked in, sending exactly what the step sends) and
        # the raw collectives, round by round in every hp launch, pooled
        alternated = launches["hp"]["alternated"]
        times = alternated["rounds_max_over_ranks_s"]
        assert alternated["rounds_per_launch"] == [cfg["steps"]] * rounds
        assert sorted(times) == ["compute", "interleaved", "raw", "step"]
        assert all(len(v) == rounds * cfg["steps"] for v in times.values())
        assert launches["hp"]["interleaved_comm_per_step"] == launches["hp"]["comm_per_step"]
        med = statistics.median
        assert hp["interleaved_s"] == med(times["interleaved"])
        assert hp["alternated_overhead_s"] == med(
            [s - c - r for s, c, r in zip(times["step"], times["compute"], times["raw"])])
        assert hp["library_overhead_s"] == med([s - f for s, f in zip(times["step"], times["interleaved"])])
        assert hp["interleave_cost_s"] == med(
            [f - c - r for f, c, r in zip(times["interleaved"], times["compute"], times["raw"])])
        n = cfg["steps"]
        assert hp["library_overhead_pct_per_round"] == [
            100.0 * med([s - f for s, f in zip(times["step"][k:k + n], times["interleaved"][k:k + n])])
            / med(times["step"][k:k + n]) for k in range(0, rounds * n, n)]
        assert "alternated" not in launches[ref] and "library_overhead_s" not in row["figures"][ref]
        if ref == "fsdp2":  # FSDP2 borrows hp's floor: no launch of its own to pair with
            assert "overhead_pct_per_round" not in row["figures"][ref]
            assert "paired_overhead_pct_per_round" not in row["figures"][ref]
        else:  # the DP baseline times its own all-reduce in each of its launches
            assert len(row["figures"][ref]["overhead_pct_per_round"]) == rounds
            # the composed reduce-scatter is reported as what went on the wire: over a
            # two-rank shard group that is the world, the exchange by the flat all-gather,
            # which sends what a native one sends
            composed = hp["composed_reduce_scatter"]
            assert cfg["mesh"] == [2] and cfg["world_size"] == 2 and composed["group_size"] == 2
            assert composed["wire"] == ["all_gather"] and composed["sent_bytes_factor"] == 1.0
            assert composed["time_factor"] == composed["composed_rs_s"] / composed["same_size_all_gather_s"]
