"""Run by test_faults.py (by hand or under hp-run): train the nested model with a short
collective timeout while the last rank fails at step ``FAULT_STEP``: it dies (SIGKILL) or
sleeps at its first all-gather (mid-forward), its first reduce-scatter (mid-backward) or in
its optimizer step. Every rank prints ``pid <pid>`` and the failing one ``fault <time>`` to
stderr, so the test can time the survivors and look for orphans.

Usage: python tests/fault_script.py {die,sleep} {forward,backward,step} TIMEOUT_S
"""

import os
import signal
import sys
import time

# Run as a script, Python puts tests/ first on the path, where tests/platform would shadow
# the standard library's platform module: put the repository root there instead.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import hyper_parallel as hp  # noqa: E402
from tests.kit import get_kit, make_batches  # noqa: E402
from tests.scenarios import D_IN, D_OUT, GLOBAL_BATCH, _build, _wrap  # noqa: E402

FAULT_STEP = 2
how, where, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
if os.environ.get("HP_BACKEND") == "torch":
    import torch

    torch.set_num_threads(1)
print(f"pid {os.getpid()}", file=sys.stderr, flush=True)
hp.init_distributed(timeout_s=timeout_s)
platform = hp.get_platform()
rank, world = platform.rank(), platform.world_size()
kit = get_kit()
model = _build(kit, "nested")
kit.load(model, 0)
_wrap(kit, model, "nested")
opt = kit.optimizer(kit.params(model))
step_now = [0]


def fail() -> None:
    print(f"fault {time.time()}", file=sys.stderr, flush=True)
    if how == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)  # alive, but never calls another collective


if rank == world - 1:
    op = {"forward": "all_gather", "backward": "reduce_scatter"}.get(where)
    if op is not None:
        issuing = platform._issuing

        def issuing_or_fail(name, *args):
            if name == op and step_now[0] == FAULT_STEP:
                fail()
            return issuing(name, *args)

        platform._issuing = issuing_or_fail
    else:  # the optimizer step: torch's step(), MindSpore's optimizer Cell construct()
        attr = "step" if kit.name == "torch" else "construct"
        update = getattr(opt, attr)

        def update_or_fail(*args, **kwargs):
            if step_now[0] == FAULT_STEP:
                fail()
            return update(*args, **kwargs)

        object.__setattr__(opt, attr, update_or_fail)
local = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
for step_now[0], (x, y) in enumerate(make_batches(FAULT_STEP + 3, GLOBAL_BATCH, D_IN, D_OUT)):
    kit.train_step(model, opt, x[local], y[local])
hp.destroy_distributed()
print("finished", file=sys.stderr, flush=True)
