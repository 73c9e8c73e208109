"""Rank side of tests/test_core_tensor_parallel.py: the core's tensor parallelism
(hyper_parallel.tensor_parallel) trained on 2 ranks.

- torch: the same model, init and data under torch's own DTensor tensor parallelism and
  under the core's styles, step by step: losses, the gradients of the first step and the
  parameters after every step, each rank's local blocks (a DTensor's gradient in its
  parameter's layout, so a sequence-parallel norm's Partial gradient is summed as torch's
  optimizer sums it).
- MindSpore: the core's styles at tp2 against the same model trained in one process on the
  whole batch: losses and the parameters after every step, as local blocks with their
  recorded layouts (assembled in the test process).
Each returns plain numpy; the test compares.
"""

from __future__ import annotations

import hyper_parallel as hp
from hyper_parallel import tensor_parallel as core_tp
from tests.core_tp_models import (
    batches, mindspore_model, mindspore_name, plan, targets_for, torch_model)

TP = 2
PLANS = ("replicated", "sequence", "layouts")
LR = {"sgd": 0.1, "adamw": 0.01}


def _layout_record(param) -> dict | None:
    layout = core_tp.tensor_parallel_layout(param)
    if layout is None:
        return None
    return {"placement": repr(layout.placement), "whole_shape": layout.whole_shape,
            "offset": layout.offset}


def _calls(window) -> dict:
    """``{op: calls}`` over the tensor-parallel mesh dim in a ``track_comms`` window."""
    return {op: window.calls(op, dim="tp") for op in ("all_gather", "reduce_scatter",
                                                      "all_reduce")}


# ---------------------------------------------------------------- torch
def _torch_optimizer(kind, params):
    import torch

    cls = torch.optim.SGD if kind == "sgd" else torch.optim.AdamW
    return cls(params, lr=LR[kind], foreach=False)


def _torch_local(value):
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach().numpy().copy()
    return value.detach().numpy().copy()


def _torch_grad(param):
    from torch.distributed.tensor import DTensor

    grad = param.grad
    if isinstance(grad, DTensor):  # a Partial gradient summed, as the optimizer step does
        grad = grad.redistribute(placements=param.placements)
    return _torch_local(grad)


def _torch_train(model, kind: str, plan_kind: str, loss_context, cross_entropy) -> dict:
    import torch

    opt = _torch_optimizer(kind, list(model.parameters()))
    losses, grads, params, counts = [], None, [], None
    for ids, targets in batches():
        target = torch.from_numpy(targets_for(targets, plan_kind, TP))
        with loss_context(), hp.track_comms() as window:
            loss = cross_entropy(model(torch.from_numpy(ids)), target)
            loss.backward()
        counts = counts or _calls(window)
        losses.append(float(_torch_local(loss)))
        if grads is None:
            grads = {n: _torch_grad(p) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        params.append({n: _torch_local(p) for n, p in model.named_parameters()})
    return {"losses": losses, "grads": grads, "params": params, "calls": counts}


def run_torch_against_dtensor(plan_kind: str, kind: str, dp: int = 1) -> dict:
    """One plan and optimizer, under torch's DTensor TP and under the core's styles."""
    import contextlib

    import torch.distributed.tensor as torch_placements
    import torch.distributed.tensor.parallel as torch_tp
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, TP), mesh_dim_names=("dp", "tp"))["tp"]

    class TorchNames:  # torch's styles with torch's placements
        Shard, Replicate = torch_placements.Shard, torch_placements.Replicate

    for name in ("ColwiseParallel", "RowwiseParallel", "SequenceParallel",
                 "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"):
        setattr(TorchNames, name, getattr(torch_tp, name))
    sequence = plan_kind == "sequence"
    reference = torch_tp.parallelize_module(torch_model(), mesh, plan(TorchNames, plan_kind))
    torch_run = _torch_train(reference, kind, plan_kind,
                             torch_tp.loss_parallel if sequence else contextlib.nullcontext,
                             F.cross_entropy)
    model = core_tp.parallelize_module(torch_model(), mesh, plan(core_tp, plan_kind))
    core_run = _torch_train(model, kind, plan_kind,
                            core_tp.loss_parallel if sequence else contextlib.nullcontext,
                            core_tp.cross_entropy if sequence else F.cross_entropy)
    core_run["layouts"] = {n: _layout_record(p) for n, p in model.named_parameters()}
    return {"torch": torch_run, "core": core_run}


# ---------------------------------------------------------------- MindSpore
def _ms_train(model, kind: str, loss_fn, ids_of, targets_of) -> dict:
    import mindspore as ms
    from mindspore.experimental import optim

    params = model.trainable_params()
    cls = optim.SGD if kind == "sgd" else optim.AdamW
    opt = cls(params, lr=LR[kind])

    def forward(ids, target):
        return loss_fn(model(ids), target)

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    losses, snapshots, counts = [], [], None
    for ids, targets in batches():
        with hp.track_comms() as window:
            loss, grads = grad_fn(ms.Tensor(ids_of(ids)), ms.Tensor(targets_of(targets)))
            loss.asnumpy()  # the step's collectives have run
        counts = counts or _calls(window)
        opt(grads)
        losses.append(float(loss.asnumpy()))
        snapshots.append({mindspore_name(n): p.asnumpy().copy()
                          for n, p in model.parameters_and_names()})
    return {"losses": losses, "params": snapshots, "calls": counts, "grads": grads,
            "layouts": {mindspore_name(n): _layout_record(p)
                        for n, p in model.parameters_and_names()}}


def run_mindspore_against_one_process(plan_kind: str, kind: str, dp: int = 1) -> dict:
    """The core's styles at tp2, and the same model trained whole in this process."""
    from mindspore import ops

    def whole_loss(logits, target):
        return ops.cross_entropy(logits, target)

    reference = _ms_train(mindspore_model(), kind, whole_loss, lambda ids: ids,
                          lambda targets: targets_for(targets, "replicated", TP))
    mesh = hp.init_device_mesh("cpu", (dp, TP), mesh_dim_names=("dp", "tp"))["tp"]
    model = hp.parallelize_module(mindspore_model(), mesh,
                                  plan(core_tp, plan_kind, colwise_embedding=False))
    if plan_kind == "sequence":
        def parallel_loss(logits, target):
            with hp.loss_parallel():
                return core_tp.cross_entropy(logits, target)
    else:
        parallel_loss = whole_loss
    parallel = _ms_train(model, kind, parallel_loss, lambda ids: ids,
                         lambda targets: targets_for(targets, plan_kind, TP))
    parallel.pop("grads")
    reference.pop("grads")
    return {"reference": reference, "core": parallel}


def run_all(backend: str, dp: int = 1, plans: tuple = PLANS) -> dict:
    """Every plan and optimizer over ``mesh["tp"]`` of a (dp, tp) mesh: with ``dp`` > 1
    the tensor-parallel groups are not the world (every dp group trains the same batch)."""
    runner = run_torch_against_dtensor if backend == "torch" \
        else run_mindspore_against_one_process
    return {f"{plan_kind}-{kind}": runner(plan_kind, kind, dp)
            for plan_kind in plans for kind in ("sgd", "adamw")}
