"""Rank-side scenarios of test_desync.py (desync detection), for both frameworks.

The model has three blocks and a head; its forward skips the middle block when told to,
as a model whose control flow depends on its batch would on some ranks only.

Design note
-----------
``run_all`` runs every case in one 2-rank launch (the process start-up is most of a case's
cost). A desync raise leaves the group usable: every rank raised at the same cross-check,
after the same collectives, and issued nothing more, so the next case trains a fresh model
on the same group. Each case records, per rank, the error it raised (type and message) for
the test to check. The check is installed by the harness's ``hp.init_distributed()`` from
``HP_DEBUG=collectives`` and later re-installed through the ``debug_collectives`` argument.

The "idle" case runs last and cannot return: its extra rank's peers issue no collective, so
the watchdog ends that rank's process (or gloo's timeout fails its group for good). The
results of the earlier cases are therefore written to ``results_dir`` before it starts, and
the launch itself ends in the failure the test checks.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import hyper_parallel as hp
from tests.kit import get_kit, make_batches
from tests.scenarios import D_IN, D_OUT, GLOBAL_BATCH, STEPS, run_scenario

IDLE_S = 120.0  # how long an idle rank waits (the test ends it sooner)


def _skipping_stack(kit):
    """kit.Stack whose forward leaves out block 1 while ``skip_middle`` is set."""

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if not (i == 1 and self.skip_middle):
                x = block(x)
        return self.head(x)

    return type("SkippingStack", (kit.Stack,),
                {"forward" if kit.name == "torch" else "construct": forward})


def _train(steps: int, skip_rank: int = -1, skip_step: int = -1) -> None:
    kit = get_kit()
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    blocks = [kit.Block(D_IN, 24, 16), kit.Block(16, 24, 16), kit.Block(16, 24, 16)]
    model = _skipping_stack(kit)(blocks, kit.linear(16, D_OUT))
    model.skip_middle = False
    kit.load(model, 0)
    for block in model.blocks:
        hp.fully_shard(block)
    hp.fully_shard(model)
    opt = kit.optimizer(kit.params(model))
    local = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    for step, (x, y) in enumerate(make_batches(steps, GLOBAL_BATCH, D_IN, D_OUT)):
        model.skip_middle = rank == skip_rank and step == skip_step
        kit.train_step(model, opt, x[local], y[local])


def _raised(case) -> dict | None:
    """{"type", "message"} of what ``case()`` raised on this rank; None if it returned."""
    try:
        case()
    except Exception as error:  # noqa: BLE001 - the test checks the type
        return {"type": type(error).__name__, "message": str(error)}
    return None


def _skipping() -> None:
    """Rank 1 skips block 1 in step 1 (the forward prefetch is on by then)."""
    _train(STEPS, skip_rank=1, skip_step=1)


def _extra_step() -> None:
    """Rank 1 runs one step more; rank 0 then leaves the job (destroy_distributed)."""
    rank = hp.get_platform().rank()
    _train(STEPS + (rank == 1))
    if rank != 1:
        hp.destroy_distributed()


def _parity() -> dict:
    """The parity suite's nested scenario under the check: every collective cross-checked,
    the training unchanged."""
    platform = hp.get_platform()
    check = platform.collective_check
    assert check is not None, "HP_DEBUG=collectives did not install the check"
    before = check.checked
    result = run_scenario("nested")
    result["checked"] = check.checked - before
    result["issued"] = platform.comm_stats.calls()
    return result


def _by_argument() -> dict:
    """Re-join without HP_DEBUG: the check is off, then ``debug_collectives=True`` turns it
    on, and the skipping case raises under it."""
    os.environ.pop("HP_DEBUG", None)
    hp.init_distributed()
    off_without = hp.get_platform().collective_check is None
    hp.init_distributed(debug_collectives=True)
    on_with = hp.get_platform().collective_check is not None
    return {"off_without": off_without, "on_with": on_with, "skipping": _raised(_skipping)}


def run_all(results_dir: str) -> None:
    """Every case in order, the results to ``results_dir/rank<r>.pkl``, then the idle case:
    rank 1 starts a step while rank 0 stays idle without calling a collective."""
    rank = hp.get_platform().rank()
    results = {"parity": _parity(), "skipping": _raised(_skipping)}
    results["argument"] = _by_argument()
    results["extra_step"] = _raised(_extra_step)
    with open(Path(results_dir) / f"rank{rank}.pkl", "wb") as file:
        pickle.dump(results, file)
    _train(STEPS + (rank == 1))
    if rank != 1:
        time.sleep(IDLE_S)
