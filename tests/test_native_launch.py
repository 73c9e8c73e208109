"""Users who start jobs the framework's own way (torchrun, msrun) get the same results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.launch import find_free_port
from tests.tolerance import FP32_RTOL, assert_close

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "native_launch_script.py"
BIN = Path(sys.executable).parent


def _run(command, backend, cwd, timeout=240):
    """Run a launcher; whatever happens, end it and every rank that recorded its pid."""
    pid_dir, result_dir = Path(cwd) / "pids", Path(cwd) / "results"
    pid_dir.mkdir()
    result_dir.mkdir()
    # msrun runs "python SCRIPT": the venv's python must come first on PATH
    env = {**os.environ, "HP_BACKEND": backend, "PYTHONPATH": str(REPO), "GLOG_v": "3",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "HP_TEST_PID_DIR": str(pid_dir), "HP_TEST_RESULT_DIR": str(result_dir)}
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid_file in pid_dir.iterdir():
            try:
                os.kill(int(pid_file.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    return proc.returncode, output


def _results(cwd):
    found = [json.loads(p.read_text()) for p in (Path(cwd) / "results").glob("rank*.json")]
    return sorted(found, key=lambda r: r["rank"])


def _assert_parity(results, world):
    assert [r["rank"] for r in results] == list(range(world))
    assert all(r["world"] == world for r in results)
    mean = np.mean([r["losses"] for r in results], axis=0)
    assert_close(mean, results[0]["ref_losses"], FP32_RTOL)
    assert max(r["param_diff"] for r in results) <= FP32_RTOL


@pytest.mark.timeout(300)
def test_torchrun_with_torch_own_init(tmp_path):
    code, output = _run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(SCRIPT)],
                        "torch", tmp_path)
    assert code == 0, output[-3000:]
    _assert_parity(_results(tmp_path), 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hp_init", [False, True], ids=["mindspore_init", "hp_init_distributed"])
def test_msrun_with_mindspore_launcher(tmp_path, hp_init):
    port = find_free_port()
    command = [str(BIN / "msrun"), "--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1",
               f"--master_port={port}", f"--log_dir={tmp_path / 'logs'}", "--join=True",
               "--cluster_time_out=90", str(SCRIPT)] + (["--hp-init"] if hp_init else [])
    code, output = _run(command, "mindspore", tmp_path)
    logs = "".join(p.read_text(errors="replace") for p in sorted((tmp_path / "logs").glob("worker_*.log")))
    assert code == 0, (output + logs)[-3000:]
    _assert_parity(_results(tmp_path), 2)
