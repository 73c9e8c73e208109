"""Rank side of tests/test_core_tp_hsdp.py: the core's tensor parallelism under HSDP on a
3-D ``(replicate, shard, tp)`` mesh, with gradient accumulation and recompute.

The language model of tests/core_tp_models.py under torchtitan's sequence-parallel plan
(``parallelize_module(model, mesh["tp"], plan)``), its attention and MLP recomputed in
backward (torch: ``torch.utils.checkpoint``; MindSpore: ``ms.recompute``, which
differentiates a recomputed cell by its tensor inputs only: the norms before the blocks
hand them plain tensors, ``use_local_output=True``), then
``fully_shard(unit, mesh=mesh["replicate", "shard"])`` (HSDP) for the attention, the MLP
and the root. Each AdamW step accumulates ``MICRO`` microbatches: the first with
``set_requires_gradient_sync(False)``, each loss divided by ``MICRO``: microbatch ``m`` of
step ``k`` is one sequence per data-parallel rank (``d``, its (replicate, shard)
coordinate), ``_data``'s ``[k, m, d]``.

- torch: the same under torch's own DTensor tensor parallelism and FSDP2's HSDP (torch's
  ``fully_shard`` on the same 2-D sub-mesh, ``set_requires_gradient_sync``): losses and
  every rank's local shard after every step;
- MindSpore: the model trained whole in one process on every sequence of each step in
  one batch (``reference``): losses, and every parameter's local shard with where it
  lies, assembled in the test process.

``run(backend, shape)``: ``shape`` the (replicate, shard, tp) mesh, whose
product is the world size: (2, 1, 2) on 4 ranks, (2, 2, 2) on 8. Plain numpy out.
"""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from hyper_parallel import tensor_parallel as core_tp
from tests.core_tp_fsdp_scenarios import LR, _shard_records
from tests.core_tp_models import (
    SEQ, STEPS, VOCAB, mindspore_model, mindspore_name, plan, targets_for, torch_model)

MICRO = 2
NAMES = ("replicate", "shard", "tp")


def _data(dp_size: int) -> tuple:
    """``(ids, targets)``, each ``(STEPS, MICRO, dp_size, SEQ)``: one sequence per step,
    microbatch and data-parallel rank."""
    rng = np.random.default_rng(5)
    shape = (STEPS, MICRO, dp_size, SEQ)
    return (rng.integers(0, VOCAB, shape).astype(np.int64),
            rng.integers(0, VOCAB, shape).astype(np.int64))


def _micro_slices(dp_rank: int, dp_size: int, tp: int) -> list:
    """Per step, ``[(ids, targets)]`` of this data-parallel rank's sequence of each
    microbatch (targets rank-major, as the sequence plan's head rows are)."""
    ids, targets = _data(dp_size)
    row = slice(dp_rank, dp_rank + 1)
    return [[(ids[k, m, row], targets_for(targets[k, m, row], "sequence", tp))
             for m in range(MICRO)] for k in range(STEPS)]


def _whole_batches(dp_size: int) -> list:
    """Per step, every sequence of that step in one batch, for one process."""
    ids, targets = _data(dp_size)
    return [(ids[k].reshape(-1, SEQ), targets[k].reshape(-1)) for k in range(STEPS)]


def _dp_coordinates(mesh, shape) -> tuple:
    replicate, shard = mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")
    return replicate * shape[1] + shard, shape[0] * shape[1]


