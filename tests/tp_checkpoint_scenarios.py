"""Rank side of the tensor-parallel checkpoint tests (tests/test_checkpoint.py): torch, 4 ranks.

The model is a small language model: an embedding, two layers of RMSNorm + attention +
RMSNorm + MLP (tests/tp_scenarios.py's blocks), a final norm and a head. Tensor
parallelism splits the embedding and the head on the vocabulary (row- and
column-parallel: dim 0, the dim fully_shard shards too; 37 rows, uneven at every split),
the attention and MLP projections as in tp_scenarios.py (dim 0 in, dim 1 out); the norms'
weights stay plain parameters, replicated over the tensor-parallel dim.

``run_all`` trains it ``STEPS`` AdamW steps at (dp=2, tp=2) (``dp_mesh_dims``), saves
checkpoint A and the Hugging Face export, and trains ``STEPS`` more (the uninterrupted
curve). Fresh models (other initial values) in each layout of ``LAYOUTS`` load A and
train the same ``STEPS`` steps: the same mesh, or FSDP2's ``mesh["dp"]``, the dims
swapped (other ranks hold each region), replicated over dp (DDP + TP), another
tensor-parallel degree (dp=1, tp=4), and no tensor parallelism (FSDP over 4 ranks). The
``mesh["dp"]`` model also saves checkpoint B right after loading, to be compared with A
file for file. The test process loads A and B into a plain single-process model. Last, a
model split by tensor parallelism alone (no fully_shard) is refused.

Each rank trains on its data-parallel slice of every global batch; ranks of one
tensor-parallel group take the same slice, so the mean of all ranks' losses is the
global loss in every layout.
"""

from __future__ import annotations

import os

import numpy as np

from tests.tp_scenarios import DIM, layer_classes, layer_plan

VOCAB, LAYERS, SEQ, GLOBAL_BATCH, STEPS, LR = 37, 2, 5, 4, 2, 0.01

# name: (mesh shape, dim names, dp_mesh_dims as kwargs, or "dp_slice": fully_shard given
# mesh["dp"]; the data-parallel index of rank r, the data-parallel size); "fsdp4": no
# tensor parallelism, fully_shard over every rank
LAYOUTS = {
    "dp2_tp2": ((2, 2), ("dp", "tp"), {"shard": "dp"}, lambda r: (r // 2, 2)),
    "dp2_tp2_dp_slice": ((2, 2), ("dp", "tp"), "dp_slice", lambda r: (r // 2, 2)),
    "tp2_dp2": ((2, 2), ("tp", "dp"), {"shard": "dp"}, lambda r: (r % 2, 2)),
    "ddp_tp2": ((2, 2), ("dp", "tp"), {"replicate": "dp"}, lambda r: (r // 2, 2)),
    "dp1_tp4": ((1, 4), ("dp", "tp"), {"shard": "dp"}, lambda r: (0, 1)),
    "fsdp4": (None, None, None, lambda r: (r, 4)),
}


def new_model(seed: int):
    """The plain (single-process) model, its values from ``seed``."""
    import torch
    import torch.nn as nn

    Attention, MLP = layer_classes()

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.mlp_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
            self.attn, self.mlp = Attention(), MLP()

        def forward(self, x):
            return self.mlp(self.mlp_norm(self.attn(self.attn_norm(x))))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
            self.norm, self.lm_head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x))

    torch.manual_seed(seed)
    model = LM()
    with torch.no_grad():  # norms start away from 1, so a load that misses them shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def batches() -> list:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, VOCAB, size=(2 * STEPS, GLOBAL_BATCH, SEQ + 1))
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def optimizer(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def train(model, opt, steps: list, dp: tuple = (0, 1)) -> list:
    """AdamW steps on this rank's data-parallel slice (``dp``: index, size) of each batch."""
    import torch

    index, size = dp
    rows = slice(index * GLOBAL_BATCH // size, (index + 1) * GLOBAL_BATCH // size)
    losses = []
    for ids, targets in steps:
        logits = model(torch.from_numpy(ids[rows]))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                 torch.from_numpy(targets[rows]).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _tensor_parallel(model, tp_mesh):
    """``model`` split over ``tp_mesh``: the vocabulary of the embedding and the head, and
    each layer's projections."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module,
    )

    plan = {"embed": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(LAYERS):
        plan.update(layer_plan(f"layers.{i}."))
    return parallelize_module(model, tp_mesh, plan)


def _build(name: str, seed: int) -> tuple:
    """``(model, optimizer, (dp index, dp size))`` of layout ``name`` on this rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import hyper_parallel as hp

    shape, names, dims, dp = LAYOUTS[name]
    model = new_model(seed)
    where = {}
    if shape is not None:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        _tensor_parallel(model, mesh["tp"])
        where = {"mesh": mesh["dp"]} if dims == "dp_slice" else \
            {"mesh": mesh, "dp_mesh_dims": hp.DataParallelMeshDims(**dims)}
    for layer in model.layers:
        hp.fully_shard(layer, **where)
    hp.fully_shard(model, **where)
    return model, optimizer(model), dp(dist.get_rank())


def run_all(directory: str) -> dict:
    """Per rank: the uninterrupted losses, and per layout the losses after loading A; on
    rank 0 the full parameters when A was saved, after the uninterrupted steps and after
    each layout's."""
    import torch.distributed as dist

    import hyper_parallel as hp

    first = dist.get_rank() == 0
    steps = batches()
    model, opt, dp = _build("dp2_tp2", seed=0)
    losses = train(model, opt, steps[:STEPS], dp)
    hp.save_checkpoint(os.path.join(directory, "A"), model, opt, extra={"step": STEPS})
    hp.export_full(os.path.join(directory, "export"), model)
    saved = hp.gather_full_state_dict(model)
    losses += train(model, opt, steps[STEPS:], dp)
    final = hp.gather_full_state_dict(model)  # every rank takes part
    out = {"losses": losses, "saved": saved if first else None,
           "final": final if first else None, "layouts": {}}
    for name in LAYOUTS:
        model, opt, dp = _build(name, seed=1)
        extra = hp.load_checkpoint(os.path.join(directory, "A"), model, opt)
        if name == "dp2_tp2_dp_slice":
            hp.save_checkpoint(os.path.join(directory, "B"), model, opt)
        resumed = train(model, opt, steps[STEPS:], dp)
        final = hp.gather_full_state_dict(model)
        out["layouts"][name] = {"extra": extra, "losses": resumed,
                                "final": final if first else None}
    # tensor parallelism without fully_shard: refused before anything is written
    from torch.distributed.device_mesh import init_device_mesh

    bare = _tensor_parallel(new_model(1), init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)))
    try:
        hp.save_checkpoint(os.path.join(directory, "C"), bare)
        out["outside_unit"] = None
    except hp.CheckpointError as error:
        out["outside_unit"] = str(error)
    out["wrote_c"] = any(f.startswith("C") for f in os.listdir(directory))
    try:
        hp.gather_full_state_dict(bare)
        out["full_outside_unit"] = None
    except NotImplementedError as error:
        out["full_outside_unit"] = str(error)
    return out
