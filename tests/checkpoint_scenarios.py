"""Rank side of the checkpoint suite (tests/test_checkpoint.py).

The model is a small decoder written once per framework with the same parameter names
(``embed_tokens.weight``, ``layers.0.attn_norm.weight``, ``layers.0.up.bias``, ...), the same
math and the same initial values (seeded by name), so a checkpoint written by one loads
into the other. Sizes are uneven over 2 and 4 ranks (vocabulary 37, hidden 24 + bias).
Every run trains with AdamW (``kind="sgd"``: SGD with momentum 0.9, torch's
``torch.optim.SGD`` and MindSpore's ``mindspore.experimental.optim.SGD``) on slices of the
same global batches: rank r of W takes rows ``[r * B / W, (r + 1) * B / W)``, so the mean
of the ranks' losses is the global loss.

- ``save_run`` (torch, 2 ranks, FSDP): the single-process reference over every step;
  ``STEPS`` steps, checkpoint A (saved asynchronously, written while the next steps
  run), ``STEPS`` more steps (the uninterrupted curve).
- ``cross_run`` (MindSpore, 2 ranks): its own single-process reference; A (written on
  torch) loaded into an HSDP (2, 1) mesh, ``STEPS`` steps, checkpoint B (asynchronous,
  published by the next load), ``STEPS`` more; a fresh FSDP model loads B and repeats
  those last steps.
- ``crash_run`` (torch, 2 ranks): checkpoint C of the initial model, then a second save to
  the same path during which rank 1 dies after writing its file; ``crash_async_run`` the
  same with the second save asynchronous.
- ``resume_run`` (torch, 1 rank): A loaded, ``STEPS`` steps; B (written on MindSpore)
  loaded and its last steps; a bfloat16 round trip; C loaded (what the crash left).
  Bad checkpoints, arguments and save targets: tests/checkpoint_safety_scenarios.py.
- ``mesh_run`` (either framework, 4 ranks): a mesh with a dim that is not data parallel,
  the parameters replicated over it; resumed by FSDP over the 4 ranks.
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np

import hyper_parallel as hp
from tests.kit import get_kit

VOCAB, DIM, HIDDEN, LAYERS, SEQ, BATCH = 37, 16, 24, 2, 8, 4
STEPS = 2  # per phase: the resumed curve covers STEPS optimizer steps after the load
LR = 0.01
SGD_LR = 0.1


def _batches() -> list:
    rng = np.random.default_rng(7)
    ids = rng.integers(0, VOCAB, size=(3 * STEPS, BATCH, SEQ + 1))
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def _initial(name: str, shape: tuple) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


class _Torch:
    def __init__(self, kind: str = "adamw"):
        import torch
        from torch import nn

        self.torch, self.kind = torch, kind

        class RMSNorm(nn.Module):
            def __init__(self, dim):
                super().__init__()
                self.weight = nn.Parameter(torch.ones(dim))

            def forward(self, x):
                return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * self.weight

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn_norm, self.mlp_norm = RMSNorm(DIM), RMSNorm(DIM)
                self.attn = nn.Linear(DIM, DIM, bias=False)
                self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM, bias=False)

            def forward(self, x):
                h = self.attn_norm(x)
                x = x + torch.softmax(h @ h.transpose(-1, -2) / DIM ** 0.5, -1) @ self.attn(h)
                return x + self.down(torch.relu(self.up(self.mlp_norm(x))))

        class Decoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed_tokens = nn.Embedding(VOCAB, DIM)
                self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
                self.norm, self.lm_head = RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

            def forward(self, ids):
                x = self.embed_tokens(ids)
                for layer in self.layers:
                    x = layer(x)
                return self.lm_head(self.norm(x))

        self.Decoder = Decoder

    def build(self):
        model = self.Decoder()
        with self.torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(self.torch.from_numpy(_initial(name, tuple(p.shape))))
        return model

    def layers(self, model):
        return list(model.layers)

    def optimizer(self, model):
        if self.kind == "sgd":
            return self.torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
        return self.torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    def step(self, model, opt, ids, targets):
        logits = model(self.torch.from_numpy(ids.astype(np.int64)))
        loss = self.torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), self.torch.from_numpy(targets.astype(np.int64)).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.item())


class _MindSpore:
    def __init__(self, kind: str = "adamw"):
        import mindspore as ms
        from mindspore import Parameter, Tensor, nn, ops

        ms.set_context(mode=ms.PYNATIVE_MODE)
        self.ms, self.kind = ms, kind

        class RMSNorm(nn.Cell):
            def __init__(self, dim):
                super().__init__()
                self.weight = Parameter(Tensor(np.ones(dim, np.float32)), name="weight")

            def construct(self, x):
                return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6) * self.weight

        class Embedding(nn.Cell):
            def __init__(self, vocab, dim):
                super().__init__()
                self.weight = Parameter(Tensor(np.zeros((vocab, dim), np.float32)), name="weight")

            def construct(self, ids):
                return ops.gather(self.weight, ids, 0)

        class Layer(nn.Cell):
            def __init__(self):
                super().__init__()
                self.attn_norm, self.mlp_norm = RMSNorm(DIM), RMSNorm(DIM)
                self.attn = nn.Dense(DIM, DIM, has_bias=False)
                self.up, self.down = nn.Dense(DIM, HIDDEN), nn.Dense(HIDDEN, DIM, has_bias=False)

            def construct(self, x):
                h = self.attn_norm(x)
                scores = ops.softmax(ops.matmul(h, h.swapaxes(-1, -2)) / DIM ** 0.5, -1)
                x = x + ops.matmul(scores, self.attn(h))
                return x + self.down(ops.relu(self.up(self.mlp_norm(x))))

        class Decoder(nn.Cell):
            def __init__(self):
                super().__init__()
                self.embed_tokens = Embedding(VOCAB, DIM)
                self.layers = nn.CellList([Layer() for _ in range(LAYERS)])
                self.norm, self.lm_head = RMSNorm(DIM), nn.Dense(DIM, VOCAB, has_bias=False)

            def construct(self, ids):
                x = self.embed_tokens(ids)
                for layer in self.layers:
                    x = layer(x)
                return self.lm_head(self.norm(x))

        self.Decoder = Decoder

    def build(self):
        model = self.Decoder()
        platform = hp.get_platform()
        for module_name, sub in platform.named_modules(model):
            for attr, p in platform.direct_params(sub):
                name = f"{module_name}.{attr}" if module_name else attr
                p.set_data(self.ms.Tensor(_initial(name, tuple(p.shape))))
        return model

    def layers(self, model):
        return list(model.layers)

    def optimizer(self, model):
        from mindspore.experimental.optim import SGD, AdamW

        if self.kind == "sgd":
            return SGD(model.trainable_params(), lr=SGD_LR, momentum=0.9)
        return AdamW(model.trainable_params(), lr=LR, weight_decay=0.01)

    def step(self, model, opt, ids, targets):
        ms = self.ms
        params = list(model.trainable_params())

        def loss_fn(mi, mt):
            logits = model(mi)
            return ms.ops.cross_entropy(logits.reshape(-1, VOCAB), mt.reshape(-1))

        loss, grads = ms.value_and_grad(loss_fn, None, params)(
            ms.Tensor(ids.astype(np.int32)), ms.Tensor(targets.astype(np.int32)))
        opt(grads)
        return float(loss.asnumpy())


def _side(kind: str = "adamw"):
    return _Torch(kind) if get_kit().name == "torch" else _MindSpore(kind)


def _sharded(side, mesh_shape):
    model = side.build()
    platform = hp.get_platform()
    if len(mesh_shape) == 1:
        mesh = hp.init_device_mesh(platform.device_type(), mesh_shape, mesh_dim_names=("shard",))
    else:
        mesh = hp.init_device_mesh(platform.device_type(), mesh_shape,
                                   mesh_dim_names=("replicate", "shard"))
    for layer in side.layers(model):
        hp.fully_shard(layer, mesh=mesh)
    hp.fully_shard(model, mesh=mesh)
    return model, side.optimizer(model)


def _train(side, model, opt, first: int, count: int, dp: tuple | None = None) -> list:
    """Steps on this rank's slice of each batch: ``dp`` is its data-parallel index and the
    data-parallel size, (rank, world size) unless given."""
    platform = hp.get_platform()
    index, size = dp if dp is not None else (platform.rank(), platform.world_size())
    rows = BATCH // size
    return [side.step(model, opt, ids[index * rows:(index + 1) * rows],
                      targets[index * rows:(index + 1) * rows])
            for ids, targets in _batches()[first:first + count]]


def _reference(side) -> list:
    model = side.build()
    return _train(side, model, side.optimizer(model), 0, 3 * STEPS, dp=(0, 1))


def save_run(dir_a: str, kind: str = "adamw") -> dict:
    side = _side(kind)
    model, opt = _sharded(side, (hp.get_platform().world_size(),))
    losses = _train(side, model, opt, 0, STEPS)
    # written in the background while training goes on: A holds the state at this step
    handle = hp.save_checkpoint(dir_a, model, opt, extra={"step": STEPS, "framework": "torch"},
                                async_save=True)
    losses += _train(side, model, opt, STEPS, STEPS)
    handle.wait()
    return {"ref": _reference(side), "losses": losses}


def cross_run(dir_a: str, dir_b: str, kind: str = "adamw") -> dict:
    side = _side(kind)
    world = hp.get_platform().world_size()
    model, opt = _sharded(side, (world, 1))
    extra = hp.load_checkpoint(dir_a, model, opt)
    resumed = _train(side, model, opt, STEPS, STEPS)
    # in the background; the load below waits for it and publishes it
    hp.save_checkpoint(dir_b, model, opt, extra={"step": 2 * STEPS}, async_save=True)
    after_save = _train(side, model, opt, 2 * STEPS, STEPS)
    model, opt = _sharded(side, (world,))
    hp.load_checkpoint(dir_b, model, opt)
    return {"ref": _reference(side), "extra": extra, "resumed": resumed,
            "after_save": after_save, "resumed_same": _train(side, model, opt, 2 * STEPS, STEPS)}


def resume_run(dir_a: str, mesh_shape: tuple, dir_b: str | None = None,
               checks_dir: str | None = None, crashed: str | None = None,
               kind: str = "adamw") -> dict:
    side = _side(kind)
    model, opt = _sharded(side, mesh_shape)
    result = {"extra": hp.load_checkpoint(dir_a, model, opt),
              "resumed": _train(side, model, opt, STEPS, STEPS)}
    if dir_b is not None:
        model, opt = _sharded(side, mesh_shape)
        hp.load_checkpoint(dir_b, model, opt)
        result["resumed_b"] = _train(side, model, opt, 2 * STEPS, STEPS)
    if checks_dir is not None:
        result["bf16"] = _bf16_roundtrip(side, checks_dir)
    if crashed is not None:
        result["crashed"] = crashed_checkpoint_loads(crashed)
    return result


def mesh_run(path: str) -> dict:
    """4 ranks, a (dp=2, tp=2) mesh with ``dp_mesh_dims=DataParallelMeshDims(shard="dp")``:
    the parameters are plain (no tensor parallelism), so replicated over "tp", and each
    "tp" pair trains on one slice. ``STEPS`` steps, checkpoint ``path``, ``STEPS`` more; a
    fresh model sharded over all 4 ranks loads it and repeats those steps. Also: the
    files the save wrote (one per "tp" pair)."""
    side = _side()
    platform = hp.get_platform()
    mesh = hp.init_device_mesh(platform.device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    dims = hp.DataParallelMeshDims(shard="dp")
    model = side.build()
    for layer in side.layers(model):
        hp.fully_shard(layer, mesh=mesh, dp_mesh_dims=dims)
    hp.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    opt, dp = side.optimizer(model), (platform.rank() // 2, 2)
    losses = _train(side, model, opt, 0, STEPS, dp)
    hp.save_checkpoint(path, model, opt)
    losses += _train(side, model, opt, STEPS, STEPS, dp)
    model, opt = _sharded(side, (platform.world_size(),))
    hp.load_checkpoint(path, model, opt)
    return {"losses": losses, "resumed": _train(side, model, opt, STEPS, STEPS),
            "files": sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))}


def _saved_once_then_rank1_dies_writing(path: str):
    """Checkpoint C of the initial model, one training step, and rank 1 set to die after
    writing the first file of its next save (the whole process, from whichever thread)."""
    side = _side()
    model, opt = _sharded(side, (hp.get_platform().world_size(),))
    hp.save_checkpoint(path, model, opt, extra={"checkpoint": "C"})
    _train(side, model, opt, 0, 1)
    if hp.get_platform().rank() == 1:
        from hyper_parallel.checkpoint import files

        write_file = files.write_file

        def write_then_die(*args, **kwargs):
            write_file(*args, **kwargs)
            os._exit(17)

        files.write_file = write_then_die
    return side, model, opt


def crash_run(path: str) -> None:
    _, model, opt = _saved_once_then_rank1_dies_writing(path)
    hp.save_checkpoint(path, model, opt, extra={"checkpoint": "D"})


def crash_async_run(path: str) -> None:
    """As ``crash_run``, the second save asynchronous: rank 1 dies in its background write
    while training goes on, and rank 0 waits in ``handle.wait()``."""
    side, model, opt = _saved_once_then_rank1_dies_writing(path)
    handle = hp.save_checkpoint(path, model, opt, extra={"checkpoint": "D"}, async_save=True)
    _train(side, model, opt, 1, 1)
    handle.wait()


def crashed_checkpoint_loads(path: str) -> dict:
    """The checkpoint left at ``path`` after ``crash_run``: its extra, and whether its
    parameters are the initial ones."""
    side = _side()
    model, opt = _sharded(side, (hp.get_platform().world_size(),))
    extra = hp.load_checkpoint(path, model, opt)
    full = hp.gather_full_state_dict(model)
    return {"extra": extra,
            "initial": all(np.array_equal(v, _initial(k, v.shape)) for k, v in full.items())}


def _bf16_roundtrip(side, work: str) -> dict:
    """A bfloat16 model (torch) saved and loaded bit for bit; the file's dtype is BF16."""
    if get_kit().name != "torch":
        return {}
    import torch

    model = side.build().to(torch.bfloat16)
    hp.fully_shard(model)
    path = os.path.join(work, "bf16")
    hp.save_checkpoint(path, model)
    fresh = side.build().to(torch.bfloat16)
    hp.fully_shard(fresh)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    hp.load_checkpoint(path, fresh)
    a, b = hp.gather_full_state_dict(model, as_numpy=False), hp.gather_full_state_dict(fresh, as_numpy=False)
    with open(os.path.join(path, "index.json"), encoding="utf-8") as file:
        dtypes = {entry["dtype"] for entry in json.load(file)["tensors"].values()}
    with open(os.path.join(path, "rank-00000.safetensors"), "rb") as file:
        header = file.read(4096)
    return {"equal": all(torch.equal(a[k], b[k]) for k in a), "dtypes": sorted(dtypes),
            "file_says_bf16": b'"BF16"' in header}
