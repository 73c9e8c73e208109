"""The MindSpore side of examples/train_lm.py: build (eagerly or under
``no_init_parameters``), split it over the tensor-parallel ranks (hyper_parallel's own
tensor parallelism), shard each decoder layer and the root, and run one AdamW step
(inside hp.context_parallel where the sequence is split over context-parallel ranks)."""

from __future__ import annotations

import contextlib

import mindspore as ms
import numpy as np
from mindspore import Tensor
from mindspore.experimental.optim import AdamW
from mindspore.mint import distributed as msdist
from mindspore.nn.utils import no_init_parameters

import hyper_parallel as hp
from examples.lm.config import VOCAB, set_initial_values
from examples.lm.expert_parallel import balance, forget_counts, shard_experts
from examples.lm.model_mindspore import LlamaLM, build
from examples.lm.progress import peak_resident_mb
from examples.lm.tensor_parallel import lm_plan


class Trainer:
    def __init__(self, size: str, mesh, mp_policy, deferred: bool, lr: float,
                 weight_decay: float, clip: float, tp_mesh=None, cp_mesh=None,
                 dp_mesh_dims=None, moe: bool = False, ep_meshes: tuple = (None, None)):
        """``mesh``: fully_shard's (None: all ranks), with its ``dp_mesh_dims``;
        ``tp_mesh``: the tensor-parallel ranks (None: no tensor parallelism), which needs
        the model built eagerly; ``cp_mesh``: the context-parallel ranks (None: none);
        ``moe``: experts in place of the MLPs, split over ``ep_meshes`` (expert_parallel.py's
        ``expert_meshes``; an expert split needs the model built eagerly)."""
        ms.set_context(mode=ms.PYNATIVE_MODE)
        if deferred:
            with no_init_parameters():  # parameters hold initializers, no values
                model = LlamaLM(size, moe)
        else:
            model = build(size, hp.get_platform(), moe)
        if tp_mesh is not None:
            hp.parallelize_module(model, tp_mesh, lm_plan(hp, attention_inputs=3, moe=moe))
        if ep_meshes[0] is not None:
            shard_experts(hp, model, ep_meshes[0], mp_policy)
        for layer in model.model.layers:
            hp.fully_shard(layer, mesh=mesh, mp_policy=mp_policy, dp_mesh_dims=dp_mesh_dims)
        # materialises the shards
        hp.fully_shard(model, mesh=mesh, mp_policy=mp_policy, dp_mesh_dims=dp_mesh_dims)
        if deferred:
            set_initial_values(model)
        self.model, self.clip, self.tensor_parallel = model, clip, tp_mesh is not None
        self.moe, self.every = moe, ep_meshes[1]
        self.cp_mesh = cp_mesh
        self.params = list(model.trainable_params())
        self.optimizer = AdamW(self.params, lr=lr, weight_decay=weight_decay)
        self.grad_fn = ms.value_and_grad(self._loss, None, self.params)

    def _loss(self, ids, targets):
        """The loss over logits split on the vocabulary (a LayoutTensor, never gathered)
        under tensor parallelism, over whole logits otherwise."""
        logits = self.model(ids).astype(ms.float32)
        with hp.loss_parallel():
            return hp.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def step(self, ids: np.ndarray, targets: np.ndarray) -> tuple:
        """One optimizer step on this rank's rows; (local loss, global gradient norm)."""
        ids, targets = Tensor(ids.astype(np.int32)), Tensor(targets.astype(np.int32))
        with self._split_sequence(ids, targets):
            loss, grads = self.grad_fn(ids, targets)
        grads, norm = hp.clip_grad_norm_(self.params, self.clip, grads=grads)
        self.optimizer(grads)
        if self.moe:
            balance(hp, self.model, self.every)
        return float(loss.asnumpy()), float(norm.asnumpy())

    def _split_sequence(self, ids, targets):
        """This rank's positions of the batch and of the rotary tables, under context
        parallelism; nothing otherwise."""
        if self.cp_mesh is None:
            return contextlib.nullcontext()
        body = self.model.model
        return hp.context_parallel(self.cp_mesh, buffers=[ids, targets, body.cos, body.sin],
                                   buffer_seq_dims=[1, 1, 0, 0],
                                   no_restore_buffers=[ids, targets])

    def evaluate(self, ids: np.ndarray, targets: np.ndarray) -> float:
        loss = self._loss(Tensor(ids.astype(np.int32)), Tensor(targets.astype(np.int32)))
        if self.moe:
            forget_counts(hp, self.model)
        return float(loss.asnumpy())

    def mean_over_ranks(self, values: list) -> list:
        tensor = Tensor(np.array(values, np.float32))
        msdist.all_reduce(tensor)
        return (tensor.asnumpy().astype(np.float64) / msdist.get_world_size()).tolist()

    def peak_memory_mb(self) -> float:
        """The process's peak resident set (MindSpore on CPU)."""
        return peak_resident_mb()
