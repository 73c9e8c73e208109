"""One training script, both frameworks: the same lines train the same transformer on
PyTorch or MindSpore, under each parallel layout named.

    hp-run --nproc 4 examples/one_script/train.py --model torch
    hp-run --nproc 4 examples/one_script/train.py --model mindspore

``--model`` names the model's module (model_torch.py, model_mindspore.py): the model, its
optimizer and the framework's own training step. Every other line is this file's, with
``hp.*`` names only: meshes and their slices, the tensor-parallel plan, ``fully_shard``,
the loss (``hp.cross_entropy`` inside ``hp.loss_parallel()``), clipping, a checkpoint
saved and resumed, and a Hugging Face export. Layouts (``--layouts``, default all):

- ``single``: no parallelism, this rank alone on the whole batch (the reference);
- ``fsdp``: ``fully_shard`` over every rank;
- ``hsdp``: sharded over ``world / 2`` ranks, replicated over 2;
- ``tp``: tensor parallelism over every rank (torchtitan's sequence-parallel plan);
- ``dp_tp``: tensor parallelism over ``world / 2`` ranks and ``fully_shard`` over 2.

Each layout trains ``--steps`` AdamW steps, saves a checkpoint after ``--save-at`` of
them, and trains the rest twice: on, and again from the checkpoint loaded into a fresh
model. Each rank writes what it saw to ``--out``/<layout>.rank<r>.json (its losses, its
data-parallel coordinates, both runs of the resumed steps) and the export to
``--out``/<layout>-export/.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import hyper_parallel as hp  # noqa: E402

SIZES = dict(vocab=32, dim=16, head_dim=4, hidden=32, layers=2)
BATCH, SEQ = 4, 8
LAYOUTS = ("single", "fsdp", "hsdp", "tp", "dp_tp")


def initial_values(seed: int = 0) -> dict:
    """``{torch name: values}``: the same starting point on both frameworks."""
    rng = np.random.default_rng(seed)
    dim, hidden, vocab = SIZES["dim"], SIZES["hidden"], SIZES["vocab"]
    shapes = {"embed.weight": (vocab, dim), "norm.weight": (dim,), "norm.bias": (dim,),
              "head.weight": (vocab, dim)}
    for i in range(SIZES["layers"]):
        block = f"blocks.{i}"
        for norm in ("attn_norm", "ffn_norm"):
            shapes[f"{block}.{norm}.weight"], shapes[f"{block}.{norm}.bias"] = (dim,), (dim,)
        for w in ("wq", "wk", "wv", "wo"):
            shapes[f"{block}.attn.{w}.weight"], shapes[f"{block}.attn.{w}.bias"] = (dim, dim), (dim,)
        del shapes[f"{block}.attn.wk.bias"]  # the model has none (model_torch.py says why)
        shapes[f"{block}.ffn.w1.weight"], shapes[f"{block}.ffn.w1.bias"] = (hidden, dim), (hidden,)
        shapes[f"{block}.ffn.w2.weight"], shapes[f"{block}.ffn.w2.bias"] = (dim, hidden), (dim,)
    return {name: ((1.0 if name.endswith("norm.weight") else 0.0)
                   + 0.3 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in shapes.items()}


def batches(steps: int, seed: int = 1) -> list:
    """Each step's whole batch of token rows; ids are a row's first SEQ tokens, targets
    its last SEQ (the next token)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, SIZES["vocab"], (BATCH, SEQ + 1)).astype(np.int64)
            for _ in range(steps)]


def tensor_parallel_plan() -> dict:
    """torchtitan's plan: the embedding's output and the blocks' outputs split on the
    sequence, norms sequence-parallel, attention and MLP gathered in, q/k/v and w1
    column-wise, o and w2 row-wise, the head's logits left split on the vocabulary for
    the loss."""
    block = {
        "attn_norm": hp.SequenceParallel(),
        "attn": hp.PrepareModuleInput(input_layouts=(hp.Shard(1),),
                                      desired_input_layouts=(hp.Replicate(),)),
        "attn.w[qkv]": hp.ColwiseParallel(),
        "attn.wo": hp.RowwiseParallel(output_layouts=hp.Shard(1)),
        "ffn_norm": hp.SequenceParallel(),
        "ffn": hp.PrepareModuleInput(input_layouts=(hp.Shard(1),),
                                     desired_input_layouts=(hp.Replicate(),)),
        "ffn.w1": hp.ColwiseParallel(),
        "ffn.w2": hp.RowwiseParallel(output_layouts=hp.Shard(1)),
    }
    plan = {"embed": hp.RowwiseParallel(input_layouts=hp.Replicate(), output_layouts=hp.Shard(1))}
    plan.update({f"blocks.*.{key}": style for key, style in block.items()})
    plan["norm"] = hp.SequenceParallel()
    plan["head"] = hp.ColwiseParallel(input_layouts=hp.Shard(1), use_local_output=False)
    return plan


