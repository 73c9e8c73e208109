"""What HP_DEBUG=collectives costs: step time of a small model with the cross-check off and
on, in alternated rounds within one launch (so a slow stretch of a shared machine slows both
alike).

    hp-run --nproc 2 --backend torch benchmarks/collective_check_cost.py [ROUNDS STEPS]

Each round runs STEPS steps without the check, then STEPS with it (every rank switches at
the same step boundary, so their collectives stay matched); rank 0 prints the median step
time of each half per round, the median over rounds and the collectives a step issues.
"""

import os
import statistics
import sys
import time

# Run as a script, Python puts benchmarks/ first on the path: put the repository root there.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import hyper_parallel as hp  # noqa: E402
from hyper_parallel.collective_check import CollectiveCheck  # noqa: E402
from tests.kit import get_kit, make_batches  # noqa: E402

ROUNDS, STEPS = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (5, 20)
WIDTH, BLOCKS, BATCH = 256, 4, 32

if os.environ.get("HP_BACKEND") == "torch":
    import torch

    torch.set_num_threads(1)
hp.init_distributed()
platform = hp.get_platform()
rank, world = platform.rank(), platform.world_size()
kit = get_kit()
model = kit.Stack([kit.Block(WIDTH, WIDTH, WIDTH) for _ in range(BLOCKS)], kit.linear(WIDTH, 8))
kit.load(model, 0)
for block in model.blocks:
    hp.fully_shard(block)
hp.fully_shard(model)
opt = kit.optimizer(kit.params(model))
batches = make_batches(4, BATCH, WIDTH, 8)
local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)


def steps(check) -> list:
    platform.collective_check = check
    times = []
    for i in range(STEPS):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        kit.train_step(model, opt, x[local], y[local])
        times.append(time.perf_counter() - start)
    return times


steps(None)  # warm-up
with hp.track_comms() as comms:
    steps(None)
rounds = []
for _ in range(ROUNDS):
    off = statistics.median(steps(None))
    on = statistics.median(steps(CollectiveCheck(platform)))
    rounds.append((off, on))
platform.collective_check = None
if rank == 0:
    per_step = comms.calls() / STEPS
    for i, (off, on) in enumerate(rounds):
        print(f"round {i}: off {off * 1e3:.2f} ms  on {on * 1e3:.2f} ms  (+{(on / off - 1) * 100:.0f}%)")
    off = statistics.median(r[0] for r in rounds)
    on = statistics.median(r[1] for r in rounds)
    print(f"{kit.name}, {world} ranks, {per_step:g} collectives per step: median step off "
          f"{off * 1e3:.2f} ms, on {on * 1e3:.2f} ms (+{(on / off - 1) * 100:.0f}%, "
          f"{(on - off) / per_step * 1e3:.2f} ms per collective)")
hp.destroy_distributed()
