"""Rank-side scenario of test_soak.py: a long run on a tiny model, for both frameworks.

The nested model (tests/scenarios.py) trains with AdamW (whose state the checkpoint keeps)
for ``steps`` steps, saving a checkpoint half-way (hp.save_checkpoint) and sampling this
process's resident memory, threads, open file descriptors and live Python objects every
``every`` steps.
Then a second model, initialised differently, loads that checkpoint and runs the second
half on the same batches: its final parameters must equal the first run's.
"""

from __future__ import annotations

import collections
import gc
import os

import numpy as np

import hyper_parallel as hp
from tests.kit import get_kit, make_batches
from tests.scenarios import D_IN, D_OUT, GLOBAL_BATCH, _build, _wrap


def resources(records: list) -> dict:
    """This process's resident memory (bytes), threads, open file descriptors and live
    Python objects (after a collection) by type name, now, not counting the sampler's own
    ``records``. A tensor or graph kept alive across steps is a live Python object on both
    frameworks; memory a framework keeps in native code is seen only in resident memory."""
    gc.collect()
    own = {id(record) for record in records}
    objects = collections.Counter(type(obj).__name__ for obj in gc.get_objects()
                                  if id(obj) not in own)
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines()
                  if ":" in line)
    return {"rss": int(status["VmRSS"].split()[0]) * 1024, "threads": int(status["Threads"]),
            "fds": len(os.listdir("/proc/self/fd")), "objects": dict(objects)}


def run_soak(steps: int, every: int, checkpoint_dir: str) -> dict:
    kit = get_kit()
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    local = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    batches = make_batches(steps, GLOBAL_BATCH, D_IN, D_OUT, seed=5)

    def model_and_optimizer(seed):
        model = _build(kit, "nested")
        kit.load(model, seed)
        _wrap(kit, model, "nested")
        return model, kit.optimizer(kit.params(model), lr=0.01, kind="adamw")

    def train(model, opt, first: int, sample: bool) -> list:
        samples = []
        for step in range(first, steps):
            x, y = batches[step]
            kit.train_step(model, opt, x[local], y[local])
            if step + 1 == steps // 2 and first == 0:
                hp.save_checkpoint(checkpoint_dir, model, opt, extra={"step": step + 1})
            if sample and (step + 1) % every == 0:
                samples.append({"step": step + 1, **resources(samples)})
        return samples

    model, opt = model_and_optimizer(0)
    samples = train(model, opt, 0, sample=True)
    final = hp.gather_full_state_dict(model)
    resumed, resumed_opt = model_and_optimizer(1)
    extra = hp.load_checkpoint(checkpoint_dir, resumed, resumed_opt)
    train(resumed, resumed_opt, extra["step"], sample=False)
    final_resumed = hp.gather_full_state_dict(resumed)
    return {"samples": samples, "names_match": sorted(final) == sorted(final_resumed),
            "resumed_at": extra["step"],
            "resume_diff": max(float(np.abs(final[k] - final_resumed[k]).max()) for k in final),
            "moved": max(float(np.abs(final[k] - v).max())
                         for k, v in hp.gather_full_state_dict(model_and_optimizer(0)[0]).items())}
