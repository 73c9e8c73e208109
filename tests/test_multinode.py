"""Scale-out: a 2-node job on one machine, each "node" its own launcher process on localhost,
HSDP with the replicate dim across the nodes and the shard dim within each
(tests/multinode_script.py), in parity with the single-process reference.

hp-run (``--nnodes 2 --node-rank {0,1}``) on both frameworks, and torch's own multi-node
launcher, torchrun (``--nnodes 2 --node-rank``, static rendezvous). msrun's is skipped: on
one machine both of its processes start the scheduler. 2 ranks per node, 4 in all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.tolerance import FP32_RTOL, assert_close

from hyper_parallel.launch import find_free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "tests" / "multinode_script.py")
BIN = Path(sys.executable).parent
NODES, PER_NODE = 2, 2
TIMEOUT_S = 240


def _env(backend: str, tmp: Path) -> dict:
    env = {**os.environ, "HP_BACKEND": backend, "GLOG_v": "3",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           # msrun runs "python SCRIPT": the venv's python must come first on PATH
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "HP_TEST_PID_DIR": str(tmp / "pids"), "HP_TEST_RESULT_DIR": str(tmp / "results"),
           "OMP_NUM_THREADS": "1"}
    if backend == "mindspore" and NODES * PER_NODE > (os.cpu_count() or 1):
        env["HP_TEST_MS_LAUNCH_BLOCKING"] = "1"  # see tests/multirank.py
    return env


def _launch(commands: list, backend: str, tmp: Path) -> list:
    """Start one launcher per node, wait for all; end every launcher group and every rank
    that recorded its pid, whatever happened. Returns [(exit code, output)] per node."""
    (tmp / "pids").mkdir()
    (tmp / "results").mkdir()
    logs = [open(tmp / f"node{i}.log", "w+") for i in range(len(commands))]
    procs = [subprocess.Popen(c, cwd=tmp, env=_env(backend, tmp), stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
             for c, log in zip(commands, logs)]
    try:
        for proc in procs:
            proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid_file in (tmp / "pids").iterdir():
            try:
                os.kill(int(pid_file.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return [(proc.returncode, out) for proc, out in zip(procs, outputs)]


def _assert_hsdp_parity(tmp: Path, ended: list, extra_logs: str = "") -> None:
    output = "".join(out for _, out in ended) + extra_logs
    assert all(code == 0 for code, _ in ended), output[-4000:]
    results = sorted((json.loads(p.read_text()) for p in (tmp / "results").glob("rank*.json")),
                     key=lambda r: r["rank"])
    world = NODES * PER_NODE
    assert [r["rank"] for r in results] == list(range(world)), output[-4000:]
    # node n holds global ranks [n * PER_NODE, (n + 1) * PER_NODE): the (replicate, shard)
    # mesh's rows, so shard groups lie within a node and replicate groups across nodes
    assert [r["node"] for r in results] == [r // PER_NODE for r in range(world)]
    comms = {(op, dim) for op, dim, _ in results[0]["comms"]}
    assert {("all_gather", "shard"), ("reduce_scatter", "shard"),
            ("all_reduce", "replicate")} <= comms, comms
    mean = np.mean([r["losses"] for r in results], axis=0)
    assert_close(mean, results[0]["ref_losses"], FP32_RTOL)
    assert max(r["param_diff"] for r in results) <= FP32_RTOL


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_hp_run_two_nodes_hsdp_across_nodes(tmp_path, backend):
    port = find_free_port()
    commands = [[sys.executable, "-m", "hyper_parallel.launch", "--nproc", str(PER_NODE),
                 "--nnodes", str(NODES), "--node-rank", str(node), "--master-port", str(port),
                 "--backend", backend, SCRIPT, str(node), str(NODES)] for node in range(NODES)]
    _assert_hsdp_parity(tmp_path, _launch(commands, backend, tmp_path))


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_torchrun_two_nodes_hsdp_across_nodes(tmp_path):
    port = find_free_port()
    commands = [[str(BIN / "torchrun"), f"--nnodes={NODES}", f"--node-rank={node}",
                 f"--nproc-per-node={PER_NODE}", "--master-addr=127.0.0.1",
                 f"--master-port={port}", SCRIPT, str(node), str(NODES)]
                for node in range(NODES)]
    _assert_hsdp_parity(tmp_path, _launch(commands, "torch", tmp_path))


@pytest.mark.skip(reason="msrun cannot run two nodes on one machine: each msrun starts the "
                  "scheduler when --master_addr is one of its own addresses (mindspore's "
                  "_is_local_ip), so both bind --master_port; hp-run covers MindSpore above")
def test_msrun_two_nodes_hsdp_across_nodes():
    """On two real hosts: msrun --worker_num=4 --local_worker_num=2 --node_rank={0,1}
    --master_addr=<node 0> (docs/faults.md, "Multi-node launch")."""
