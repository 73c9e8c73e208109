"""Rank side of tests/test_core_tp_checkpoints.py: state dicts, export and checkpoints of
the core's tensor parallelism, and checkpoints moved between frameworks and layouts.

The language model of tests/core_tp_models.py under torchtitan's sequence-parallel plan
(the same model in each framework; MindSpore's names become torch's through
``hp.torch_nn_names`` in every checkpoint and export), AdamW. ``TRAIN`` steps, then a
checkpoint, then one step more (the losses a resumed run must reproduce):

- ``tp2_run`` (2 ranks, both frameworks, the core's styles alone): the full and the
  sharded state dicts of model and optimizer, both loaded back into a fresh model;
  ``save_checkpoint``, ``export_full`` and a checkpoint whose whole shape differs from
  the model's;
- ``torch_dp2_tp2_save`` (4 ranks, torch's own DTensor tensor parallelism under
  ``hp.fully_shard`` over ``mesh["dp"]``): the checkpoint MindSpore resumes;
- ``mindspore_dp2_tp2_run`` (4 ranks): that checkpoint resumed at (dp=2, tp=2) by the core's
  styles under fully_shard, the model built under ``no_init_parameters()``; its own
  checkpoint (resumed on torch at 1 rank by the test process); and ``tp2_run``'s
  MindSpore checkpoint resumed under FSDP over 4 ranks;
- ``mindspore_dp2_tp2_eager`` (4 ranks, slow): the same resumed by an eager build; its
  state dicts and export.

Ranks of one tensor-parallel group train the same data-parallel row of each batch (as in
tests/core_tp_fsdp_scenarios.py); the tp2 and FSDP runs train the whole batch on every
rank. Each returns plain numpy; the test compares.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

import hyper_parallel as hp
from hyper_parallel import tensor_parallel as core_tp
from tests.core_tp_fsdp_scenarios import DP, LR, TP, _wrap
from tests.core_tp_models import (
    batches, mindspore_model, mindspore_name, plan, targets_for, torch_model)

TRAIN = batches()[:1]  # before the checkpoint
NEXT = batches()[2]    # the step after it
AFTER = batches(seed=2)[0]  # the step after the resumed run's own checkpoint
KEYS = hp.torch_nn_names
#: the whole shape a doctored checkpoint claims for the head (the model's is (16, 8))
OTHER_HEAD_SHAPE = [32, 8]


def torch_key(key: str) -> str:
    """A state dict key with MindSpore's parameter names as torch's."""
    if key.startswith("optim."):
        state, _, name = key[len("optim."):].partition(".")
        return f"optim.{state}.{mindspore_name(name)}" if name else key
    return mindspore_name(key)


def _numpy(platform, value) -> np.ndarray:
    return np.asarray(platform.to_numpy(value)).copy()


class Run:
    """A model and its optimizer in one framework, trained a step at a time."""

    def __init__(self, backend: str, model, whole_batch: bool, dp_rank: int = 0):
        self.backend, self.model = backend, model
        self.tensor_parallel = any(core_tp.tensor_parallel_layout(p) is not None
                                   for p in _params(model))
        self.rows = slice(None) if whole_batch else slice(dp_rank, dp_rank + 1)
        if backend == "torch":
            import torch

            self.opt = torch.optim.AdamW(model.parameters(), lr=LR["adamw"], foreach=False)
        else:
            import mindspore as ms
            from mindspore.experimental import optim

            self.opt = optim.AdamW(model.trainable_params(), lr=LR["adamw"])
            self.grad_fn = ms.value_and_grad(self._loss, None, self.opt.parameters)

    def _loss(self, ids, targets):
        if not self.tensor_parallel:
            return self._cross_entropy(self.model(ids), targets)
        with core_tp.loss_parallel():
            return core_tp.cross_entropy(self.model(ids), targets)

    def _cross_entropy(self, logits, targets):
        if self.backend == "torch":
            import torch.nn.functional as F

            return F.cross_entropy(logits, targets)
        from mindspore import ops

        return ops.cross_entropy(logits, targets)

    def step(self, batch) -> float:
        ids, targets = batch[0][self.rows], batch[1][self.rows]
        targets = targets_for(targets, "sequence" if self.tensor_parallel else "replicated", TP)
        if self.backend == "torch":
            import torch

            loss = self._loss(torch.from_numpy(ids), torch.from_numpy(targets))
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            return float(loss.detach())
        import mindspore as ms

        loss, grads = self.grad_fn(ms.Tensor(ids), ms.Tensor(targets))
        self.opt(grads)
        return float(loss.asnumpy())

    def full_state(self, optimizer: bool = True) -> dict:
        """The whole values (torch's names), on every rank."""
        full = hp.get_full_state_dict(self.model, self.opt if optimizer else None,
                                      rank0_only=False)
        return {torch_key(k): v for k, v in full.items()}


def _params(model) -> list:
    platform = hp.get_platform()
    return [p for _, sub in platform.named_modules(model) for _, p in platform.direct_params(sub)]


def _core_model(backend: str, mesh, model=None):
    """``model`` (the framework's plain model by default) split by the core's styles."""
    model = _plain_model(backend) if model is None else model
    return core_tp.parallelize_module(model, mesh, plan(core_tp, "sequence"))


def _plain_model(backend: str):
    return torch_model() if backend == "torch" else mindspore_model()


def state_dict_round_trips(run: Run, fresh: list) -> dict:
    """``run``'s sharded state dict (each value's box and data) and full state dict (model
    and optimizer), each loaded by ``set_state_dict`` into a fresh run of the same layout
    (``fresh``: two of them): the full state of those after."""
    platform = hp.get_platform()
    sharded = hp.get_state_dict(run.model, run.opt)
    boxes = {torch_key(k): (v.box(), _numpy(platform, v.local)) for k, v in sharded.items()}
    full = hp.get_full_state_dict(run.model, run.opt, rank0_only=False)
    before = fresh[0].full_state()
    hp.set_state_dict(fresh[0].model, sharded, fresh[0].opt)
    hp.set_state_dict(fresh[1].model, full, fresh[1].opt)
    return {"boxes": boxes, "full": {torch_key(k): v for k, v in full.items()},
            "fresh_before": before, "from_sharded": fresh[0].full_state(),
            "from_full": fresh[1].full_state()}


def _export(model, path: str) -> dict | None:
    """``export_full`` to ``path``; rank 0 reads the file back."""
    hp.export_full(path, model, key_map=KEYS)
    if hp.get_platform().rank() != 0:
        return None
    from safetensors.numpy import load_file

    return dict(load_file(os.path.join(path, "model.safetensors")))


def _into_plain(backend: str, whole: dict) -> dict:
    """``whole`` (torch's names) loaded into the plain one-process model: its values."""
    plain = _plain_model(backend)
    hp.set_state_dict(plain, {n: whole[mindspore_name(n)] for n, _ in _named(plain)})
    return Run(backend, plain, whole_batch=True).full_state(optimizer=False)


def _refused_other_whole_shape(run: Run, saved: str, directory: str) -> dict:
    """``saved`` with the head's whole shape changed in its index, loaded into ``run``: the
    error, and whether the model and optimizer stayed as they were."""
    platform = hp.get_platform()
    doctored = os.path.join(directory, f"other-shape-{platform.name}")
    if platform.rank() == 0:
        shutil.copytree(saved, doctored)
        with open(os.path.join(doctored, "index.json"), encoding="utf-8") as file:
            index = json.load(file)
        index["tensors"]["head.weight"]["shape"] = OTHER_HEAD_SHAPE
        with open(os.path.join(doctored, "index.json"), "w", encoding="utf-8") as file:
            json.dump(index, file)
    platform.barrier()
    before = run.full_state()
    try:
        hp.load_checkpoint(doctored, run.model, run.opt, key_map=KEYS)
        error = None
    except hp.CheckpointError as caught:
        error = str(caught)
    after = run.full_state()
    return {"error": error, "unchanged": all(np.array_equal(before[k], after[k]) for k in before)}


def tp2_run(backend: str, directory: str) -> dict:
    """The core's styles alone at tp2 (2 ranks), both frameworks."""
    mesh = hp.init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))

    def build():
        return Run(backend, _core_model(backend, mesh), whole_batch=True)

    run = build()
    out = {"losses": [run.step(batch) for batch in TRAIN]}
    fresh = [build(), build()]
    out["state_dicts"] = state_dict_round_trips(run, fresh)
    out["layouts"] = {torch_key(n): _layout(p) for n, p in _named(run.model)}
    saved = os.path.join(directory, f"tp2-{backend}")
    hp.save_checkpoint(saved, run.model, run.opt, key_map=KEYS)
    out["saved"] = run.full_state()
    plain = Run(backend, _plain_model(backend), whole_batch=True)
    hp.load_checkpoint(saved, plain.model, plain.opt, key_map=KEYS)
    out["plain_loaded"] = plain.full_state()
    exported = _export(run.model, os.path.join(directory, f"export-tp2-{backend}"))
    out["export"] = exported
    out["export_in_plain"] = None if exported is None else _into_plain(backend, exported)
    out["other_whole_shape"] = _refused_other_whole_shape(fresh[0], saved, directory)
    out["next_loss"] = run.step(NEXT)
    out["after_next"] = run.full_state(optimizer=False)
    return out


