"""Rank side of tests/test_expert_parallel.py's Hugging Face case: a tiny transformers 5
``Qwen3MoeForCausalLM`` (experts in one module, ``gate_up_proj`` ``(E, 2I, H)`` and
``down_proj`` ``(E, H, I)``, called ``experts(hidden_states, top_k_index, top_k_weights)``)
trained at ep2 with ``fully_shard``, and the same model in one process on the whole batch.

The plan is the one a user writes for the Hugging Face model:
``hp.parallelize_module(model, mesh["ep"], {"model.layers.*.mlp.experts":
hp.ExpertParallel()})``, each layer's experts a ``fully_shard`` unit over ``efsdp``
(gradient divide factor: the data-parallel size), each decoder layer and the root units
over every rank. Each rank trains on its own sequences; the loss is transformers' own
(mean cross-entropy of the next token), every rank the same number of tokens, so the
mean of the ranks' losses is the whole batch's. ``experts_implementation`` picks
transformers' kernel for the experts (``eager``: its loop over the experts hit;
``grouped_mm``: its grouped GEMM over every expert).
"""

from __future__ import annotations

import time

import numpy as np

import hyper_parallel as hp

VOCAB, SEQS, SEQ, STEPS, LR = 64, 4, 8, 4, 0.01


def config(experts_implementation: str):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, decoder_sparse_step=1,
                         max_position_embeddings=SEQ, experts_implementation=experts_implementation)
    return cfg


def model(experts_implementation: str):
    """The tiny model, the same initial values in every process."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config(experts_implementation))


def batches() -> list:
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, (SEQS, SEQ)) for _ in range(STEPS)]


def train(net, rows: slice) -> dict:
    """AdamW steps on sequences ``rows`` of each batch: the losses and the whole
    parameters after each step."""
    import torch

    opt = torch.optim.AdamW(net.parameters(), lr=LR, foreach=False)
    out = {"losses": [], "params": []}
    for ids in batches():
        ids = torch.from_numpy(ids[rows])
        loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(float(loss.detach()))
        out["params"].append(dict(hp.get_full_state_dict(net, rank0_only=False)))
    return out


def parallelized(experts_implementation: str, ep: int):
    """The model under the plan of the module note."""
    world = hp.get_platform().world_size()
    mesh = hp.init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    dp = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    net = model(experts_implementation)
    hp.parallelize_module(net, mesh["ep"], {"model.layers.*.mlp.experts": hp.ExpertParallel()})
    for layer in net.model.layers:
        hp.fully_shard(layer.mlp.experts, mesh=mesh["efsdp"])
        layer.mlp.experts.set_gradient_divide_factor(world)
        hp.fully_shard(layer, mesh=dp)
    hp.fully_shard(net, mesh=dp)
    return net


def run(ep: int, implementations: tuple = ("eager", "grouped_mm")) -> dict:
    """Per experts implementation: the one-process reference and the ep run; and the
    seconds the job took on this rank."""
    start = time.perf_counter()
    rank, world = hp.get_platform().rank(), hp.get_platform().world_size()
    per_rank = SEQS // world
    out = {}
    for impl in implementations:
        reference = train(model(impl), slice(None))
        ep_run = train(parallelized(impl, ep), slice(rank * per_rank, (rank + 1) * per_rank))
        out[impl] = {"reference": reference, "ep": ep_run}
    out["seconds"] = time.perf_counter() - start
    return out
