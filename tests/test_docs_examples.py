"""Every ```python block of README.md and docs/*.md runs, as written, and does what it says.

Design note
-----------
tests/docs_blocks.py finds the blocks and names each ``file#heading#index``. Every block
must be in exactly one of the tables below, so a new block fails
``test_every_python_block_is_known`` (named) until someone says how it runs:

* ``RUNS``: the block's text runs verbatim (``exec``) on real ranks, in the namespace a
  setup in tests/docs_examples_scenarios.py gives it: exactly the names the doc says the
  block needs (in the prose before it or a comment in it), with a small real model. The
  setup then checks what the block claims (training against a single-process reference,
  counts, shapes) rank-side, or returns values that a ``check`` here compares across
  ranks. Blocks run in one launch per (backend, world size), in table order, except those
  that must end the launch (``last``: the quick starts leave the process group) and those
  that need a process of their own (``alone``: reproducers of framework bugs, whose state
  they break). A launch's blocks share its processes, so a block must not depend on
  starting fresh unless it is ``alone``.
* ``SIGNATURES``: a public name's parameter list (``hp.name(params) -> result``), which is
  a specification and cannot run; it is compared with the library's signature
  (tests/docs_signatures.py), in this process.
* ``MSRUN_SCRIPTS``: a whole script the doc starts with ``msrun`` (a reproducer of a
  MindSpore bug that calls ``mindspore.communication.init()`` itself); it runs so, both
  ways the doc runs it.
* ``NOT_YET``: blocks with no run yet, each with the reason (an optional package not
  installed where the harness was written); a ``Run`` with ``needs=`` skips where its
  package is missing, as the suite's other tests of the extras do.

The launches cost most of the time (a MindSpore rank takes seconds to start): three
(torch on 2 and 4 ranks, MindSpore on 2), two single processes and two ``msrun`` jobs.
A launch runs all its blocks even where ``-k`` selects one.

Adding a block: write ``setup(backend, ctx)`` in tests/docs_examples_scenarios.py (yield the
namespace, check after the yield) and add one ``Run`` line here.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import hyper_parallel as hp
from hyper_parallel.launch import find_free_port
from tests import shared_launch
from tests.docs_blocks import all_blocks
from tests.docs_signatures import check_signature_block
from tests.multirank import RankFailure, run_ranks
from tests.tolerance import ADAMW_RTOL, FP32_RTOL, assert_close

BLOCKS = all_blocks()
BIN = Path(sys.executable).parent


def _test_id(value) -> str:
    """A -k friendly id: ``docs/api.md#State dicts#0`` -> ``api.md_State_dicts_0``."""
    return re.sub(r"[^\w.-]+", "_", str(value).replace("docs/", "")).strip("_")


@dataclass(frozen=True)
class Run:
    setup: str                       # a generator in tests/docs_examples_scenarios.py
    world: dict                      # backend -> ranks
    check: Callable | None = None    # check(per_rank_results) in this process
    last: bool = False               # leaves the process group: runs last in its launch
    alone: bool = False              # runs in a fresh process of its own
    needs: str | None = None         # an optional package; skipped without it
    after: tuple = field(default=())  # (block id, backend) whose launch must run first
    slow: bool = False               # marked slow: runs under -m slow only


def _params_match(rtol):
    def check(per_rank):
        for r in per_rank:
            assert sorted(r["params"]) == sorted(r["ref"])
            for name, value in r["params"].items():
                assert_close(value, r["ref"][name], rtol, err_msg=name)
    return check


def _losses_match(per_rank):
    """The mean of the ranks' losses (each on its equal slice) is the global batch's."""
    mean = np.mean([r["losses"] for r in per_rank], axis=0)
    assert len(mean) == len(per_rank[0]["ref_losses"]) >= 3
    assert_close(mean, per_rank[0]["ref_losses"], ADAMW_RTOL)


def _each_rank_trains(per_rank):
    """Every rank fed the whole batch: each one's losses are the one-process run's."""
    for r in per_rank:
        assert_close(r["losses"], r["ref_losses"], ADAMW_RTOL)


def _clip_matches(per_rank):
    for r in per_rank:
        assert_close(r["norm"], r["ref_norm"], FP32_RTOL)
        assert r["norm"] > 1.0, "the norm is below max_norm: the block clipped nothing"
    _params_match(FP32_RTOL)(per_rank)