def _named(model) -> list:
    platform = hp.get_platform()
    return [(f"{prefix}.{attr}" if prefix else attr, p)
            for prefix, sub in platform.named_modules(model)
            for attr, p in platform.direct_params(sub)]


def _layout(param) -> dict | None:
    layout = core_tp.tensor_parallel_layout(param)
    return None if layout is None else {"whole_shape": tuple(layout.whole_shape),
                                        "offset": tuple(layout.offset)}


# ---------------------------------------------------------------- torch, 4 ranks
def torch_dp2_tp2_save(directory: str) -> dict:
    """torch's DTensor tensor parallelism under hp.fully_shard at (dp=2, tp=2): trained,
    saved (with its whole values gathered), then one step more."""
    import torch.distributed.tensor as torch_placements
    import torch.distributed.tensor.parallel as torch_tp
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    class TorchNames:  # torch's styles with torch's placements
        Shard, Replicate = torch_placements.Shard, torch_placements.Replicate
        ColwiseParallel, RowwiseParallel = torch_tp.ColwiseParallel, torch_tp.RowwiseParallel
        SequenceParallel = torch_tp.SequenceParallel
        PrepareModuleInput = torch_tp.PrepareModuleInput
        PrepareModuleInputOutput = torch_tp.PrepareModuleInputOutput

    import torch

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = torch_tp.parallelize_module(torch_model(), mesh["tp"], plan(TorchNames, "sequence"))
    for unit in (model.attn, model.ffn, model):
        hp.fully_shard(unit, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR["adamw"], foreach=False)
    rows = slice(mesh["dp"].get_local_rank(), mesh["dp"].get_local_rank() + 1)

    def step(batch) -> float:
        ids, targets = batch[0][rows], targets_for(batch[1][rows], "sequence", TP)
        with torch_tp.loss_parallel():
            loss = F.cross_entropy(model(torch.from_numpy(ids)), torch.from_numpy(targets))
            loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.full_tensor().detach() if hasattr(loss, "full_tensor") else loss)

    losses = [step(batch) for batch in TRAIN]
    hp.save_checkpoint(os.path.join(directory, "torch-dp2-tp2"), model, opt)
    saved = hp.gather_full_state_dict(model)
    return {"losses": losses, "saved": saved, "next_loss": step(NEXT),
            "after_next": hp.gather_full_state_dict(model)}


