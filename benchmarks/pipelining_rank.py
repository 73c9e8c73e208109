"""One rank of the pipelining benchmark (pipelining.py), 4 ranks, one framework.

A stack of ``blocks`` MLP blocks (the same shapes and values on both frameworks, the
tests' model kit) is trained three ways in the same processes, each on the same global
batch with SGD: ``fsdp4`` (fully_shard over the 4 ranks), and ``gpipe``/``1f1b``
(hp.pipelining at pp 2 x dp 2, half the blocks per stage, each block and stage a unit over
dp). Steps alternate between the three, the order reversed every round. Per step the rank
records its time, and under a pipeline the seconds it spent waiting for a stage's message
(``wait()`` of each receive, wrapped here): the bubble as this rank sees it. After the
measured rounds each pipeline runs one more step with the process's peak resident set
reset first (``/proc/self/clear_refs``), which gives the peak of that step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import hyper_parallel as hp  # noqa: E402
from benchmarks.measure import _reset_peak, _status_mb, rank_main  # noqa: E402
from tests.kit import get_kit  # noqa: E402


def _stack(kit, job, blocks: list):
    width = job["width"]
    stack = kit.Stack([kit.Block(width, job["hidden"], width) for _ in blocks],
                      kit.linear(width, width))
    kit.load(stack, blocks[0])
    return stack


def _waits(platform) -> list:
    """Seconds spent in receives' ``wait()``, accumulated in the returned one-item list."""
    waited, recv = [0.0], platform.recv

    def timed_recv(*args, **kwargs):
        handle, wait = recv(*args, **kwargs), None
        wait = handle.wait

        def timed_wait():
            tick = time.perf_counter()
            try:
                return wait()
            finally:
                waited[0] += time.perf_counter() - tick
        handle.wait = timed_wait
        return handle

    platform.recv = timed_recv
    return waited


def run(job: dict, rank: int, world: int) -> dict:
    hp.init_distributed()
    kit, platform = get_kit(), hp.get_platform()
    half = job["blocks"] // 2
    flat = hp.init_device_mesh(platform.device_type(), (4,), mesh_dim_names=("dp",))
    mesh = hp.init_device_mesh(platform.device_type(), (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((job["batch"], job["width"])).astype(np.float32),
                rng.standard_normal((job["batch"], job["width"])).astype(np.float32))
               for _ in range(job["warmup"] + job["rounds"] + 2)]

    whole = _stack(kit, job, list(range(job["blocks"])))
    for block in whole.blocks:
        hp.fully_shard(block, mesh=flat)
    hp.fully_shard(whole, mesh=flat)
    whole_opt = kit.optimizer(kit.params(whole), lr=0.01)

    def mse(out, target):
        return ((out - target) ** 2).mean()

    pipelines = {}
    for name, cls in (("gpipe", hp.pipelining.ScheduleGPipe),
                      ("1f1b", hp.pipelining.Schedule1F1B)):
        blocks = list(range(pp_rank * half, (pp_rank + 1) * half))
        module = _stack(kit, job, blocks)
        for block in module.blocks:
            hp.fully_shard(block, mesh=mesh["dp"])
        hp.fully_shard(module, mesh=mesh["dp"])
        stage = hp.pipelining.PipelineStage(module, pp_rank, 2, platform.device_type(),
                                            group=mesh["pp"])
        pipelines[name] = (stage, cls(stage, job["microbatches"], loss_fn=mse),
                           kit.optimizer([p for p in kit.params(module) if p.requires_grad],
                                         lr=0.01))
    waited = _waits(platform)

    def step(name: str, k: int) -> float:
        x, y = batches[k]
        if name == "fsdp4":
            rows = slice(rank * len(x) // 4, (rank + 1) * len(x) // 4)
            return kit.train_step(whole, whole_opt, x[rows], y[rows])
        stage, schedule, opt = pipelines[name]
        rows = slice(dp_rank * len(x) // 2, (dp_rank + 1) * len(x) // 2)
        if stage.is_first:
            schedule.step(kit.tensor(x[rows]))
        else:
            schedule.step(target=kit.tensor(y[rows]))
        if kit.name == "torch":
            opt.step()
            opt.zero_grad()
        else:
            opt(tuple(stage.gradients()))
        return 0.0

    out = {"step_s": {n: [] for n in ("fsdp4", "gpipe", "1f1b")},
           "wait_s": {n: [] for n in ("gpipe", "1f1b")}, "peak_mb": {}}
    order = ["fsdp4", "gpipe", "1f1b"]
    for k in range(job["warmup"] + job["rounds"]):
        for name in order:
            platform.barrier()
            before, tick = waited[0], time.perf_counter()
            step(name, k)
            if k >= job["warmup"]:
                out["step_s"][name].append(time.perf_counter() - tick)
                if name != "fsdp4":
                    out["wait_s"][name].append(waited[0] - before)
        order.reverse()
    for name in ("gpipe", "1f1b"):
        platform.barrier()
        if _reset_peak():
            step(name, job["warmup"] + job["rounds"])
            out["peak_mb"][name] = _status_mb("VmHWM")
    out["pp_rank"] = pp_rank
    hp.destroy_distributed()
    return out


if __name__ == "__main__":
    rank_main(run)