def parallelize(model, layout: str):
    """``model`` laid out as ``layout`` says; returns (model, this rank's data-parallel
    rank, the data-parallel size)."""
    if layout == "single":
        return model, 0, 1
    world = hp.get_platform().world_size()
    device = hp.get_platform().device_type()
    if layout == "tp":
        mesh = hp.init_device_mesh(device, (world,), mesh_dim_names=("tp",))
        hp.parallelize_module(model, mesh, tensor_parallel_plan())
        return model, 0, 1
    if layout == "fsdp":
        mesh = hp.init_device_mesh(device, (world,), mesh_dim_names=("dp",))
        dp_mesh = mesh
    elif layout == "hsdp":
        mesh = hp.init_device_mesh(device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        dp_mesh = mesh
    else:  # dp_tp
        mesh = hp.init_device_mesh(device, (2, world // 2), mesh_dim_names=("dp", "tp"))
        hp.parallelize_module(model, mesh["tp"], tensor_parallel_plan())
        dp_mesh = mesh["dp"]
    for block in model.blocks:
        hp.fully_shard(block, mesh=dp_mesh)
    hp.fully_shard(model, mesh=dp_mesh)
    dp_rank = sum(dp_mesh.get_local_rank(d) * int(np.prod(dp_mesh.shape[d + 1:]))
                  for d in range(dp_mesh.ndim))
    return model, dp_rank, dp_mesh.size()


def train(framework, layout: str, args) -> dict:
    platform = hp.get_platform()

    def fresh():
        model, dp_rank, dp_size = parallelize(
            framework.build(initial_values(), **SIZES), layout)
        return model, framework.optimizer(model, args.lr), dp_rank, dp_size

    model, opt, dp_rank, dp_size = fresh()
    rows = BATCH // dp_size

    def loss_fn(ids, targets):
        with hp.loss_parallel():  # the head's logits stay split on the vocabulary
            logits = model(ids)
            return hp.cross_entropy(logits.reshape(-1, SIZES["vocab"]), targets.reshape(-1))

    def step(tokens) -> float:
        mine = tokens[dp_rank * rows:(dp_rank + 1) * rows]
        ids, targets = platform.from_numpy(mine[:, :-1]), platform.from_numpy(mine[:, 1:])
        return framework.train_step(model, opt, loss_fn, ids, targets, args.max_norm,
                                    hp.clip_grad_norm_)

    data = batches(args.steps)
    checkpoint = os.path.join(args.out, f"{layout}-checkpoint")
    losses = [step(tokens) for tokens in data[:args.save_at]]
    hp.save_checkpoint(checkpoint, model, opt, key_map=hp.torch_nn_names)
    losses += [step(tokens) for tokens in data[args.save_at:]]
    hp.export_full(os.path.join(args.out, f"{layout}-export"), model, key_map=hp.torch_nn_names)

    model, opt, _, _ = fresh()
    hp.load_checkpoint(checkpoint, model, opt, key_map=hp.torch_nn_names)
    resumed = [step(tokens) for tokens in data[args.save_at:]]
    return {"layout": layout, "rank": platform.rank(), "dp_rank": dp_rank, "dp_size": dp_size,
            "losses": losses, "resumed": resumed}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="torch or mindspore: model_<name>.py")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--out", default="runs/one_script")
    args = parser.parse_args(argv)
    framework = importlib.import_module(f"examples.one_script.model_{args.model}")
    hp.init_distributed()
    os.makedirs(args.out, exist_ok=True)
    for layout in args.layouts:
        result = train(framework, layout, args)
        with open(os.path.join(args.out, f"{layout}.rank{result['rank']}.json"), "w") as file:
            json.dump(result, file)
        if result["rank"] == 0:  # its loss on its own rows (all of them: single, tp)
            print(f"{layout:>7}, rank 0's loss per step: "
                  + " ".join(f"{loss:.5f}" for loss in result["losses"]), flush=True)
    hp.destroy_distributed()


if __name__ == "__main__":
    main()