# ---------------------------------------------------------------- MindSpore, 4 ranks
def _dp2_tp2(mesh, model=None) -> Run:
    """The core's styles under fully_shard over ``mesh["dp"]`` (``model``: the plain one by
    default), each dp row of the batch on its ranks."""
    model = _core_model("mindspore", mesh["tp"], model)
    _wrap(model, mesh, "float32", "mindspore")
    return Run("mindspore", model, whole_batch=False, dp_rank=mesh.get_local_rank("dp"))


def _starting_checkpoint(mesh, directory: str, torch_saved: str | None) -> str:
    """torch's checkpoint, or without torch one of this framework's own first steps."""
    if torch_saved is not None:
        return torch_saved
    run = _dp2_tp2(mesh)
    for batch in TRAIN:
        run.step(batch)
    start = os.path.join(directory, "mindspore-start")
    hp.save_checkpoint(start, run.model, run.opt, key_map=KEYS)
    return start


def mindspore_dp2_tp2_run(directory: str, torch_saved: str | None, tp2_saved: str) -> dict:
    """The core's styles under fully_shard at (dp=2, tp=2), the model built under
    ``no_init_parameters()``: ``torch_saved`` (torch's checkpoint; None without torch)
    resumed; its own checkpoint, then one step more; ``tp2_saved`` resumed under FSDP over
    4 ranks."""
    from mindspore.nn.utils import no_init_parameters

    mesh = hp.init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    start = _starting_checkpoint(mesh, directory, torch_saved)
    with no_init_parameters():  # the model is built without values; split and sharded after
        lazy = mindspore_model(with_values=False)
    run = _dp2_tp2(mesh, lazy)
    out = {"from_torch": _resumed(run, start)}
    saved = os.path.join(directory, "mindspore-dp2-tp2")
    hp.save_checkpoint(saved, run.model, run.opt, key_map=KEYS)
    out["saved"] = run.full_state(optimizer=False)
    out["next_loss"] = run.step(AFTER)
    out["after_next"] = run.full_state(optimizer=False)
    out["fsdp4_from_tp2"] = _fsdp_over_every_rank(tp2_saved)
    return out