def _crossed(per_rank):
    """torch's model and optimizer state after the load are MindSpore's when saved (keys in
    torch's names on both sides; MindSpore's BatchNorm statistics are parameters, torch's
    buffers)."""
    saved = _results("docs/checkpoints.md#Renaming: key_map#0", "mindspore")[0]
    for loaded in per_rank:
        compared = [k for k in loaded if not k.startswith(("buffer.", "optim.step."))]
        missing = sorted(set(compared) - set(saved))
        assert not missing, f"torch has {missing}, MindSpore saved {sorted(saved)}"
        for key in compared:
            np.testing.assert_array_equal(loaded[key], saved[key], err_msg=key)
        steps = [k for k in loaded if k.startswith("optim.step.")]
        assert steps, "torch's AdamW got no step count"
        for key in steps:  # MindSpore's one step count is torch's per parameter
            np.testing.assert_array_equal(loaded[key], saved["optim.state_step"], err_msg=key)
        for name in ("bn.running_mean", "bn.running_var"):
            np.testing.assert_array_equal(loaded[f"buffer.{name}"], saved[name], err_msg=name)


def _pipelining_matches(per_rank):
    """The last stage's mean micro-batch loss per step is the one-process loss; every
    stage's parameters are the one-process model's."""
    _losses_match([r for r in per_rank if r["stage"] == 1])
    _params_match(ADAMW_RTOL)(per_rank)


def _grows(per_rank):
    grown = per_rank[0]
    assert grown > 7e6, f"resident memory grew {grown / 1e6:.1f} MB, the doc says ~14 MB"


def _layernorm_error(per_rank):
    assert "LayerNormGrad" in per_rank[0], per_rank[0]


TORCH, MS = "torch", "mindspore"
RUNS: dict[str, Run] = {
    "README.md#Quick start: PyTorch#0":
        Run("readme_quick_start", {TORCH: 2}, _losses_match, last=True),
    "README.md#Quick start: MindSpore#0":
        Run("readme_quick_start", {MS: 2}, _losses_match, last=True),
    "docs/api.md#fully_shard#1": Run("api_expert_mesh", {TORCH: 4}),
    "docs/api.md#Deferred initialisation#0": Run("api_deferred_torch", {TORCH: 2}),
    "docs/api.md#Deferred initialisation#1": Run("api_deferred_mindspore", {MS: 2}),
    "docs/api.md#clip_grad_norm_#1": Run("api_clip_mindspore", {MS: 2}, _clip_matches),
    "docs/pipelining.md#Usage#0":
        Run("pipelining_usage", {TORCH: 2, MS: 2}, _pipelining_matches),
    "docs/api.md#Under torchtitan (torch)#0":
        Run("titan_swap", {TORCH: 1}, alone=True, needs="torchtitan"),
    "docs/checkpoints.md#Renaming: key_map#0": Run("ckpt_key_map_mindspore", {MS: 2}),
    "docs/checkpoints.md#Renaming: key_map#1":
        Run("ckpt_key_map_torch", {TORCH: 2}, _crossed,
            after=(("docs/checkpoints.md#Renaming: key_map#0", MS),)),
    # 20 000 MindSpore ops: ~23 s of CPU, so in the slow tier
    "docs/faults.md#Long runs#0":
        Run("faults_cat_memory", {MS: 1}, _grows, alone=True, slow=True),
    "docs/gradient-pipeline.md#Meshes#0":
        Run("gp_meshes", {TORCH: 4, MS: 2}, _params_match(FP32_RTOL)),
    "docs/gradient-pipeline.md#How gradients reach the user#0":
        Run("gp_optimizer_in_backward", {TORCH: 2}, _params_match(FP32_RTOL)),
    "docs/gradient-pipeline.md#Gradient accumulation#0":
        Run("gp_accumulation", {TORCH: 2}, _params_match(FP32_RTOL)),
    "docs/gradient-pipeline.md#Gradient accumulation#1":
        Run("gp_accumulation", {MS: 2}, _params_match(FP32_RTOL)),
    "docs/gradient-pipeline.md#Debugging and observability#0":
        Run("gp_track_comms", {TORCH: 4}),
    "docs/gradient-pipeline.md#Debugging and observability#1":
        Run("gp_debug_log", {TORCH: 2, MS: 2}),
    "docs/platforms.md#Known framework limits (measured)#0":
        Run("platforms_layernorm_after_error", {MS: 1}, _layernorm_error, alone=True),
    "docs/tensor-parallel.md#Usage#0": Run("tp_usage", {TORCH: 2, MS: 2}, _each_rank_trains),
    "docs/context-parallel.md#Usage#0": Run("cp_usage", {TORCH: 2, MS: 2}, _losses_match),
    # the same composition runs on MindSpore's 4 ranks in tests/test_one_script.py (dp_tp)
    "docs/tensor-parallel.md#With fully_shard#0":
        Run("tp_with_fully_shard", {TORCH: 4}, _losses_match),
    "docs/tensor-parallel.md#Checkpoints, state dicts and export#0":
        Run("tp_deferred_load", {MS: 2}),
    "docs/api.md#Tensor parallelism (torch)#0": Run("tp_torch_own", {TORCH: 4}, _losses_match),
    "docs/api.md#Code written for FSDP2 (torch)#0": Run("api_fsdp2_rebind", {TORCH: 2}),
    "docs/expert-parallel.md#The plan#0":
        Run("ep_plan", {TORCH: 2, MS: 2}, lambda per_rank: (
            _losses_match(per_rank), _params_match(FP32_RTOL)(per_rank))),
}

