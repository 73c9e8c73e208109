"""Rank side of tests/test_core_tp_fully_shard.py: fully_shard over the core's tensor
parallelism on 4 ranks, a (dp=2, tp=2) mesh, rank = 2 * dp + tp.

The language model of tests/core_tp_models.py under torchtitan's sequence-parallel plan
(``parallelize_module(model, mesh["tp"], plan)``), then ``fully_shard(unit,
mesh=mesh["dp"])`` for the attention, the MLP and the root, trained with AdamW on this
rank's dp slice of each batch (one sequence; the ranks of a tp group read the same one),
in each configuration of ``CONFIGS`` (``clipped``: SGD, whose steps clipping scales, with
``hp.clip_grad_norm_`` before each step):

- torch: the same under torch's own DTensor tensor parallelism and FSDP2 (``fully_shard``
  and ``MixedPrecisionPolicy`` of torch.distributed.fsdp, ``torch.nn.utils.
  clip_grad_norm_``): losses, norms and every rank's local shard after every step; and
  the norms of the model trained whole in one process;
- MindSpore: against the model trained whole in one process on the whole batch (float32):
  losses, and every parameter's local shard with where it lies (the dp shard's rows inside
  the recorded tensor-parallel block), assembled in the test process; norms against the
  norm of the whole gradients.
- on both, ``hp.clip_grad_norm_`` of the tensor-parallel model without fully_shard, one
  step on the whole batch, against the one-process norm of the first step;
- on both, a checkpoint of the ``float32`` model after training, loaded into a fresh model
  of the same layout (its shards) and into the plain model on every rank (whole values);
  its full state dict and its export.

Each returns plain numpy; the test compares.
"""

from __future__ import annotations

import os

import numpy as np

import hyper_parallel as hp
from hyper_parallel import tensor_parallel as core_tp
from hyper_parallel.fully_shard.param import fsdp_param_of
from tests.core_tp_models import batches, mindspore_model, mindspore_name, plan, targets_for, torch_model
from tests.core_tp_scenarios import _layout_record

DP, TP = 2, 2
LR = {"adamw": 0.01, "sgd": 0.1}
MAX_NORM = 0.5  # below every step's gradient norm: each step clips
#: name -> (low precision param dtype or None, reshard_after_forward of the blocks, clipped)
CONFIGS = {"float32": (None, True, False), "float32-keep-gathered": (None, False, False),
           "mixed": ("low", True, False), "clipped": (None, True, True)}
LOW = {"torch": "bfloat16", "mindspore": "float16"}  # MindSpore CPU has no bf16 matmul


def _slices(dp_rank: int) -> list:
    """``(ids, targets)`` of this dp rank's sequence of each batch (targets rank-major, as
    the sequence plan's head rows are)."""
    rows = slice(dp_rank, dp_rank + 1)
    return [(ids[rows], targets_for(targets[rows], "sequence", TP)) for ids, targets in batches()]


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


def _round_trip(model, fresh, plain, directory: str, to_numpy) -> dict:
    """Save ``model``'s checkpoint, load it into ``fresh`` (the same layout, initial
    values) and ``plain`` (one process's model, on every rank): their values before and
    after; and ``model``'s full state dict (every rank) and export (read back on rank 0),
    under torch's names."""
    platform = hp.get_platform()
    path = os.path.join(directory, "tp-fsdp-checkpoint")

    def shards(m):
        return _shard_records([(n, p) for n, p in _named(m)], to_numpy)

    def whole(m):
        return {n: to_numpy(p) for n, p in _named(m)}

    hp.save_checkpoint(path, model)
    out = {"fresh_before": shards(fresh)}
    hp.load_checkpoint(path, fresh)
    out["fresh_loaded"] = shards(fresh)
    hp.load_checkpoint(path, plain)
    out["plain_loaded"] = whole(plain)
    out["full_state"] = {mindspore_name(n): v for n, v in
                         hp.get_full_state_dict(model, rank0_only=False).items()}
    exported = os.path.join(directory, f"tp-fsdp-export-{platform.name}")
    hp.export_full(exported, model, key_map=hp.torch_nn_names)
    out["export"] = None
    if platform.rank() == 0:
        from safetensors.numpy import load_file

        out["export"] = dict(load_file(os.path.join(exported, "model.safetensors")))
    out["rank"] = platform.rank()
    return out


def _named(model) -> list:
    """``[(torch-style name, parameter)]``."""
    platform = hp.get_platform()
    return [(mindspore_name(f"{prefix}.{attr}" if prefix else attr), param)
            for prefix, sub in platform.named_modules(model)
            for attr, param in platform.direct_params(sub)]


