"""Rank side of tests/test_pipeline.py (torch only, 4 ranks): torch's own pipeline
parallelism (``torch.distributed.pipelining``) over units of ``hp.fully_shard``, against the
same schedule over FSDP2's units, on one mesh (pp 2, dp 2; for HSDP pp 2, replicate 2,
shard 1).

Each schedule trains the same model (four ``Linear(32, 32)`` + Tanh blocks, each block a
unit over the dp mesh, each stage module a unit too) for a few steps, once with
``hp.fully_shard`` and once with torch's ``fully_shard``, each rank feeding its dp slice of
the global batch: the losses of the last stage, the parameters after the last step, and
per step the collectives each run issued, counted for both by one dispatch counter of c10d
collectives (the pipeline's point-to-point sends are not collectives) and, for
hyper_parallel, by ``hp.track_comms``; and how often the schedule called the units'
``unshard``/``reshard``. Gradients are clipped across stages the way torchtitan does (each
stage's norm over its DTensor gradients, summed over the pp group), outside the counted
window. The stages get their shapes up front (as torchtitan gives them): the metadata
inference torch runs otherwise differentiates a leaf input under ``autograd.grad``, which
FSDP2's hooks cannot run in torch 2.13.
"""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.scenarios import _counting

DIM = 32
BLOCKS = 4
MICROBATCHES = 4
GLOBAL_BATCH = 16
STEPS = 3
MAX_NORM = 0.5

#: name -> (schedule class name, stages per rank, bfloat16 parameters with float32
#: reduction, HSDP: the dp ranks replicate (a (replicate 2, shard 1) mesh) instead of shard)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, False, False),
    "1f1b": ("Schedule1F1B", 1, True, False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, True, False),
    "1f1b_hsdp": ("Schedule1F1B", 1, False, True),
}


def _blocks():
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(BLOCKS)]


def _stage(blocks):
    """One stage module: ``blocks`` in sequence."""
    import torch.nn as nn

    class Stage(nn.Module):
        def __init__(self, chunk):
            super().__init__()
            self.blocks = nn.ModuleList(chunk)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x
    return Stage(blocks)


def _torch_units():
    from torch.distributed.fsdp import FSDPModule
    return FSDPModule


def _shard(fully_shard, stage, dp_mesh, mixed: bool) -> None:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kwargs = {"mesh": dp_mesh}
    if mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for block in stage.blocks:
        fully_shard(block, **kwargs)
    if mixed:  # float32 activations between stages
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32,
                                                   output_dtype=torch.float32)
    fully_shard(stage, **kwargs)


def _clip_across_stages(stages, pp_group) -> float:
    """torchtitan's ``clip_grad_norm_`` with a pp mesh: the total norm of every stage's
    DTensor gradients (each a full_tensor over dp), squared, summed over pp."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params = [p for stage in stages for p in stage.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    norm = norm ** 2
    dist.all_reduce(norm, group=pp_group)
    norm = norm ** 0.5
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
    return float(norm)


def _c10d_counter():
    """A dispatch mode counting the c10d collectives issued under it, by kind (the ops
    still run)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    kinds = {"reduce_scatter": "reduce_scatter", "allreduce": "all_reduce",
             "allgather": "all_gather"}

    class C10dCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                for prefix, kind in kinds.items():
                    if func._opname.lstrip("_").startswith(prefix):
                        self.counts[kind] = self.counts.get(kind, 0) + 1
            return func(*args, **(kwargs or {}))
    return C10dCounter()


def _hp_counts(window) -> dict:
    """{"op": calls} of one ``hp.track_comms`` window."""
    counts: dict = {}
    for (op, _wire, _dim), record in window.records.items():
        counts[op] = counts.get(op, 0) + record.calls
    return counts


