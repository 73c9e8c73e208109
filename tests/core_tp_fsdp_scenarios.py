"""Rank side of tests/test_core_tp_fully_shard.py: fully_shard over the core's tensor
parallelism on 4 ranks, a (dp=2, tp=2) mesh, rank = 2 * dp + tp.

The language model of tests/core_tp_models.py under torchtitan's sequence-parallel plan
(``parallelize_module(model, mesh["tp"], plan)``), then ``fully_shard(unit,
mesh=mesh["dp"])`` for the attention, the MLP and the root, trained with AdamW on this
rank's dp slice of each batch (one sequence; the ranks of a tp group read the same one),
in each configuration of ``CONFIGS``:

- torch: the same under torch's own DTensor tensor parallelism and FSDP2 (``fully_shard``
  and ``MixedPrecisionPolicy`` of torch.distributed.fsdp): losses and every rank's local
  shard after every step;
- MindSpore: against the model trained whole in one process on the whole batch (float32):
  losses, and every parameter's local shard with where it lies (the dp shard's rows inside
  the recorded tensor-parallel block), assembled in the test process.

Each returns plain numpy; the test compares.
"""

from __future__ import annotations

import hyper_parallel as hp
from hyper_parallel import tensor_parallel as core_tp
from hyper_parallel.fully_shard.param import fsdp_param_of
from tests.core_tp_models import batches, mindspore_model, mindspore_name, plan, targets_for, torch_model
from tests.core_tp_scenarios import refusals

DP, TP = 2, 2
LR = 0.01
#: name -> (low precision param dtype or None, reshard_after_forward of the blocks)
CONFIGS = {"float32": (None, True), "float32-keep-gathered": (None, False),
           "mixed": ("low", True)}
LOW = {"torch": "bfloat16", "mindspore": "float16"}  # MindSpore CPU has no bf16 matmul


def _slices(dp_rank: int) -> list:
    """``(ids, targets)`` of this dp rank's sequence of each batch (targets rank-major, as
    the sequence plan's head rows are)."""
    rows = slice(dp_rank, dp_rank + 1)
    return [(ids[rows], targets_for(targets[rows], "sequence", TP)) for ids, targets in batches()]


def _layout_record(param) -> dict | None:
    layout = core_tp.tensor_parallel_layout(param)
    if layout is None:
        return None
    return {"placement": repr(layout.placement), "whole_shape": layout.whole_shape,
            "offset": layout.offset}


def _shard_records(named: list, to_numpy) -> dict:
    """Per parameter: this rank's shard without padding rows, where its rows start in the
    tensor-parallel block, and the layout recorded on the sharded parameter."""
    out = {}
    for name, param in named:
        fp = fsdp_param_of(param)
        values = to_numpy(param)
        out[name] = {"values": values[:fp.local_rows], "start": fp.start,
                     "layout": _layout_record(param)}
    return out


def _wrap(model, mesh, config: str, backend: str) -> None:
    low, reshard = CONFIGS[config]
    mp = hp.MixedPrecisionPolicy(param_dtype=LOW[backend] if low else None,
                                 reduce_dtype="float32" if low else None)
    for unit in (model.attn, model.ffn):
        hp.fully_shard(unit, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard)
    hp.fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


def _refused_on_the_whole_mesh(model, mesh) -> dict:
    """fully_shard over a mesh whose ranks hold other tensor-parallel blocks: the error,
    and whether the module stayed as it was."""
    platform = hp.get_platform()
    before = [(id(p), type(sub)) for _, sub in platform.named_modules(model)
              for _, p in platform.direct_params(sub)]
    try:
        hp.fully_shard(model.ffn, mesh=mesh)
        error = None
    except ValueError as caught:
        error = str(caught)
    after = [(id(p), type(sub)) for _, sub in platform.named_modules(model)
             for _, p in platform.direct_params(sub)]
    return {"error": error, "unchanged": before == after}


# ---------------------------------------------------------------- torch
def _torch_train(model, dp_rank: int, loss_context, cross_entropy) -> dict:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, shards = [], []
    for ids, targets in _slices(dp_rank):
        with loss_context():
            loss = cross_entropy(model(torch.from_numpy(ids)), torch.from_numpy(targets))
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float((loss.to_local() if hasattr(loss, "to_local") else loss).detach()))
        shards.append({n: p.to_local().detach().float().numpy().copy()
                       for n, p in model.named_parameters()})
    return {"losses": losses, "shards": shards}


