"""One rank of a step-memory launch (step_memory.py): what a training step adds to memory.

The model is ``blocks`` × (Linear(dim, dim) + ReLU) in fp32, trained with plain SGD (no
optimizer state) on a local batch of ``batch`` rows: either unsharded on each rank alone
("plain", no communication at all) or with ``fully_shard`` on every block and the root
("sharded"). The resident size is read after the model and optimizer are built (freed heap
pages handed back first), the high-water mark is reset, ``steps`` steps run, and the
high-water mark above that reading is what the steps added: gradients, activations, full
parameters, communication buffers, and whatever the framework's allocator kept of them.
The driver runs with ``MALLOC_MMAP_THRESHOLD_`` low, so that memory glibc frees leaves the
resident size at once. For the sharded model it also records the bytes held by full
parameters at the end of each forward (every unit's, as the root's forward ends).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measure import _reset_peak, _status_mb, rank_main, trimmed_resident_mb  # noqa: E402
import hyper_parallel as hp  # noqa: E402


def _held_bytes(model, platform) -> int:
    """Bytes of the memory behind every unit's current full parameters (0 once released)."""
    total = 0
    for _, module in platform.named_modules(model):
        state = module.__dict__.get("_hp_state")
        full = getattr(state, "_full", None)
        for tensor in full.tensors if full is not None else ():
            total += tensor.untyped_storage().nbytes()
    return total


def _torch_step(job: dict):
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(job["dim"], job["dim"]), nn.ReLU())
                            for _ in range(job["blocks"])])
    if job["mode"] == "sharded":
        for block in model:
            hp.fully_shard(block)
        hp.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(job["batch"], job["dim"])

    def step():
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    return model, step


def _mindspore_step(job: dict):
    import numpy as np
    import mindspore as ms
    from mindspore import nn

    if job["ms_pipeline"] == "blocking":  # as every MindSpore phase of run.py
        ms.runtime.launch_blocking()

    blocks = [nn.SequentialCell(nn.Dense(job["dim"], job["dim"]), nn.ReLU())
              for _ in range(job["blocks"])]
    model = nn.SequentialCell(*blocks)
    if job["mode"] == "sharded":
        for block in blocks:
            hp.fully_shard(block)
        hp.fully_shard(model)
    opt = nn.SGD(model.trainable_params(), learning_rate=1e-3)
    x = ms.Tensor(np.random.default_rng(0).standard_normal(
        (job["batch"], job["dim"])).astype(np.float32))
    grad_fn = ms.value_and_grad(lambda: model(x).square().mean(), None, opt.parameters)

    def step():
        loss, grads = grad_fn()
        opt(grads)
        return float(loss.asnumpy())  # waits for the step's kernels

    return model, step


def run(job: dict, rank: int, world: int) -> dict:
    hp.init_distributed()
    platform = hp.get_platform()
    model, step = (_torch_step if job["backend"] == "torch" else _mindspore_step)(job)
    held = []
    if job["mode"] == "sharded":
        def record_held(*_):
            held.append(_held_bytes(model, platform))
        if job["backend"] == "torch":
            model.register_forward_hook(record_held)
        else:
            model.register_forward_hook(lambda cell, args, out: record_held())
    before = trimmed_resident_mb()
    _reset_peak()
    times, losses = [], []
    for _ in range(job["steps"]):
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
    peak = _status_mb("VmHWM")
    hp.destroy_distributed()
    return {"before_mb": before, "peak_mb": peak, "step_added_mb": peak - before,
            "step_s": times, "losses": losses, "held_after_forward": held}


if __name__ == "__main__":
    rank_main(run)
