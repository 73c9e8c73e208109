"""Rank-side scenarios of test_desync.py (HP_DEBUG=collectives), for both frameworks.

The model has three blocks and a head; its forward skips the middle block when told to,
as a model whose control flow depends on its batch would on some ranks only.
"""

from __future__ import annotations

import time

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


def run_skipping(skip_rank: int, skip_step: int) -> None:
    """Rank ``skip_rank`` skips block 1 at step ``skip_step``; the check must raise."""
    _train(STEPS, skip_rank, skip_step)


def run_extra_step(extra_rank: int, then: str) -> None:
    """Rank ``extra_rank`` runs one step more than the others, which then leave the job
    (``then="leave"``: destroy_distributed, as the harness calls it after this returns) or
    stay idle without calling a collective (``then="idle"``)."""
    rank = hp.get_platform().rank()
    _train(STEPS + (rank == extra_rank))
    if then == "idle" and rank != extra_rank:
        time.sleep(IDLE_S)


def run_parity() -> dict:
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
