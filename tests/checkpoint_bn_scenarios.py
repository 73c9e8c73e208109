"""Rank side of the checkpoint suite, continued: BatchNorm and each framework's own layers.

A model written with each framework's own nn layers: torch's Embedding, LayerNorm, Linear
and BatchNorm1d (``weight``/``bias``, ``running_mean``/``running_var`` and the int64
0-dim ``num_batches_tracked`` buffers); MindSpore's Embedding (``embedding_table``),
LayerNorm and BatchNorm1d (``gamma``/``beta``, the ``requires_grad=False`` Parameters
``moving_mean``/``moving_variance``). They meet through ``key_map=hp.torch_nn_names``.
Every rank trains on the whole batch, so BatchNorm's statistics (each rank's own) are
the same on every rank and at every world size; each step records the training loss and
then an evaluation loss, which reads the running statistics.
"""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.checkpoint_scenarios import (
    BATCH, DIM, HIDDEN, SEQ, STEPS, VOCAB, _MindSpore, _Torch, _batches, _initial, _sharded)
from tests.kit import get_kit


def _bn_initial(name: str, shape: tuple) -> np.ndarray:
    """Initial value of the parameter with torch name ``name``."""
    if name.endswith(("norm.weight", "bn.weight")):
        return np.ones(shape, np.float32)
    if name.endswith(("norm.bias", "bn.bias")):
        return np.zeros(shape, np.float32)
    return _initial(name, shape)


