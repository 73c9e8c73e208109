"""The torch side of examples/train_lm.py: build (eagerly or on the meta device), cut it into
this rank's pipeline stages (examples/lm/pipeline.py), split it over the tensor-parallel
ranks (hyper_parallel's tensor parallelism, the same plan and names as on MindSpore), shard
each decoder layer and the root (each stage's part), and run one AdamW step (inside
hp.context_parallel where the sequence is split over context-parallel ranks; by the
pipeline schedule where there are stages)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

import hyper_parallel as hp
from examples.lm.config import VOCAB, set_initial_values
from examples.lm.expert_parallel import balance, forget_counts
from examples.lm.layout import lay_out
from examples.lm.model_torch import LlamaLM, build
from examples.lm.pipeline import Pipeline, held_row
from examples.lm.progress import peak_resident_mb


class Trainer:
    def __init__(self, size: str, mesh, mp_policy, deferred: bool, lr: float,
                 weight_decay: float, clip: float, tp_mesh=None, cp_mesh=None,
                 dp_mesh_dims=None, moe: bool = False, ep_meshes: tuple = (None, None),
                 pipeline: tuple | None = None, recompute: bool = False):
        """``mesh``: fully_shard's (None: all ranks), with its ``dp_mesh_dims``;
        ``tp_mesh``: the tensor-parallel ranks (None: no tensor parallelism), which needs
        the model built eagerly; ``cp_mesh``: the context-parallel ranks (None: none);
        ``moe``: experts in place of the MLPs, split over ``ep_meshes`` (expert_parallel.py's
        ``expert_meshes``; an expert split needs the model built eagerly); ``pipeline``:
        (the pp mesh, the schedule's name, micro-batches per step), None for no stages;
        ``recompute``: each decoder layer's forward runs again in backward."""
        torch.manual_seed(0)
        self.device = torch.device(hp.get_platform().device_type())
        if deferred:
            with torch.device("meta"):
                model = LlamaLM(size, moe)
        else:
            model = build(size, moe).to(self.device)
        self.pipeline = pipeline and Pipeline(hp, model, *pipeline, self.device)
        parts = self.pipeline.parts if self.pipeline else [model]
        for part in parts:
            lay_out(hp, part, mesh, mp_policy, dp_mesh_dims, tp_mesh, ep_meshes[0], moe,
                    recompute)
            if deferred:
                part.to_empty(device=self.device)  # allocates each rank's shards only
                part.model.init_rope()
                set_initial_values(part)
        # under pipelining the model is this rank's parts (torchtitan's model_parts)
        self.model = parts if self.pipeline else model
        self.clip, self.tensor_parallel = clip, tp_mesh is not None
        self.moe, self.every = moe, ep_meshes[1]
        self.cp_mesh = cp_mesh
        self.params = [p for part in parts for p in part.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        if self.pipeline:
            self.pipeline.start(self._cross_entropy)

    def _loss(self, ids, targets):
        """The loss over logits split on the vocabulary (a LayoutTensor, never gathered)
        under tensor parallelism, over whole logits otherwise."""
        return self._cross_entropy(self.model(ids), targets)

    def _cross_entropy(self, logits, targets):
        logits = logits.astype(torch.float32) if self.tensor_parallel else logits.float()
        with hp.loss_parallel():
            return hp.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def _tensors(self, ids: np.ndarray, targets: np.ndarray) -> tuple:
        return tuple(torch.from_numpy(a).to(self.device) for a in (ids, targets))

    def _split_sequence(self, ids, targets):
        """This rank's positions of the batch and of the rotary tables, under context
        parallelism; nothing otherwise."""
        if self.cp_mesh is None:
            return contextlib.nullcontext()
        body = self.model.model
        return hp.context_parallel(self.cp_mesh, buffers=[ids, targets, body.cos, body.sin],
                                   buffer_seq_dims=[1, 1, 0, 0],
                                   no_restore_buffers=[ids, targets])

    def step(self, ids: np.ndarray, targets: np.ndarray) -> tuple:
        """One optimizer step on this rank's rows; (local loss, global gradient norm)."""
        ids, targets = self._tensors(ids, targets)
        if self.pipeline:
            loss = self.pipeline.step(ids, targets)  # None but on the last stage
            norm = hp.clip_grad_norm_(self.params, self.clip, pp_mesh=self.pipeline.mesh)
        else:
            with self._split_sequence(ids, targets):
                loss = self._loss(ids, targets)
                loss.backward()
            loss = _value(loss)
            norm = hp.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.moe:
            balance(hp, self.model, self.every)
        return loss, _value(norm)

    def evaluate(self, ids: np.ndarray, targets: np.ndarray) -> float | None:
        if self.pipeline:
            return self.pipeline.eval(*self._tensors(ids, targets))
        with torch.no_grad():  # the whole sequence on each context-parallel rank
            loss = _value(self._loss(*self._tensors(ids, targets)))
        if self.moe:
            forget_counts(hp, self.model)
        return loss

    def mean_over_ranks(self, values: list) -> list:
        """Means over the ranks that hold ``values`` (under pipelining the last stage's;
        the others pass Nones)."""
        tensor = torch.tensor(held_row(values), dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(tensor)
        return (tensor[:-1] / tensor[-1]).tolist()

    def peak_memory_mb(self) -> float:
        """The accelerator's peak allocation on GPU; on CPU the process's peak resident set."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated() / 2**20
        return peak_resident_mb()


def _value(tensor) -> float:
    return float(tensor.detach())
