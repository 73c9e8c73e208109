"""Rank side of tests/test_pipelining.py: ``hp.pipelining`` (PipelineStage, ScheduleGPipe,
Schedule1F1B) training a model cut in two stages, against the same model trained whole in
one process on the same data.

The model: stage 0 two blocks and a linear layer, stage 1 a block and the output layer,
each initialised from its own seed on every rank.
On 2 ranks (pp 2) each stage is a plain module; on 4 ranks (pp 2 x dp 2) each block and
each stage is a unit (``fully_shard`` over ``mesh["dp"]``) and each dp rank feeds its half
of the global batch. Per rank: the last stage's losses, the stage's gathered parameters
beside the reference's, the reduce-scatters each step issued and the number of units.
``bad_shapes``: stage 1 is given ``input_args`` of another width than stage 0 returns.
"""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.kit import get_kit, make_batches
from tests.scenarios import _named

STEPS = 3
MICRO_BATCHES = 4
GLOBAL_BATCH = 16
D_IN, WIDTH, D_OUT = 37, 16, 5
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def _stages(kit) -> list:
    """The model, cut in two stages (initialised from the same seed on every rank)."""
    first = kit.Stack([kit.Block(D_IN, 24, WIDTH), kit.Block(WIDTH, 16, WIDTH)],
                      kit.linear(WIDTH, WIDTH))
    last = kit.Stack([kit.Block(WIDTH, 20, WIDTH)], kit.linear(WIDTH, D_OUT))
    kit.load(first, 0)
    kit.load(last, 1)
    return [first, last]


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _update(kit, opt, stage) -> None:
    """The framework's own optimizer step with the stage's gradients."""
    if kit.name == "torch":
        opt.step()
        opt.zero_grad()
    else:
        opt(tuple(stage.gradients()))


def run(schedule: str, dp: int = 1) -> dict:
    kit = get_kit()
    platform = hp.get_platform()
    __import__('tests._tmp_p2p_shim', fromlist=['x']).install(hp.get_platform())  # TMP
    rank, pp = platform.rank(), platform.world_size() // dp
    mesh = hp.init_device_mesh(platform.device_type(), (pp, dp), mesh_dim_names=("pp", "dp"))
    stage_index, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    module = _stages(kit)[stage_index]
    if dp > 1:
        for block in module.blocks:
            hp.fully_shard(block, mesh=mesh["dp"])
        hp.fully_shard(module, mesh=mesh["dp"])
    units = sum(isinstance(m, hp.FSDPModule) for _, m in platform.named_modules(module))
    stage = hp.pipelining.PipelineStage(module, stage_index, pp, platform.device_type(),
                                        group=mesh["pp"])
    sched = getattr(hp.pipelining, SCHEDULES[schedule])(stage, n_microbatches=MICRO_BATCHES,
                                                        loss_fn=_mse)
    opt = kit.optimizer([p for p in kit.params(module) if p.requires_grad])

    reference = _stages(kit)
    ref_model = kit.Stack([reference[0]], reference[1])
    ref_opt = kit.optimizer(kit.params(ref_model))
    losses, ref_losses, reduce_scatters = [], [], []
    rows = GLOBAL_BATCH // dp
    for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=5):
        mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
        step_losses = []
        with hp.track_comms() as comms:
            if stage.is_first:
                sched.step(kit.tensor(x[mine]))
            else:
                sched.step(target=kit.tensor(y[mine]), losses=step_losses)
        _update(kit, opt, stage)
        reduce_scatters.append(comms.calls("reduce_scatter"))
        if stage.is_last:
            losses.append(float(np.mean([kit.to_numpy(v) for v in step_losses])))
        ref_losses.append(kit.train_step(ref_model, ref_opt, x, y))

    full = (hp.gather_full_state_dict(module) if dp > 1
            else {k: kit.to_numpy(v) for k, v in _named(kit, module).items()})
    ref_full = {k: kit.to_numpy(v) for k, v in _named(kit, reference[stage_index]).items()}
    platform.barrier()
    return {
        "stage": stage_index, "losses": losses if stage.is_last else None,
        "ref_losses": ref_losses, "units": units, "reduce_scatters": reduce_scatters,
        "names_match": sorted(full) == sorted(ref_full),
        "param_diff": max(float(np.abs(full[k] - ref_full[k]).max()) for k in ref_full),
    }


def bad_shapes() -> str:
    """Stage 1 expects activations 3 columns wider than stage 0 returns: the error each
    rank raises (no rank may hang)."""
    kit = get_kit()
    platform = hp.get_platform()
    __import__('tests._tmp_p2p_shim', fromlist=['x']).install(hp.get_platform())  # TMP
    stage_index = platform.rank()
    module = _stages(kit)[stage_index]
    rows = GLOBAL_BATCH // MICRO_BATCHES
    wrong = kit.tensor(np.zeros((rows, WIDTH + 3), np.float32)) if stage_index == 1 else None
    stage = hp.pipelining.PipelineStage(module, stage_index, 2, platform.device_type(),
                                        input_args=wrong)
    sched = hp.pipelining.ScheduleGPipe(stage, MICRO_BATCHES, loss_fn=_mse)
    x, y = make_batches(1, GLOBAL_BATCH, D_IN, D_OUT, seed=5)[0]
    try:
        sched.step(kit.tensor(x)) if stage.is_first else sched.step(target=kit.tensor(y))
    except ValueError as e:
        message = str(e)
    else:
        message = "no error"
    platform.barrier()
    return message


def run_cases(cases: list, dp: int = 1) -> dict:
    """``{case: result}`` in one launch: schedule names, and "bad_shapes"."""
    return {case: bad_shapes() if case == "bad_shapes" else run(case, dp) for case in cases}
