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
#: name -> (schedule, stages per rank)
SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
             "interleaved": ("ScheduleInterleaved1F1B", 2),
             # low-precision parameters in the units (float32 reduction and activations
             # between the stages): bfloat16 on torch, float16 on MindSpore (no bfloat16
             # matmul on its CPU)
             "1f1b_mixed": ("Schedule1F1B", 1),
             # HSDP in the stages: the dp ranks replicate, (replicate 2, shard 1)
             "1f1b_hsdp": ("Schedule1F1B", 1),
             # on torch: the stage given torch's own 1-D DeviceMesh
             "1f1b_torch_mesh": ("Schedule1F1B", 1)}
LOW = {"torch": "bfloat16", "mindspore": "float16"}


def _stages(kit, count: int = 2) -> list:
    """The model, cut in ``count`` (2 or 4) stages, each initialised from its own seed
    (the same on every rank)."""
    if count == 2:
        stages = [kit.Stack([kit.Block(D_IN, 24, WIDTH), kit.Block(WIDTH, 16, WIDTH)],
                            kit.linear(WIDTH, WIDTH)),
                  kit.Stack([kit.Block(WIDTH, 20, WIDTH)], kit.linear(WIDTH, D_OUT))]
    else:
        stages = [kit.Stack([kit.Block(D_IN, 24, WIDTH)], kit.linear(WIDTH, WIDTH)),
                  kit.Stack([kit.Block(WIDTH, 16, WIDTH)], kit.linear(WIDTH, WIDTH)),
                  kit.Stack([kit.Block(WIDTH, 20, WIDTH)], kit.linear(WIDTH, WIDTH)),
                  kit.Stack([kit.Block(WIDTH, 12, WIDTH)], kit.linear(WIDTH, D_OUT))]
    for seed, stage in enumerate(stages):
        kit.load(stage, seed)
    return stages


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _update(kit, opt, stage) -> None:
    """The framework's own optimizer step with the stage's gradients."""
    if kit.name == "torch":
        opt.step()
        opt.zero_grad()
    else:
        opt(tuple(stage.gradients()))


def _full(kit, module, sharded: bool) -> dict:
    if sharded:
        return hp.gather_full_state_dict(module)
    return {k: kit.to_numpy(v) for k, v in _named(kit, module).items()}


def run(schedule: str, dp: int = 1) -> dict:
    kit = get_kit()
    platform = hp.get_platform()
    name, per_rank = SCHEDULES[schedule]
    pp = platform.world_size() // dp
    count = pp * per_rank
    if schedule.endswith("_hsdp"):
        mesh = hp.init_device_mesh(platform.device_type(), (pp, dp, 1),
                                   mesh_dim_names=("pp", "replicate", "shard"))
        dp_mesh, dp_rank = mesh["replicate", "shard"], mesh.get_local_rank("replicate")
    else:
        mesh = hp.init_device_mesh(platform.device_type(), (pp, dp), mesh_dim_names=("pp", "dp"))
        dp_mesh, dp_rank = mesh["dp"], mesh.get_local_rank("dp")
    pp_rank = mesh.get_local_rank("pp")
    indices = [pp_rank + k * pp for k in range(per_rank)]
    modules = [_stages(kit, count)[i] for i in indices]
    mixed = schedule.endswith("_mixed")
    inner = hp.MixedPrecisionPolicy(param_dtype=LOW[kit.name], reduce_dtype="float32") \
        if mixed else hp.MixedPrecisionPolicy()
    outer = hp.MixedPrecisionPolicy(param_dtype=LOW[kit.name], reduce_dtype="float32",
                                    output_dtype="float32") if mixed else inner
    for module in modules if dp > 1 else ():
        for block in module.blocks:
            hp.fully_shard(block, mesh=dp_mesh, mp_policy=inner)
        hp.fully_shard(module, mesh=dp_mesh, mp_policy=outer)
    units = sum(isinstance(m, hp.FSDPModule) for module in modules
                for _, m in platform.named_modules(module))
    group = mesh["pp"]
    if schedule.endswith("_torch_mesh"):  # torch's own DeviceMesh, as torch users pass it
        from torch.distributed.device_mesh import init_device_mesh
        group = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))["pp"]
    stages = [hp.pipelining.PipelineStage(module, i, count, platform.device_type(),
                                          group=group) for module, i in zip(modules, indices)]
    sched = getattr(hp.pipelining, name)(stages if per_rank > 1 else stages[0],
                                         n_microbatches=MICRO_BATCHES, loss_fn=_mse)
    peak = dict.fromkeys(indices, 0)  # the most micro-batches pending on a stage at once
    for stage in stages:
        def counted(*args, stage=stage, forward=stage.forward_one_chunk):
            out = forward(*args)
            peak[stage.stage_index] = max(peak[stage.stage_index], len(stage._pending))
            return out
        stage.forward_one_chunk = counted
    opts = [kit.optimizer([p for p in kit.params(m) if p.requires_grad]) for m in modules]
    has_first, has_last = 0 in indices, count - 1 in indices

    reference = _stages(kit, count)
    ref_model = kit.Stack(reference[:-1], reference[-1])
    ref_opt = kit.optimizer(kit.params(ref_model))
    losses, ref_losses, reduce_scatters, all_reduces = [], [], [], []
    rows = GLOBAL_BATCH // dp
    for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=5):
        mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
        step_losses = []
        args = (kit.tensor(x[mine]),) if has_first else ()
        kwargs = {"target": kit.tensor(y[mine]), "losses": step_losses} if has_last else {}
        with hp.track_comms() as comms:
            sched.step(*args, **kwargs)
        for opt, stage in zip(opts, stages):
            _update(kit, opt, stage)
        reduce_scatters.append(comms.calls("reduce_scatter"))
        all_reduces.append(comms.calls("all_reduce"))
        if has_last:
            losses.append(float(np.mean([kit.to_numpy(v) for v in step_losses])))
        ref_losses.append(kit.train_step(ref_model, ref_opt, x, y))

    # a held-out batch, forwards only (schedule.eval), against the reference's forward
    x, y = make_batches(1, GLOBAL_BATCH, D_IN, D_OUT, seed=11)[0]
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
    eval_losses = []
    args = (kit.tensor(x[mine]),) if has_first else ()
    kwargs = {"target": kit.tensor(y[mine]), "losses": eval_losses} if has_last else {}
    sched.eval(*args, **kwargs)
    with platform.no_grad():
        ref_eval = float(kit.to_numpy(_mse(ref_model(kit.tensor(x)), kit.tensor(y))))

    diffs, names_match = [], True
    for module, i in zip(modules, indices):
        full = _full(kit, module, dp > 1)
        ref_full = _full(kit, reference[i], False)
        names_match &= sorted(full) == sorted(ref_full)
        diffs += [float(np.abs(full[k] - ref_full[k]).max()) for k in ref_full]
    platform.barrier()
    return {
        "pp_rank": pp_rank, "losses": losses if has_last else None,
        "eval_loss": float(np.mean([kit.to_numpy(v) for v in eval_losses])) if has_last else None,
        "ref_eval_loss": ref_eval,
        "ref_losses": ref_losses, "units": units, "reduce_scatters": reduce_scatters,
        "all_reduces": all_reduces,
        "names_match": names_match, "param_diff": max(diffs), "peak_pending": peak,
    }


def bad_shapes() -> str:
    """Stage 1 expects activations 3 columns wider than stage 0 returns: the error each
    rank raises (no rank may hang)."""
    kit = get_kit()
    platform = hp.get_platform()
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