SIGNATURES = {
    "docs/api.md#fully_shard#0", "docs/api.md#register_fsdp_forward_method#0",
    "docs/api.md#Policies#0", "docs/api.md#init_device_mesh, DeviceMesh#0",
    "docs/api.md#init_distributed, destroy_distributed#0",
    "docs/api.md#comm_stats, track_comms, CommStats#0", "docs/api.md#State dicts#0",
    "docs/api.md#clip_grad_norm_#0", "docs/api.md#save_checkpoint, load_checkpoint#0",
    "docs/api.md#export_full#0", "docs/api.md#get_platform#0",
    "docs/checkpoints.md#Checkpoints#0",
    "docs/api.md#parallelize_module and the tensor-parallel styles#0",
    "docs/expert-parallel.md#Load balancing by router bias#0",
    "docs/api.md#ExpertParallel, update_expert_bias#0",
    "docs/api.md#context_parallel, scaled_dot_product_attention#0",
}

#: blocks that are whole scripts started by a launcher, as the doc says: id -> the test
MSRUN_SCRIPTS = {"docs/platforms.md#Pipelines on MindSpore#0"}

#: blocks with no run yet: each names what it lacks
NOT_YET = {
    "docs/api.md#Under torchtitan (torch)#1":
        "needs torchtitan (the titan extra), not installed where this harness was written",
    "docs/train-lm.md#What a run does and shows#0":
        "needs transformers (the hf extra), not installed where this harness was written",
}


# ---------------------------------------------------------------------------- launches
_DONE: dict = {}  # (backend, launch key) -> {block id: per-rank results} or the RankFailure


def _launch_key(block_id: str, backend: str):
    run = RUNS[block_id]
    return (backend, block_id) if run.alone else (backend, run.world[backend])


def _results(block_id: str, backend: str) -> list:
    """Per-rank results of ``block_id`` on ``backend``; the first read of a launch runs
    every block of it."""
    run = RUNS[block_id]
    key = _launch_key(block_id, backend)
    if key not in _DONE:
        members = [b for b, r in RUNS.items() if backend in r.world
                   and _launch_key(b, backend) == key and _available(r)]
        for member in members:
            for before in RUNS[member].after:  # the launches it reads must have run
                try:
                    _results(*before)
                except RankFailure:
                    pass  # the member fails on its own, naming it
        members.sort(key=lambda b: RUNS[b].last)  # stable: table order otherwise
        if sum(RUNS[b].last for b in members) > 1:
            raise AssertionError(f"two blocks end the process group in launch {key}")
        entries = [(b, RUNS[b].setup) for b in members]
        env = {"HP_TEST_MS_LAUNCH_BLOCKING": "1"}
        if run.alone:
            env = {"HP_TEST_NO_DIST": "1"}  # a plain process, as the doc runs it
        try:
            per_rank = run_ranks("tests.docs_examples_scenarios:run_blocks",
                                 run.world[backend], backend, entries,
                                 shared_launch.directory("docs-examples"),
                                 timeout_s=120 + 60 * len(entries), env=env)
            _DONE[key] = {b: [r[b] for r in per_rank] for b in members}
        except RankFailure as failure:
            _DONE[key] = failure
    done = _DONE[key]
    if isinstance(done, RankFailure):
        raise RankFailure(f"the launch running {block_id} failed:\n{done}")
    return done[block_id]


def _available(run: Run) -> bool:
    return run.needs is None or importlib.util.find_spec(run.needs) is not None


