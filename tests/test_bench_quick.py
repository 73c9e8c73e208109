"""`make bench --quick` runs end to end (a smoke test that the benchmark works, not a timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(420)
def test_quick_benchmark_runs_and_reports(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = list(tmp_path.glob("*.json"))
    assert results, f"no JSON written in {tmp_path}: {proc.stdout[-2000:]}"
    data = json.loads(results[0].read_text())
    assert data, "the results file is empty"
    assert "|" in proc.stdout, "no markdown table printed"