def _train(name: str, fully_shard, mesh, use_hp: bool) -> dict:
    """``mesh``: (pp, dp) or, for HSDP, (pp, replicate, shard)."""
    import torch
    import torch.distributed.pipelining as pipelining

    schedule_name, per_rank, mixed, hsdp = SCHEDULES[name]
    pp_rank, pp_size = mesh["pp"].get_local_rank(), mesh["pp"].size()
    dp_mesh = mesh["replicate", "shard"] if hsdp else mesh["dp"]
    dp_rank, dp_size = (mesh["replicate"] if hsdp else dp_mesh).get_local_rank(), dp_mesh.size()
    n_stages = pp_size * per_rank
    blocks = _blocks()
    chunk = BLOCKS // n_stages
    indices = [pp_rank + k * pp_size for k in range(per_rank)]  # the looped placement
    modules = [_stage(blocks[i * chunk:(i + 1) * chunk]) for i in indices]
    for module in modules:
        _shard(fully_shard, module, dp_mesh, mixed)
    # static shapes: no metadata inference (see the module's docstring)
    micro = torch.empty(GLOBAL_BATCH // dp_size // MICROBATCHES, DIM)
    stages = [pipelining.PipelineStage(module, index, n_stages, torch.device("cpu"),
                                       input_args=micro.clone().requires_grad_(index > 0),
                                       output_args=micro, input_grads=micro if index else None,
                                       output_grads=micro if index < n_stages - 1 else None,
                                       group=mesh["pp"].get_group())
              for module, index in zip(modules, indices)]
    schedule_class = getattr(pipelining, schedule_name)
    loss_fn = lambda out, target: ((out.float() - target) ** 2).mean()  # noqa: E731
    schedule = schedule_class(stages if per_rank > 1 else stages[0], MICROBATCHES,
                              loss_fn=loss_fn)
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.5)
    rng = np.random.default_rng(7)
    local = slice(dp_rank * GLOBAL_BATCH // dp_size, (dp_rank + 1) * GLOBAL_BATCH // dp_size)
    out = {"losses": [], "norms": [], "collectives": [], "hp_collectives": [],
           "unshard_reshard": []}
    # the class whose unshard/reshard a unit runs when the schedule calls them
    unit_class = hp.FSDPModule if use_hp else _torch_units()
    for _ in range(STEPS):
        x = torch.from_numpy(rng.standard_normal((GLOBAL_BATCH, DIM)).astype(np.float32))
        y = torch.from_numpy(rng.standard_normal((GLOBAL_BATCH, DIM)).astype(np.float32))
        losses = []
        counter = _c10d_counter()
        with hp.track_comms() as window, counter, \
                _counting(unit_class, "unshard") as unshards, \
                _counting(unit_class, "reshard") as reshards:
            if pp_rank == 0:
                schedule.step(x[local])
            else:
                schedule.step(target=y[local], losses=losses)
        out["collectives"].append(counter.counts)
        out["hp_collectives"].append(_hp_counts(window))
        out["unshard_reshard"].append((unshards[0], reshards[0]))
        out["norms"].append(_clip_across_stages(modules, mesh["pp"].get_group()))
        opt.step()
        opt.zero_grad()
        out["losses"].append([float(loss.detach()) for loss in losses])
    out["params"] = {f"{index}.{fqn}": p.full_tensor().detach().float().numpy()
                     for module, index in zip(modules, indices)
                     for fqn, p in module.named_parameters()}
    # the units holding parameters (the stage modules hold none of their own)
    out["units"] = sum(len(module.blocks) for module in modules)
    return out


def run_all() -> dict:
    """Every schedule of ``SCHEDULES``, with hyper_parallel and with FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    meshes = {False: init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")),
              True: init_device_mesh("cpu", (2, 2, 1),
                                     mesh_dim_names=("pp", "replicate", "shard"))}
    results = {}
    for name, (*_, hsdp) in SCHEDULES.items():
        results[name] = {"hp": _train(name, hp.fully_shard, meshes[hsdp], use_hp=True),
                         "fsdp2": _train(name, torch_fully_shard, meshes[hsdp], use_hp=False)}
    return results