def _wrapped_plain(model, mesh):
    """``model`` without tensor parallelism under fully_shard over ``mesh["dp"]``."""
    for unit in (model.attn, model.ffn, model):
        hp.fully_shard(unit, mesh=mesh["dp"])
    return model


def _wrap(model, mesh, config: str, backend: str) -> None:
    low, reshard, _ = CONFIGS[config]
    mp = hp.MixedPrecisionPolicy(param_dtype=LOW[backend] if low else None,
                                 reduce_dtype="float32" if low else None)
    for unit in (model.attn, model.ffn):
        hp.fully_shard(unit, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard)
    hp.fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


def _refused_after_fully_shard(model, mesh) -> dict:
    """parallelize_module over a model fully_shard manages: the error, and whether the
    module stayed as it was."""
    platform = hp.get_platform()

    def state():
        return [(id(p), type(sub), core_tp.tensor_parallel_layout(p))
                for _, sub in platform.named_modules(model) for _, p in platform.direct_params(sub)]

    before = state()
    try:
        core_tp.parallelize_module(model, mesh["tp"], {"ffn.w1": core_tp.ColwiseParallel()})
        error = None
    except ValueError as caught:
        error = str(caught)
    return {"error": error, "unchanged": before == state()}


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
def _float(value) -> float:
    value = value.full_tensor() if hasattr(value, "full_tensor") else value
    return float(value.detach())


def _torch_train(model, slices: list, loss_context, cross_entropy, clip=None) -> dict:
    """``clip(parameters)``: clip before each step (SGD), returning the norm; else AdamW."""
    import torch

    if clip is None:
        opt = torch.optim.AdamW(model.parameters(), lr=LR["adamw"], foreach=False)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=LR["sgd"], foreach=False)
    losses, shards, norms = [], [], []
    for ids, targets in slices:
        with loss_context():
            loss = cross_entropy(model(torch.from_numpy(ids)), torch.from_numpy(targets))
            loss.backward()
        if clip is not None:
            norms.append(_float(clip(list(model.parameters()))))
        opt.step()
        opt.zero_grad()
        losses.append(_float(loss))
        shards.append({n: (p.to_local() if hasattr(p, "to_local") else p).detach().float()
                       .numpy().copy() for n, p in model.named_parameters()})
    return {"losses": losses, "shards": shards, "norms": norms}


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

    low, reshard, clipped = CONFIGS[config]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if low else None,
                              reduce_dtype=torch.float32 if low else None)
    theirs = torch_tp.parallelize_module(torch_model(), mesh["tp"], plan(TorchNames, "sequence"))
    for unit in (theirs.attn, theirs.ffn):
        fully_shard(unit, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(theirs, mesh=mesh["dp"], mp_policy=mp)
    ours = core_tp.parallelize_module(torch_model(), mesh["tp"], plan(core_tp, "sequence"))
    _wrap(ours, mesh, config, "torch")
    slices = _slices(dp_rank)
    core = _torch_train(ours, slices, core_tp.loss_parallel, core_tp.cross_entropy,
                        clip=(lambda ps: hp.clip_grad_norm_(ps, MAX_NORM)) if clipped else None)
    core["layouts"] = {n: _layout_record(p) for n, p in ours.named_parameters()}
    if config == "float32":
        fresh = core_tp.parallelize_module(torch_model(), mesh["tp"], plan(core_tp, "sequence"))
        _wrap(fresh, mesh, config, "torch")
        core["tp_after_fully_shard"] = _refused_after_fully_shard(
            _wrapped_plain(torch_model(), mesh), mesh)
        core["checkpoint"] = _round_trip(
            ours, fresh, torch_model(), directory,
            lambda p: (p.to_local() if hasattr(p, "to_local") else p).detach().numpy().copy())
    fsdp2 = _torch_train(theirs, slices, torch_tp.loss_parallel, F.cross_entropy,
                         clip=(lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM))
                         if clipped else None)
    return {"fsdp2": fsdp2, "core": core}