def _bn_eval_batch() -> tuple:
    ids = np.random.default_rng(11).integers(0, VOCAB, size=(BATCH, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]


class _TorchBN(_Torch):
    def __init__(self):
        super().__init__()
        torch, nn = self.torch, self.torch.nn

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(VOCAB, DIM)
                self.bn = nn.BatchNorm1d(DIM)
                self.up = nn.Linear(DIM, HIDDEN)
                self.norm = nn.LayerNorm(HIDDEN)
                self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

            def forward(self, ids):
                x = self.bn(self.embed(ids).reshape(-1, DIM))
                return self.head(self.norm(torch.relu(self.up(x))))

        self.Model = Model

    def build(self):
        model = self.Model()
        with self.torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(self.torch.from_numpy(_bn_initial(name, tuple(p.shape))))
        return model

    def layers(self, model):
        return [model.bn]

    def evaluate(self, model, ids, targets) -> float:
        torch = self.torch
        model.eval()
        with torch.no_grad():
            logits = model(torch.from_numpy(ids.astype(np.int64)))
            loss = torch.nn.functional.cross_entropy(
                logits, torch.from_numpy(targets.astype(np.int64)).reshape(-1))
        model.train()
        return float(loss.item())

    def buffers(self, model) -> dict:
        return {k: v.numpy().copy() for k, v in model.named_buffers()}


class _MindSporeBN(_MindSpore):
    def __init__(self):
        super().__init__()
        from mindspore import nn, ops

        class Model(nn.Cell):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(VOCAB, DIM)
                self.bn = nn.BatchNorm1d(DIM, eps=1e-5, momentum=0.9)
                self.up = nn.Dense(DIM, HIDDEN)
                self.norm = nn.LayerNorm((HIDDEN,), begin_norm_axis=-1, begin_params_axis=-1,
                                         epsilon=1e-5)
                self.head = nn.Dense(HIDDEN, VOCAB, has_bias=False)

            def construct(self, ids):
                x = self.bn(self.embed(ids).reshape(-1, DIM))
                return self.head(self.norm(ops.relu(self.up(x))))

        self.Model = Model

    def build(self):
        model = self.Model()
        model.set_train(True)
        for name, p in model.parameters_and_names():
            if p.requires_grad:
                p.set_data(self.ms.Tensor(_bn_initial(hp.torch_nn_names(name), tuple(p.shape))))
        return model

    def layers(self, model):
        return [model.bn]

    def evaluate(self, model, ids, targets) -> float:
        ms = self.ms
        model.set_train(False)
        logits = model(ms.Tensor(ids.astype(np.int32)))
        loss = ms.ops.cross_entropy(logits, ms.Tensor(targets.astype(np.int32)).reshape(-1))
        model.set_train(True)
        return float(loss.asnumpy())

    def buffers(self, model) -> dict:
        return {hp.torch_nn_names(k): v.asnumpy().copy()
                for k, v in model.parameters_and_names() if not v.requires_grad}


def _bn_side():
    return _TorchBN() if get_kit().name == "torch" else _MindSporeBN()


def _bn_train(side, model, opt, first: int, count: int) -> list:
    """Per step: the training loss, then the evaluation loss after the step."""
    eval_ids, eval_targets = _bn_eval_batch()
    out = []
    for ids, targets in _batches()[first:first + count]:
        out.append(side.step(model, opt, ids, targets))
        out.append(side.evaluate(model, eval_ids, eval_targets))
    return out


def _bn_state(side, model) -> dict:
    """The model's parameters and buffers by torch name, as numpy."""
    full = {hp.torch_nn_names(k): v for k, v in hp.gather_full_state_dict(model).items()}
    full.update(side.buffers(model))
    return full


def bn_save_run(dir_a: str, dir_native: str) -> dict:
    """torch, FSDP over every rank: ``STEPS`` steps, A (torch names through the map:
    ``num_batches_tracked`` left out) and the same without the map, ``STEPS`` more."""
    side = _bn_side()
    model, opt = _sharded(side, (hp.get_platform().world_size(),))
    losses = _bn_train(side, model, opt, 0, STEPS)
    hp.save_checkpoint(dir_a, model, opt, extra={"step": STEPS}, key_map=hp.torch_nn_names)
    hp.save_checkpoint(dir_native, model, opt)
    saved = side.buffers(model)
    losses += _bn_train(side, model, opt, STEPS, STEPS)
    reference = side.build()
    return {"ref": _bn_train(side, reference, side.optimizer(reference), 0, 3 * STEPS),
            "losses": losses, "saved_buffers": saved, "final": _bn_state(side, model)}


def bn_cross_run(dir_a: str, dir_b: str) -> dict:
    """MindSpore: A (torch's) into HSDP (world, 1), ``STEPS`` steps, B, ``STEPS`` more; a
    fresh FSDP model loads B and repeats them."""
    side = _bn_side()
    world = hp.get_platform().world_size()
    model, opt = _sharded(side, (world, 1))
    hp.load_checkpoint(dir_a, model, opt, key_map=hp.torch_nn_names)
    loaded = side.buffers(model)
    resumed = _bn_train(side, model, opt, STEPS, STEPS)
    hp.save_checkpoint(dir_b, model, opt, key_map=hp.torch_nn_names)
    after_save = _bn_train(side, model, opt, 2 * STEPS, STEPS)
    final = _bn_state(side, model)
    model, opt = _sharded(side, (world,))
    hp.load_checkpoint(dir_b, model, opt, key_map=hp.torch_nn_names)
    reference = side.build()
    return {"ref": _bn_train(side, reference, side.optimizer(reference), 0, 3 * STEPS),
            "loaded_buffers": loaded, "resumed": resumed, "after_save": after_save,
            "final": final, "resumed_same": _bn_train(side, model, opt, 2 * STEPS, STEPS),
            "final_same": _bn_state(side, model)}


def bn_resume_run(dir_a: str, dir_native: str, dir_b: str) -> dict:
    """torch at this world size: the checkpoint saved without the map
    (``num_batches_tracked`` included) and A through the map, each followed by ``STEPS``
    steps; B (MindSpore's) through the map and its last ``STEPS`` steps."""
    side = _bn_side()
    world = hp.get_platform().world_size()
    out = {}
    for name, path, key_map in (("native", dir_native, None),
                                ("mapped", dir_a, hp.torch_nn_names)):
        model, opt = _sharded(side, (world,))
        hp.load_checkpoint(path, model, opt, key_map=key_map)
        out[name] = {"buffers": side.buffers(model),
                     "resumed": _bn_train(side, model, opt, STEPS, STEPS),
                     "final": _bn_state(side, model)}
    model, opt = _sharded(side, (world,))
    hp.load_checkpoint(dir_b, model, opt, key_map=hp.torch_nn_names)
    out["from_mindspore"] = _bn_train(side, model, opt, 2 * STEPS, STEPS)
    return out