def _torch_config(config: str, mesh, dp_rank: int, directory: str) -> dict:
    import torch
    import torch.distributed.tensor as torch_placements
    import torch.distributed.tensor.parallel as torch_tp
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    class TorchNames:  # torch's styles with torch's placements
        Shard, Replicate = torch_placements.Shard, torch_placements.Replicate
        ColwiseParallel, RowwiseParallel = torch_tp.ColwiseParallel, torch_tp.RowwiseParallel
        SequenceParallel, PrepareModuleInput = torch_tp.SequenceParallel, torch_tp.PrepareModuleInput
        PrepareModuleInputOutput = torch_tp.PrepareModuleInputOutput

    low, reshard = CONFIGS[config]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if low else None,
                              reduce_dtype=torch.float32 if low else None)
    theirs = torch_tp.parallelize_module(torch_model(), mesh["tp"], plan(TorchNames, "sequence"))
    for unit in (theirs.attn, theirs.ffn):
        fully_shard(unit, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(theirs, mesh=mesh["dp"], mp_policy=mp)
    ours = core_tp.parallelize_module(torch_model(), mesh["tp"], plan(core_tp, "sequence"))
    _wrap(ours, mesh, config, "torch")
    core = _torch_train(ours, dp_rank, core_tp.loss_parallel, core_tp.cross_entropy)
    core["layouts"] = {n: _layout_record(p) for n, p in ours.named_parameters()}
    core["refusals"] = refusals(ours, None, directory)
    return {"fsdp2": _torch_train(theirs, dp_rank, torch_tp.loss_parallel, F.cross_entropy),
            "core": core}


def run_torch(directory: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    out = {config: _torch_config(config, mesh, dp_rank, directory) for config in CONFIGS}
    model = core_tp.parallelize_module(torch_model(), mesh["tp"], plan(core_tp, "sequence"))
    out["whole_mesh"] = _refused_on_the_whole_mesh(model, mesh)
    return out


# ---------------------------------------------------------------- MindSpore
def _ms_train(model, slices: list, loss_fn, sharded: bool) -> dict:
    import mindspore as ms
    from mindspore.experimental import optim

    opt = optim.AdamW(model.trainable_params(), lr=LR)

    def forward(ids, target):
        return loss_fn(model(ids), target)

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    losses, snapshots, grads = [], [], None
    for ids, targets in slices:
        loss, grads = grad_fn(ms.Tensor(ids), ms.Tensor(targets))
        opt(grads)
        losses.append(float(loss.asnumpy()))
        named = [(mindspore_name(n), p) for n, p in model.parameters_and_names()]
        snapshots.append(_shard_records(named, lambda p: p.asnumpy().copy()) if sharded
                         else {n: p.asnumpy().copy() for n, p in named})
    return {"losses": losses, "params": snapshots, "grads": grads}


def run_mindspore(directory: str) -> dict:
    from mindspore import ops

    def whole_loss(logits, target):
        return ops.cross_entropy(logits, target)

    def parallel_loss(logits, target):
        with hp.loss_parallel():
            return core_tp.cross_entropy(logits, target)

    whole = [(ids, targets_for(targets, "replicated", TP)) for ids, targets in batches()]
    out = {"reference": _ms_train(mindspore_model(), whole, whole_loss, sharded=False)}
    out["reference"].pop("grads")
    mesh = hp.init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    for config in CONFIGS:
        model = hp.parallelize_module(mindspore_model(), mesh["tp"], plan(core_tp, "sequence"))
        _wrap(model, mesh, config, "mindspore")
        out[config] = _ms_train(model, _slices(dp_rank), parallel_loss, sharded=True)
        out[config]["refusals"] = refusals(model, out[config].pop("grads"), directory)
    model = hp.parallelize_module(mindspore_model(), mesh["tp"], plan(core_tp, "sequence"))
    out["whole_mesh"] = _refused_on_the_whole_mesh(model, mesh)
    return out


def run_all(backend: str, directory: str) -> dict:
    return run_torch(directory) if backend == "torch" else run_mindspore(directory)
