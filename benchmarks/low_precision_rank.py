"""One rank of a low-precision all-gather launch (low_precision.py).

The model is the kits' language model (tests/kit*.py: embedding, pre-norm blocks of
attention and an MLP, final norm, head) with every block and the root a unit, trained with
AdamW. Variants, built side by side and stepped in alternated rounds (``rounds`` rounds of
``steps`` steps each, one variant after the other, so a slow stretch of the shared machine
slows all alike): ``hp`` (full precision), ``hp_bf16_gather`` (``hp.CastGather
("bfloat16")`` on the matrices), ``hp_int8_gather`` (``hp.Int8RowGather()``); on torch
``fsdp2``, and with torchao installed ``hp_float8`` and ``fsdp2_float8`` (torchao float8
training, float8 all-gather on for hp, off for FSDP2: gloo refuses FSDP2's). Per variant and round: the median step time and the
all-gather bytes of one step.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import hyper_parallel as hp  # noqa: E402
from benchmarks.measure import rank_main  # noqa: E402
from tests.kit import get_kit  # noqa: E402


def _build(kit, job, variant):
    model = kit.LM(job["vocab"], job["dim"], job["hidden"], job["blocks"])
    kit.load(model, 0)
    if variant in ("hp_float8", "fsdp2_float8"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(
            enable_fsdp_float8_all_gather=variant == "hp_float8"))
    if variant == "hp_bf16_gather":
        hp.set_gather_codec(model, hp.CastGather("bfloat16"))
    if variant == "hp_int8_gather":
        hp.set_gather_codec(model, hp.Int8RowGather())
    if variant.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = hp.fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, kit.optimizer(kit.params(model), lr=1e-3, kind="adamw")


def run(job: dict, rank: int, world: int) -> dict:
    backend = os.environ["HP_BACKEND"]
    if backend == "torch":
        import torch

        torch.set_num_threads(1)
    hp.init_distributed()
    platform = hp.get_platform()
    kit = get_kit()
    variants = ["hp", "hp_bf16_gather", "hp_int8_gather"]
    if backend == "torch":
        variants.append("fsdp2")
        if importlib.util.find_spec("torchao") is not None:
            variants += ["hp_float8", "fsdp2_float8"]
    built = {v: _build(kit, job, v) for v in variants}
    rng = np.random.default_rng(rank)
    ids = kit.ids(rng.integers(0, job["vocab"], (job["batch"], job["seq"])))

    def step(model, opt):
        return kit.grad_step(model, opt, lambda: kit.lm_loss(model.head(model(ids)), ids))

    figures = {v: {"step_s": [], "gather_bytes": []} for v in variants}
    for round_index in range(job["warmup"] + job["rounds"]):
        for variant in variants:
            model, opt = built[variant]
            times = []
            for _ in range(job["steps"]):
                platform.barrier()
                started = time.perf_counter()
                with hp.track_comms() as stats:
                    step(model, opt)
                times.append(time.perf_counter() - started)
            if round_index >= job["warmup"]:
                figures[variant]["step_s"].append(statistics.median(times))
                figures[variant]["gather_bytes"].append(stats.nbytes("all_gather"))
    hp.destroy_distributed()
    return {"variants": figures}


if __name__ == "__main__":
    rank_main(run)