# ---------------------------------------------------------------- torch
def _torch_accumulating(model, steps: list, loss_context, cross_entropy) -> dict:
    """AdamW over ``steps`` of microbatches, gradient sync off for all but the last."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR["adamw"], foreach=False)
    losses, shards = [], []
    for micro in steps:
        total = 0.0
        for m, (ids, targets) in enumerate(micro):
            model.set_requires_gradient_sync(m == MICRO - 1)
            with loss_context():
                loss = cross_entropy(model(torch.from_numpy(ids)), torch.from_numpy(targets))
                (loss / MICRO).backward()
            total += float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())
        opt.step()
        opt.zero_grad()
        losses.append(total / MICRO)
        shards.append({n: (p.to_local() if hasattr(p, "to_local") else p).detach().numpy().copy()
                       for n, p in model.named_parameters()})
    return {"losses": losses, "shards": shards}


def run_torch(shape: tuple) -> dict:
    import torch.distributed.tensor as torch_placements
    import torch.distributed.tensor.parallel as torch_tp
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class TorchNames:  # torch's styles with torch's placements
        Shard, Replicate = torch_placements.Shard, torch_placements.Replicate
        ColwiseParallel, RowwiseParallel = torch_tp.ColwiseParallel, torch_tp.RowwiseParallel
        SequenceParallel, PrepareModuleInput = torch_tp.SequenceParallel, torch_tp.PrepareModuleInput
        PrepareModuleInputOutput = torch_tp.PrepareModuleInputOutput

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=NAMES)
    dp_mesh = mesh["replicate", "shard"]
    theirs = torch_tp.parallelize_module(torch_model(recompute=True), mesh["tp"],
                                         plan(TorchNames, "sequence", local_norms=True))
    ours = core_tp.parallelize_module(torch_model(recompute=True), mesh["tp"],
                                      plan(core_tp, "sequence", local_norms=True))
    for shard, model in ((fully_shard, theirs), (hp.fully_shard, ours)):
        for unit in (model.attn, model.ffn):
            shard(unit, mesh=dp_mesh)
        shard(model, mesh=dp_mesh)
    dp_rank, dp_size = _dp_coordinates(mesh, shape)
    steps = _micro_slices(dp_rank, dp_size, shape[2])
    return {"core": _torch_accumulating(ours, steps, core_tp.loss_parallel, core_tp.cross_entropy),
            "fsdp2": _torch_accumulating(theirs, steps, torch_tp.loss_parallel, F.cross_entropy)}


# ---------------------------------------------------------------- MindSpore
def run_mindspore(shape: tuple) -> dict:
    import mindspore as ms
    from mindspore import ops
    from mindspore.experimental import optim

    def trained(model, steps, loss_fn, sharded: bool) -> dict:
        opt = optim.AdamW(model.trainable_params(), lr=LR["adamw"])
        grad_fn = ms.value_and_grad(lambda ids, t: loss_fn(model(ids), t) / len(steps[0]),
                                    None, opt.parameters)
        losses, snapshots = [], []
        for micro in steps:
            total = 0.0
            for m, (ids, targets) in enumerate(micro):
                if sharded:
                    model.set_requires_gradient_sync(m == len(micro) - 1)
                loss, grads = grad_fn(ms.Tensor(ids), ms.Tensor(targets))
                total += float(loss.asnumpy()) * len(micro)
            opt(grads)  # the last microbatch delivers the accumulated sum
            losses.append(total / len(micro))
            named = [(mindspore_name(n), p) for n, p in model.parameters_and_names()]
            snapshots.append(_shard_records(named, lambda p: p.asnumpy().copy()) if sharded
                             else {n: p.asnumpy().copy() for n, p in named})
        return {"losses": losses, "params": snapshots}

    def parallel_loss(logits, target):
        with hp.loss_parallel():
            return core_tp.cross_entropy(logits, target)

    mesh = hp.init_device_mesh("cpu", shape, mesh_dim_names=NAMES)
    dp_rank, dp_size = _dp_coordinates(mesh, shape)
    out = {"reference": trained(mindspore_model(), [[b] for b in _whole_batches(dp_size)],
                                ops.cross_entropy, sharded=False)}
    model = hp.parallelize_module(mindspore_model(recompute=True), mesh["tp"],
                                  plan(core_tp, "sequence", local_norms=True))
    for unit in (model.attn, model.ffn, model):
        hp.fully_shard(unit, mesh=mesh["replicate", "shard"])
    out["parallel"] = trained(model, _micro_slices(dp_rank, dp_size, shape[2]), parallel_loss,
                              sharded=True)
    out["dp_rank"] = dp_rank
    return out


def run(backend: str, shape: tuple) -> dict:
    shape = tuple(shape)
    return run_torch(shape) if backend == "torch" else run_mindspore(shape)
