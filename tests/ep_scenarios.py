"""Rank side of tests/test_expert_parallel.py: the MoE model of tests/ep_models.py trained
with expert parallelism, and the same model trained in one process on the whole batch.

The mesh is torchtitan's for expert parallelism carved out of data parallelism: every rank
is a data-parallel rank (its own sequences); ``ep`` ranks split the experts
(``hp.ExpertParallel`` on ``moe.experts`` over ``mesh["ep"]``), ``efsdp`` = world / ep
ranks shard them (``fully_shard(experts, mesh=mesh["efsdp"])``, gradient divide factor the
whole data-parallel size), and the dense parts are sharded over every rank (``fully_shard``
over a 1-D mesh of the world). Each step clips the gradients (``hp.clip_grad_norm_``) and
updates the router's expert bias from the counts summed over every rank
(``hp.update_expert_bias``), as the one-process reference does on the whole batch.

Each run returns plain numpy: the losses (each rank its own sequences' mean), the gradient
norms, the whole parameters after each step (``get_full_state_dict``), the expert bias, the
per-expert row counts of each rank's first dispatch, and the state a plain model loads from
the expert-parallel checkpoint, and its exports (as the model names its values, and with
each expert written apart: ``hp.per_expert_keys``). The test compares.
"""

from __future__ import annotations

import os
import time

import numpy as np

import hyper_parallel as hp
from tests.ep_models import (
    EXPERTS, LR, SEQS, batches, mindspore_loss, mindspore_model, torch_loss, torch_model)

MAX_NORM = 1.0
COEFF = 1e-3


class Run:
    """A model and its AdamW in one framework, trained on sequences ``rows`` of each batch."""

    def __init__(self, backend: str, model, rows: slice, bias_mesh=None, micro: int = 1):
        """``micro``: micro-batches per step, gradients accumulated (synced in the last)."""
        self.backend, self.model, self.rows, self.bias_mesh = backend, model, rows, bias_mesh
        self.micro = micro
        self.params = [p for _, p in _named(model)]
        if backend == "torch":
            import torch

            self.opt = torch.optim.AdamW(self.params, lr=LR, foreach=False)
        else:
            import mindspore as ms
            from mindspore.experimental import optim

            self.opt = optim.AdamW(self.params, lr=LR)
            self.grad_fn = ms.value_and_grad(
                lambda x, t: mindspore_loss(model, x, t) / micro, None, self.opt.parameters)

    def step(self, batch) -> tuple:
        """(loss, gradient norm before clipping)."""
        pieces = zip(np.array_split(batch[0][self.rows], self.micro),
                     np.array_split(batch[1][self.rows], self.micro))
        loss, grads = 0.0, None
        for i, (x, target) in enumerate(pieces):
            if self.micro > 1:
                self.model.set_requires_gradient_sync(i == self.micro - 1)
            if self.backend == "torch":
                part = torch_loss(self.model, x, target) / self.micro
                part.backward()
                loss += float(part.detach())
            else:
                import mindspore as ms

                part, got = self.grad_fn(ms.Tensor(x), ms.Tensor(target))
                grads = got if grads is None else tuple(a + b for a, b in zip(grads, got))
                loss += float(part.asnumpy())
        if self.backend == "torch":
            norm = hp.clip_grad_norm_(self.params, MAX_NORM)
            self.opt.step()
            self.opt.zero_grad()
        else:
            grads, norm = hp.clip_grad_norm_(self.params, MAX_NORM, grads=grads)
            self.opt(grads)
        moe = self.model.moe
        hp.update_expert_bias(moe.expert_bias, moe.tokens_per_expert, self.bias_mesh,
                              coeff=COEFF)
        return loss, float(hp.get_platform().to_numpy(norm))

    def full_state(self, optimizer: bool = False) -> dict:
        full = hp.get_full_state_dict(self.model, self.opt if optimizer else None,
                                      rank0_only=False)
        return {_key(k): v for k, v in full.items()}

    def train(self, steps: list) -> dict:
        """Per step: the loss, norm, whole parameters and expert bias; and the all-to-all
        calls and bytes this rank sent over the "ep" dim in the first step."""
        out = {"losses": [], "norms": [], "params": [], "bias": []}
        for i, batch in enumerate(steps):
            with hp.track_comms() as window:
                loss, norm = self.step(batch)
            if i == 0:
                out["all_to_all"] = (window.calls("all_to_all", dim="ep"),
                                     window.nbytes("all_to_all", dim="ep"))
            out["losses"].append(loss)
            out["norms"].append(norm)
            out["params"].append(self.full_state())
            out["bias"].append(hp.get_platform().to_numpy(self.model.moe.expert_bias).copy())
        return out


def _key(key: str) -> str:
    return key.replace("_checkpoint_wrapped_module.", "")


def _named(model) -> list:
    platform = hp.get_platform()
    return [(f"{prefix}.{attr}" if prefix else attr, p)
            for prefix, sub in platform.named_modules(model)
            for attr, p in platform.direct_params(sub)]


