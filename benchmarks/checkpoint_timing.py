"""Checkpoint timings on the example language model (torch): a synchronous
``hp.save_checkpoint``, the blocking part and the whole of an asynchronous one,
``hp.load_checkpoint`` (and with ``verify=False``: without checking the checksums), and
``torch.distributed.checkpoint``'s ``dcp.save``/``dcp.load`` of the same model and AdamW
state on the same ranks.

    hp-run --nproc 2 --backend torch benchmarks/checkpoint_timing.py --size 124m --dir DIR
    hp-run --nproc 2 --backend torch benchmarks/checkpoint_timing.py --size 124m --dir DIR \
        --only load,load_unverified --rounds 5   # what checking the checksums costs

Each rank takes one AdamW step first (so the optimizer has its state), then every
operation runs ``--rounds`` times, between barriers, each round starting with the next
operation (a write leaves the disk busy for the one after it); rank 0 prints the median
time of each, in seconds, as JSON; with both loads, also the ratio of the two loads of
each round (verified / unverified): its median, least and greatest. DIR gets one directory per format (about three times the model's
fp32 size each).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hyper_parallel as hp  # noqa: E402
from examples.lm.config import VOCAB  # noqa: E402
from examples.lm.model_torch import build  # noqa: E402


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="124m")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--only", default="", help="comma-separated operations to time "
                        "(save, async_save, load, load_unverified, dcp_save, dcp_load)")
    args = parser.parse_args()
    hp.init_distributed()
    torch.set_num_threads(1)
    model = build(args.size)
    for layer in model.model.layers:
        hp.fully_shard(layer)
    hp.fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, VOCAB, (1, 33)))
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB),
                                             ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

    ours, theirs = os.path.join(args.dir, "hp"), os.path.join(args.dir, "dcp")
    times = {"save": [], "async_blocking": [], "async_total": [], "load": [],
             "load_unverified": [], "dcp_save": [], "dcp_load": []}

    def save():
        times["save"].append(_timed(lambda: hp.save_checkpoint(ours, model, optimizer)))

    def async_save():
        dist.barrier()
        start = time.perf_counter()
        handle = hp.save_checkpoint(ours, model, optimizer, async_save=True)
        times["async_blocking"].append(time.perf_counter() - start)
        handle.wait()
        dist.barrier()
        times["async_total"].append(time.perf_counter() - start)

    def load():
        times["load"].append(_timed(lambda: hp.load_checkpoint(ours, model, optimizer)))

    def load_unverified():
        times["load_unverified"].append(_timed(
            lambda: hp.load_checkpoint(ours, model, optimizer, verify=False)))

    def dcp_save():
        def run():
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=theirs)
        times["dcp_save"].append(_timed(run))

    def dcp_load():
        def run():
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=theirs)
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        times["dcp_load"].append(_timed(run))

    # the disk is still busy after a write, so each round starts with another operation
    operations = [save, async_save, load, load_unverified, dcp_save, dcp_load]
    if args.only:
        wanted = args.only.split(",")
        operations = [op for op in operations if op.__name__ in wanted]
        if "save" not in wanted and "async_save" not in wanted:
            hp.save_checkpoint(ours, model, optimizer)  # what the loads read
    for round_ in range(args.rounds):
        shift = round_ % len(operations)
        for operation in operations[shift:] + operations[:shift]:
            operation()
    if dist.get_rank() == 0:
        parameters = sum(p.numel() for p in model.parameters())
        result = {"size": args.size, "parameters": parameters, "ranks": dist.get_world_size(),
                  **{k: round(float(np.median(v)), 3) for k, v in times.items() if v}}
        if times["load"] and times["load_unverified"]:
            ratios = np.array(times["load"]) / np.array(times["load_unverified"])
            result["load_ratio"] = {"median": round(float(np.median(ratios)), 3),
                                    "min": round(float(ratios.min()), 3),
                                    "max": round(float(ratios.max()), 3),
                                    "rounds": [round(float(r), 3) for r in ratios]}
        print(json.dumps(result))
    hp.destroy_distributed()


if __name__ == "__main__":
    main()
