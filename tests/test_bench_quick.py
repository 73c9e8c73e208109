"""`benchmarks/run.py --quick` runs end to end on both backends, and its report holds together.

The quick grid is the benchmark's smallest configurations (tiny MLP and decoder on torch,
tiny MLP on MindSpore, 1 + 2 alternated rounds; tensor parallelism against FSDP on the tiny
language model, 4 ranks, both frameworks, 2 rounds): it tests that every launch, phase, figure,
table and file is produced, and that every figure is computed from the measured rounds,
not that anything is fast."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_parallel.launch import CAN_BIND_CORES, core_slices

pytest.importorskip("mindspore")  # the quick grid runs both frameworks
pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import configs  # noqa: E402


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout, json.loads((out / "quick.json").read_text()), out


def _spread_of(values):
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": median, "q1": q1, "q3": q3}


@pytest.mark.timeout(270)
def test_every_configuration_and_phase_is_reported(quick_run):
    stdout, doc, out = quick_run
    expected = configs.build_grid("quick")
    assert {cfg.backend for cfg in expected} == {"torch", "mindspore"}
    assert [row["config"]["name"] for row in doc["configurations"]] == [c.name for c in expected]
    assert doc["date"] and doc["environment"]["bind_cores"] is CAN_BIND_CORES
    headline = stdout.split("\n\n")[1]  # after the progress lines
    for cfg, row in zip(expected, doc["configurations"]):
        assert "error" not in row, row.get("error")
        assert f"| {cfg.name} |" in headline
        assert sorted(row["figures"]["phases"]) == sorted(cfg.impls)
        if CAN_BIND_CORES:  # local rank r bound to its own slice of the cores
            assert row["cores_per_rank"] == [sorted(c) for c in core_slices(cfg.world_size)]
    assert (out / "quick.png").exists() or "PNG skipped" in stdout


@pytest.mark.timeout(270)
def test_figures_are_computed_from_the_measured_rounds(quick_run):
    _, doc, _ = quick_run
    for cfg, row in zip(configs.build_grid("quick"), doc["configurations"]):
        figs = row["figures"]
        phases, ratios = figs["phases"], figs["ratios"]
        # the alternation: every measured round reverses the one before (A B C, C B A, ...)
        assert len(figs["order"]) == cfg.rounds
        assert all(later == earlier[::-1] for earlier, later in zip(figs["order"], figs["order"][1:]))
        assert sorted(figs["order"][0]) == sorted(cfg.impls)
        for name, phase in phases.items():
            rounds = phase["rounds_s"]
            assert len(rounds) == cfg.rounds and all(t > 0 for t in rounds), name
            assert phase["step"] == _spread_of(rounds)
            assert phase["step"]["q1"] <= phase["step"]["median"] <= phase["step"]["q3"]
            assert phase["peak_mb"] == max(phase["peak_mb_per_rank"])
            if cfg.is_lm:
                assert phase["tokens_per_s"] == cfg.tokens_per_step / phase["step"]["median"]
        ref = configs.REFERENCE[cfg.backend]
        for key, (a, b) in {"hp_vs_" + ref: ("hp", ref), "hp_vs_ddp": ("hp", "ddp"),
                            "hp_vs_floor": ("hp", "floor")}.items():
            if b not in phases:
                assert key not in ratios
                continue
            per_round = [x / y for x, y in zip(phases[a]["rounds_s"], phases[b]["rounds_s"])]
            assert ratios[key]["rounds"] == per_round
            assert {k: ratios[key][k] for k in ("median", "q1", "q3")} == _spread_of(per_round)
        assert figs["peak_hp_vs_ref"] == phases["hp"]["peak_mb"] / phases[ref]["peak_mb"]
        if "floor" in phases:
            assert figs["library_cost_pct"] == {
                k: 100.0 * (ratios["hp_vs_floor"][k] - 1.0) for k in ("median", "q1", "q3")}
            parts = [100.0 * (f / (c + r) - 1.0) for f, c, r in zip(
                phases["floor"]["rounds_s"], phases["compute"]["rounds_s"], phases["raw"]["rounds_s"])]
            assert figs["interleave_cost_pct"] == _spread_of(parts)
            # the floor sends exactly what the library's step sends, the minimum
            assert figs["comm"]["floor"] == figs["comm"]["hp"]
        if not cfg.is_lm:
            assert all(v == 1.0 for per_dim in figs["bytes_vs_min"]["hp"].values()
                       for v in per_dim.values()), figs["bytes_vs_min"]
        # same weights, data and averaging: the implementations train alike
        assert figs["loss_rel_diff_vs_ref"]["hp"] < 1e-4


@pytest.mark.timeout(270)
def test_tensor_parallelism_is_measured_on_both_frameworks(quick_run):
    import tensor_parallel

    stdout, doc, _ = quick_run
    result = doc["tensor_parallel"]
    assert "error" not in result, result.get("error")
    assert sorted(result["backends"]) == ["mindspore", "torch"]
    assert "tp bytes/step measured / implied" in stdout
    implied = tensor_parallel.implied_comm(result["size"], result["batch"], result["seq"])
    for backend, figures in result["backends"].items():
        # the collectives one step moves are the ones the plan implies, call for call
        assert figures["tp_comm"] == implied, (backend, figures["tp_comm"], implied)
        # the split layers' state halves at tp2; the replicated norms' does not
        assert figures["tp2_vs_tp1_bytes"]["split"] == 0.5, backend
        assert figures["tp2_vs_tp1_bytes"]["rest"] == 1.0, backend
        step = figures["step_s"]
        assert all(step[kind]["q1"] <= step[kind]["median"] <= step[kind]["q3"]
                   for kind in ("fsdp4", "tp2"))
        assert figures["tp2_vs_fsdp4"]["median"] > 0