def _model(backend: str, run: str):
    """The model of ``run``: a score function, ``-recompute`` for activation recompute
    (``-accumulate``: the same model, trained on 2 micro-batches per step; ``-hsdp``: the
    same, under HSDP with 2 replicas; ``-tp``: its dense layers split over 2 ranks;
    ``-lowp``: in low precision)."""
    score, _, variant = run.partition("-")
    return (torch_model if backend == "torch" else mindspore_model)(score, variant == "recompute")


def _counts_seen(experts) -> list:
    """Record the per-expert counts each call of ``experts`` is given (before dispatch)."""
    seen = []
    platform = hp.get_platform()

    def pre(mod, args, kwargs):
        seen.append([int(c) for c in platform.to_numpy(args[1])])

    def post(mod, args, kwargs, output):
        return None

    platform.register_forward_hooks(experts, pre, post)
    return seen


def expert_parallel(backend: str, name: str, ep: int, directory: str | None) -> dict:
    """One run (``_model``): the one-process reference and the expert-parallel run."""
    world = hp.get_platform().world_size()
    data = batches()
    reference = Run(backend, _model(backend, name), slice(None)).train(data)
    dp = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    tp = 2 if name.endswith("-tp") else 1
    if tp > 1:  # (efsdp, ep, tp): tensor parallelism on the dense parts, each pair the same rows
        mesh = hp.init_device_mesh("cpu", (world // tp // ep, ep, tp),
                                   mesh_dim_names=("efsdp", "ep", "tp"))
        experts_mesh, dense_mesh = mesh["efsdp"], mesh["efsdp", "ep"]
    elif name.endswith("-hsdp"):  # 2 replicas: (replicate, efsdp, ep) and (replicate, shard)
        mesh = hp.init_device_mesh("cpu", (2, world // 2 // ep, ep),
                                   mesh_dim_names=("replicate", "efsdp", "ep"))
        experts_mesh, dense_mesh = mesh["replicate", "efsdp"], hp.init_device_mesh(
            "cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = hp.init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        experts_mesh, dense_mesh = mesh["efsdp"], dp
    policy = hp.MixedPrecisionPolicy()
    if name.endswith("-lowp"):  # torch: bfloat16; MindSpore on CPU has no bfloat16 matmul
        policy = hp.MixedPrecisionPolicy(
            param_dtype="bfloat16" if backend == "torch" else "float16", reduce_dtype="float32")
    model = _model(backend, name)
    if tp > 1:
        hp.parallelize_module(model, mesh["tp"], {
            "proj": hp.ColwiseParallel(output_layouts=hp.Replicate()),
            "moe.shared.w1": hp.ColwiseParallel(), "moe.shared.w2": hp.RowwiseParallel()})
    hp.parallelize_module(model.moe.experts, mesh["ep"], hp.ExpertParallel())
    seen = _counts_seen(model.moe.experts)  # pre-hooks run newest first: before dispatch
    hp.fully_shard(model.moe.experts, mesh=experts_mesh, mp_policy=policy)
    model.moe.experts.set_gradient_divide_factor(world // tp)
    hp.fully_shard(model, mesh=dense_mesh, mp_policy=policy)
    rank = hp.get_platform().rank() // tp  # its data-parallel rank
    per_rank = SEQS // (world // tp)
    run = Run(backend, model, slice(rank * per_rank, (rank + 1) * per_rank), bias_mesh=dp,
              micro=2 if name.endswith("-accumulate") else 1)
    out = {"reference": reference, "ep": run.train(data), "counts": seen[0]}
    if directory is not None:
        out.update(_checkpoint(backend, name, run, directory))
        out["after_fully_shard"] = _after_fully_shard(backend, name, mesh, experts_mesh)
    return out


def _after_fully_shard(backend: str, name: str, mesh, experts_mesh) -> str:
    """The error of ExpertParallel on experts fully_shard manages already."""
    model = _model(backend, name)
    hp.fully_shard(model.moe.experts, mesh=experts_mesh)
    try:
        hp.parallelize_module(model.moe.experts, mesh["ep"], hp.ExpertParallel())
    except ValueError as error:
        return str(error)
    return "applied"


def _checkpoint(backend: str, name: str, run: Run, directory: str) -> dict:
    """Saved at the expert degree of ``run``; loaded into a plain model (one process) and
    into the model under plain FSDP over every rank; and exported (rank 0 reads the file
    back)."""
    path = os.path.join(directory, f"ep-{backend}-{name}")
    hp.save_checkpoint(path, run.model, run.opt)
    plain = Run(backend, _model(backend, name), slice(None))
    hp.load_checkpoint(path, plain.model, plain.opt)
    fsdp = _model(backend, name)  # plain FSDP over every rank, no expert parallelism
    hp.fully_shard(fsdp, mesh=hp.init_device_mesh("cpu", (hp.get_platform().world_size(),),
                                                   mesh_dim_names=("dp",)))
    fsdp = Run(backend, fsdp, slice(None))
    hp.load_checkpoint(path, fsdp.model, fsdp.opt)
    exported = os.path.join(directory, f"export-{backend}-{name}")
    hp.export_full(exported, run.model)
    per_expert = os.path.join(directory, f"export-per-expert-{backend}-{name}")
    hp.export_full(per_expert, run.model, key_map={  # as linear layers' (out, in) weights
        f"moe.experts.{w}": hp.per_expert_keys(f"moe.experts.{{expert}}.{w}.weight", EXPERTS,
                                               transpose=True) for w in ("w1", "w2")})
    out = {"saved": run.full_state(optimizer=True), "loaded": plain.full_state(optimizer=True),
           "loaded_fsdp": fsdp.full_state(optimizer=True),
           "refused_splits": _refused_splits(run.model, directory)}
    if hp.get_platform().rank() == 0:
        from safetensors.numpy import load_file

        out["exported"] = dict(load_file(os.path.join(exported, "model.safetensors")))
        out["per_expert"] = dict(load_file(os.path.join(per_expert, "model.safetensors")))
    return out


def _refused_splits(model, directory: str) -> dict:
    """Per bad use of ``hp.SplitKey``: the error, and whether its directory was left
    unwritten (export: 4 experts cut into 3; a checkpoint, which stores values whole)."""
    cuts_badly = {"moe.experts.w1": hp.per_expert_keys("w1.{expert}", EXPERTS - 1)}
    calls = {"export": lambda path: hp.export_full(path, model, key_map=cuts_badly),
             "save": lambda path: hp.save_checkpoint(path, model, key_map={
                 "moe.experts.w1": hp.per_expert_keys("w1.{expert}", EXPERTS)})}
    out = {}
    for what, call in calls.items():
        path = os.path.join(directory, f"refused-split-{what}")
        try:
            call(path)
            error = None
        except hp.CheckpointError as raised:
            error = str(raised)
        out[what] = (error, os.path.exists(path))
    return out


def run_all(backend: str, ep: int, directory: str, runs: tuple = ("softmax",),
            other_saved: str | None = None) -> dict:
    """Each run (``_model``'s names; the first one with the checkpoint), the model of
    ``other_saved`` (the other framework's checkpoint of its first run) loaded into the
    plain model here, and the seconds the job took on this rank."""
    start = time.perf_counter()
    out = {run: expert_parallel(backend, run, ep, directory if i == 0 else None)
           for i, run in enumerate(runs)}
    if other_saved is not None:
        plain = Run(backend, _model(backend, runs[0]), slice(None))
        hp.load_checkpoint(other_saved, plain.model)
        out["crossed"] = plain.full_state()
    out["seconds"] = time.perf_counter() - start
    return out


def starved(backend: str) -> dict:
    """dp2 x ep2 where ranks 0 and 1 route only to experts 2 and 3 (their router bias, set
    per rank, rules out 0 and 1): rank 0's experts receive no row, while rank 2, which holds
    the same experts, computes with them. Against the same model and biases under plain
    FSDP over the 4 ranks (no expert parallelism): each rank's losses and the whole
    parameters after each step."""
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    mesh = hp.init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("efsdp", "ep"))
    dp = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    bias = np.zeros(4, np.float32)
    if rank < 2:
        bias[:2] = -10.0
    out = {}
    for kind in ("ep", "fsdp"):
        model = _model(backend, "softmax")
        platform.copy_into(model.moe.expert_bias, platform.from_numpy(bias))
        if kind == "ep":
            hp.parallelize_module(model.moe.experts, mesh["ep"], hp.ExpertParallel())
            hp.fully_shard(model.moe.experts, mesh=mesh["efsdp"])
            model.moe.experts.set_gradient_divide_factor(world)
        hp.fully_shard(model, mesh=dp)
        out[kind] = Run(backend, model, slice(rank, rank + 1)).train(batches()[:3])
    return out


CAPACITY = 1.0  # each expert takes at most an even share of a rank's rows


def capacity(backend: str) -> dict:
    """ep2 with ``ExpertParallel(capacity_factor=CAPACITY)``, each rank its own sequences,
    against the model dropping the same rows itself (tests/ep_models.py ``kept_rows``, the
    rule of docs/expert-parallel.md) under plain FSDP over the same ranks, 3 steps: each
    rank's losses, the whole parameters after each step, and the per-expert counts each
    rank routed in its first step (so the test sees rows were dropped); the seconds it
    took."""
    start = time.perf_counter()
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    mesh = hp.init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("efsdp", "ep"))
    dp = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    build = torch_model if backend == "torch" else mindspore_model
    rows = slice(rank * SEQS // world, (rank + 1) * SEQS // world)
    out = {}
    for kind in ("ep", "fsdp"):
        model = build("softmax", False, None if kind == "ep" else CAPACITY)
        if kind == "ep":
            hp.parallelize_module(model.moe.experts, mesh["ep"],
                                  hp.ExpertParallel(capacity_factor=CAPACITY))
            seen = _counts_seen(model.moe.experts)
            hp.fully_shard(model.moe.experts, mesh=mesh["efsdp"])
            model.moe.experts.set_gradient_divide_factor(world)
        hp.fully_shard(model, mesh=dp)
        out[kind] = Run(backend, model, rows, bias_mesh=dp).train(batches()[:3])
    out["counts"] = seen[0]
    out["seconds"] = time.perf_counter() - start
    return out