def _resumed(run: Run, saved: str) -> dict:
    """``saved`` loaded into ``run``, then one step: the values loaded, the loss, the values
    after."""
    hp.load_checkpoint(saved, run.model, run.opt, key_map=KEYS)
    out = {"loaded": run.full_state(optimizer=False), "loss": run.step(NEXT)}
    out["after"] = run.full_state(optimizer=False)
    return out


def mindspore_dp2_tp2_eager(directory: str, torch_saved: str | None) -> dict:
    """The run of ``mindspore_dp2_tp2_run`` built eagerly, resumed from ``torch_saved``;
    then its state dicts and its export."""
    mesh = hp.init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    run = _dp2_tp2(mesh)
    out = {"from_torch": _resumed(run, _starting_checkpoint(mesh, directory, torch_saved))}
    out["state_dicts"] = state_dict_round_trips(run, [_dp2_tp2(mesh), _dp2_tp2(mesh)])
    exported = _export(run.model, os.path.join(directory, "export-dp2-tp2"))
    out["export"] = exported
    out["export_in_plain"] = None if exported is None else _into_plain("mindspore", exported)
    return out


def _fsdp_over_every_rank(saved: str) -> dict:
    """The plain model under fully_shard over all 4 ranks (no tensor parallelism), loaded
    from ``saved`` and trained one step on the whole batch on every rank."""
    model = mindspore_model()
    for unit in (model.attn, model.ffn, model):
        hp.fully_shard(unit)
    run = Run("mindspore", model, whole_batch=True)
    hp.load_checkpoint(saved, run.model, run.opt, key_map=KEYS)
    return {"loaded": run.full_state(), "loss": run.step(NEXT),
            "after": run.full_state(optimizer=False)}