# ---------------------------------------------------------------------------- tests
def test_every_python_block_is_known():
    """A new block fails here, named, until a table says how it runs; so does a table
    entry whose block is gone (renamed heading)."""
    tables = [set(RUNS), SIGNATURES, set(NOT_YET), MSRUN_SCRIPTS]
    known = set().union(*tables)
    assert sum(len(t) for t in tables) == len(known), "a block is in two tables"
    unknown = sorted(set(BLOCKS) - known)
    assert not unknown, ("python blocks no test runs (add each to RUNS in "
                         f"tests/test_docs_examples.py): {unknown}")
    stale = sorted(known - set(BLOCKS))
    assert not stale, f"table entries with no such block in the docs: {stale}"


@pytest.mark.parametrize("block_id", sorted(SIGNATURES), ids=_test_id)
def test_signature_block_matches_the_library(block_id):
    assert check_signature_block(BLOCKS[block_id].code, vars(hp)) == []


def test_signature_check_finds_differences():
    """The checker is not vacuous: a wrong default, a missing, extra or misplaced name."""
    def real(a, b=1, *, c=None):
        return a, b, c

    names = {"f": real}
    assert check_signature_block("hp.f(a, b=1, *, c=None) -> x\n", names) == []
    assert check_signature_block("hp.f(a, b=2, *, c=None)\n", names)
    assert check_signature_block("hp.f(a, b=1)\n", names)
    assert check_signature_block("hp.f(a, b=1, *, c=None, d=0)\n", names)
    assert check_signature_block("hp.f(a, *, b=1, c=None)\n", names)


@pytest.mark.parametrize("block_id", sorted(NOT_YET), ids=_test_id)
def test_block_not_yet_run(block_id):
    pytest.skip(NOT_YET[block_id])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("block_id, backend",
                         [pytest.param(b, backend, marks=[pytest.mark.slow] if r.slow else [])
                          for b, r in RUNS.items() for backend in r.world],
                         ids=_test_id)
def test_block_runs_as_written(block_id, backend):
    run = RUNS[block_id]
    if not _available(run):
        pytest.skip(f"needs {run.needs} (not installed)")
    per_rank = _results(block_id, backend)
    assert len(per_rank) == run.world[backend]
    if run.check is not None:
        run.check(per_rank)


def _msrun(script: Path, *args: str, until: str | None = None, timeout: float = 240) -> tuple:
    """``msrun`` on 2 local workers, as docs/platforms.md runs the script: (exit code or None
    where ``until`` appeared in a worker's log first, the workers' logs). The launcher's
    process group is ended whatever happens (a peer of a failed rank would wait minutes)."""
    logs = script.parent / f"logs{len(args)}"
    command = [str(BIN / "msrun"), "--worker_num=2", "--local_worker_num=2",
               f"--master_port={find_free_port()}", f"--log_dir={logs}", "--join=True",
               "--cluster_time_out=60", str(script), *args]
    env = {**os.environ, "HP_BACKEND": "mindspore", "GLOG_v": "3",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}  # msrun runs "python"
    workers = [logs / f"worker_{rank}.log" for rank in range(2)]

    def read():
        return [w.read_text(errors="replace") if w.exists() else "" for w in workers]

    proc = subprocess.Popen(command, cwd=script.parent, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if until is not None and any(until in log for log in read()):
                return None, read()
            time.sleep(0.5)
        return proc.poll(), read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _processes_running(script):  # msrun starts each worker in a session
            os.kill(pid, signal.SIGKILL)        # of its own


def _processes_running(script: Path) -> list[int]:
    """Pids of the processes whose command line names ``script`` (a private temp path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(script).encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass  # ended meanwhile
    return pids


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block_id", sorted(MSRUN_SCRIPTS), ids=_test_id)
def test_msrun_script_block(block_id, tmp_path):
    """The send/recv reproducer: as written, rank 0's send raises naming the missing group;
    with an argument (the workaround) both ranks print the tensor rank 0 sent."""
    script = tmp_path / "repro.py"
    script.write_text(BLOCKS[block_id].code)
    code, workers = _msrun(script, "workaround")
    assert code == 0, "".join(workers)[-3000:]
    for rank, log in enumerate(workers):
        assert f"{rank} [1. 1. 1.]" in log, log[-2000:]
    missing = "The group hccl_world_group does not exist"
    code, workers = _msrun(script, until=missing)
    assert missing in workers[0], f"exit code {code}:\n{workers[0][-2000:]}"


def test_setups_exist():
    from tests import docs_examples_scenarios as scenarios

    for block_id, run in RUNS.items():
        assert inspect.isgeneratorfunction(getattr(scenarios, run.setup)), block_id
