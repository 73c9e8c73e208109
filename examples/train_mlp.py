"""Demo: train a small MLP with fully_shard on N CPU ranks, beside a single-process reference.

    python examples/train_mlp.py --nproc 2            # launches the ranks itself (hp-run)
    HP_BACKEND=mindspore python examples/train_mlp.py --nproc 2

Each rank trains on its slice of every global batch; rank 0 also trains an unwrapped copy
on the whole batch and prints both losses per step. They match (to float rounding)
because fully_shard averages gradients over the ranks exactly as the reference's mean
over the global batch does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS, BATCH, D_IN, D_HIDDEN, D_OUT = 8, 16, 64, 96, 8


def build(framework):
    """The same MLP in either framework: 3 blocks of Linear+ReLU, then a head."""
    if framework == "torch":
        import torch.nn as nn

        blocks = [nn.Sequential(nn.Linear(D_IN if i == 0 else D_HIDDEN, D_HIDDEN), nn.ReLU()) for i in range(3)]
        return nn.Sequential(*blocks, nn.Linear(D_HIDDEN, D_OUT))
    from mindspore import nn

    blocks = [nn.SequentialCell(nn.Dense(D_IN if i == 0 else D_HIDDEN, D_HIDDEN), nn.ReLU()) for i in range(3)]
    return nn.SequentialCell(*blocks, nn.Dense(D_HIDDEN, D_OUT))


def train(framework, model, batches, rank, world):
    """Yield the loss of each step; ``model`` sees rank ``rank``'s slice of each batch."""
    if framework == "torch":
        import torch

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x, y in batches:
            x, y = (torch.from_numpy(np.array_split(a, world)[rank]) for a in (x, y))
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            yield loss.item()
        return
    import mindspore as ms
    from mindspore.experimental.optim import AdamW

    params = model.trainable_params()
    opt = AdamW(params, lr=1e-2)
    grad_fn = ms.value_and_grad(lambda x, y: ((model(x) - y) ** 2).mean(), None, params)
    for x, y in batches:
        x, y = (ms.Tensor(np.array_split(a, world)[rank]) for a in (x, y))
        loss, grads = grad_fn(x, y)
        opt(grads)
        yield float(loss.asnumpy())


def load_same_values(framework, model, seed=0):
    rng = np.random.default_rng(seed)
    params = list(model.parameters()) if framework == "torch" else model.trainable_params()
    for p in params:
        value = (rng.standard_normal(tuple(p.shape)) * 0.1).astype(np.float32)
        if framework == "torch":
            import torch

            with torch.no_grad():
                p.copy_(torch.from_numpy(value))
        else:
            import mindspore as ms

            p.set_data(ms.Tensor(value))


def rank_main():
    import hyper_parallel as hp

    hp.init_distributed()
    platform = hp.get_platform()
    framework, rank, world = platform.name, platform.rank(), platform.world_size()
    if framework == "torch":
        import torch

        torch.set_num_threads(1)
    rng = np.random.default_rng(1)
    batches = [(rng.standard_normal((BATCH, D_IN)).astype(np.float32),
                rng.standard_normal((BATCH, D_OUT)).astype(np.float32)) for _ in range(STEPS)]
    model, reference = build(framework), build(framework)
    load_same_values(framework, model)
    load_same_values(framework, reference)
    for block in list(model)[:-1]:
        hp.fully_shard(block)
    hp.fully_shard(model)
    if rank == 0:
        print(f"backend={framework} ranks={world}: fully_shard on {len(list(model)) - 1} blocks + root")
        print(f"{'step':>4}  {'hyper_parallel':>14}  {'reference':>10}  {'|diff|':>8}")
    ours = train(framework, model, batches, rank, world)
    theirs = train(framework, reference, batches, 0, 1)
    worst = 0.0
    with hp.track_comms() as comms:
        for step, (local_loss, ref_loss) in enumerate(zip(ours, theirs)):
            mean_loss = _mean_over_ranks(platform, local_loss)
            worst = max(worst, abs(mean_loss - ref_loss))
            if rank == 0:
                print(f"{step:>4}  {mean_loss:>14.6f}  {ref_loss:>10.6f}  {abs(mean_loss - ref_loss):>8.1e}")
    if rank == 0:
        summary = {op: (e["calls"], e["bytes"]) for op, e in comms.summary().items()}
        print(f"collectives over {STEPS} steps (calls, bytes): {summary}")
        print("MATCH" if worst < 1e-5 else f"MISMATCH: worst difference {worst:.2e}")
    hp.destroy_distributed()
    if worst >= 1e-5:
        sys.exit(1)


def _mean_over_ranks(platform, value):
    tensor = platform.from_numpy(np.array([value], dtype=np.float32))
    if platform.world_size() > 1:
        platform.all_reduce(tensor, None, op="sum")
    return float(platform.to_numpy(tensor)[0]) / platform.world_size()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="number of CPU ranks (default 2)")
    args = parser.parse_args()
    if "RANK" in os.environ:
        rank_main()
        return
    command = [sys.executable, "-m", "hyper_parallel.launch", "--nproc", str(args.nproc),
               "--timeout", "600", __file__]
    sys.exit(subprocess.call(command))


if __name__ == "__main__":
    main()