def run_torch(directory: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    import contextlib

    import torch
    import torch.nn.functional as F

    out = {config: _torch_config(config, mesh, dp_rank, directory) for config in CONFIGS}
    whole = [(ids, targets_for(targets, "replicated", TP)) for ids, targets in batches()]
    out["reference"] = _torch_train(torch_model(), whole, contextlib.nullcontext,
                                    F.cross_entropy,
                                    lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM))
    model = core_tp.parallelize_module(torch_model(), mesh["tp"], plan(core_tp, "sequence"))
    ids, targets = batches()[0]
    with core_tp.loss_parallel():
        core_tp.cross_entropy(model(torch.from_numpy(ids)), torch.from_numpy(
            targets_for(targets, "sequence", TP))).backward()
    out["tp_only_norm"] = _float(hp.clip_grad_norm_(list(model.parameters()), MAX_NORM))
    out["whole_mesh"] = _refused_on_the_whole_mesh(model, mesh)
    return out


# ---------------------------------------------------------------- MindSpore
def _ms_train(model, slices: list, loss_fn, sharded: bool, clip=None) -> dict:
    """``clip(parameters, grads)``: ``(clipped grads, norm)`` before each step (SGD);
    else AdamW."""
    import mindspore as ms
    from mindspore.experimental import optim

    if clip is None:
        opt = optim.AdamW(model.trainable_params(), lr=LR["adamw"])
    else:
        opt = optim.SGD(model.trainable_params(), lr=LR["sgd"])

    def forward(ids, target):
        return loss_fn(model(ids), target)

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    losses, snapshots, grads, norms = [], [], None, []
    for ids, targets in slices:
        loss, grads = grad_fn(ms.Tensor(ids), ms.Tensor(targets))
        if clip is not None:
            grads, norm = clip(opt.parameters, grads)
            norms.append(float(norm))
        opt(grads)
        losses.append(float(loss.asnumpy()))
        named = [(mindspore_name(n), p) for n, p in model.parameters_and_names()]
        snapshots.append(_shard_records(named, lambda p: p.asnumpy().copy()) if sharded
                         else {n: p.asnumpy().copy() for n, p in named})
    return {"losses": losses, "params": snapshots, "grads": grads, "norms": norms}


def run_mindspore(directory: str) -> dict:
    from mindspore import ops

    def whole_loss(logits, target):
        return ops.cross_entropy(logits, target)

    def parallel_loss(logits, target):
        with hp.loss_parallel():
            return core_tp.cross_entropy(logits, target)

    def clip(params, grads):
        return hp.clip_grad_norm_(params, MAX_NORM, grads=list(grads))

    def whole_clip(params, grads):
        """torch's clipping of the whole gradients, as ``torch.nn.utils.clip_grad_norm_``."""
        norm = float(np.sqrt(sum(float((g.asnumpy().astype(np.float64) ** 2).sum())
                                 for g in grads)))
        return tuple(g * min(MAX_NORM / (norm + 1e-6), 1.0) for g in grads), norm

    whole = [(ids, targets_for(targets, "replicated", TP)) for ids, targets in batches()]
    out = {"reference": _ms_train(mindspore_model(), whole, whole_loss, sharded=False),
           "clipped_reference": _ms_train(mindspore_model(), whole, whole_loss, sharded=False,
                                          clip=whole_clip)}
    for key in ("reference", "clipped_reference"):
        out[key].pop("grads")
    mesh = hp.init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    for config in CONFIGS:
        model = hp.parallelize_module(mindspore_model(), mesh["tp"], plan(core_tp, "sequence"))
        _wrap(model, mesh, config, "mindspore")
        out[config] = _ms_train(model, _slices(dp_rank), parallel_loss, sharded=True,
                                clip=clip if CONFIGS[config][2] else None)
        out[config].pop("grads")
        if config == "float32":
            fresh = hp.parallelize_module(mindspore_model(), mesh["tp"], plan(core_tp, "sequence"))
            _wrap(fresh, mesh, config, "mindspore")
            out[config]["tp_after_fully_shard"] = _refused_after_fully_shard(
                _wrapped_plain(mindspore_model(), mesh), mesh)
            out[config]["checkpoint"] = _round_trip(model, fresh, mindspore_model(), directory,
                                                    lambda p: p.asnumpy().copy())
    model = hp.parallelize_module(mindspore_model(), mesh["tp"], plan(core_tp, "sequence"))
    tp_only = _ms_train(model, [(ids, targets_for(targets, "sequence", TP))
                                for ids, targets in batches()[:1]],
                        parallel_loss, sharded=False, clip=clip)
    out["tp_only_norm"] = tp_only["norms"][0]
    out["whole_mesh"] = _refused_on_the_whole_mesh(model, mesh)
    return out


def run_all(backend: str, directory: str) -> dict:
    return run_torch(directory) if backend == "torch" else run_mindspore(directory)
