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

``export`` (the first implementation's run): the trained model exported with
``hf_names`` (each grouped experts parameter written as the per-expert tensors of a
Qwen3-MoE checkpoint, ``gate_up_proj`` cut into each expert's ``gate_proj`` and
``up_proj``), then loaded by rank 0 with transformers' ``from_pretrained``: its logits
and the trained model's on the same tokens.
"""

from __future__ import annotations

import os
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


def hf_names(name: str):
    """The export ``key_map``: a layer's grouped experts as a Qwen3-MoE checkpoint's
    per-expert tensors, every other name as it is."""
    prefix, _, attr = name.rpartition(".")
    if not prefix.endswith("mlp.experts"):
        return name
    experts = f"{prefix}.{{expert}}"
    if attr == "gate_up_proj":
        return hp.per_expert_keys([f"{experts}.gate_proj.weight", f"{experts}.up_proj.weight"],
                                  config("eager").num_experts)
    return hp.per_expert_keys(f"{experts}.{attr}.weight", config("eager").num_experts)


def exported_logits(net, directory: str) -> dict:
    """The trained model's logits on one batch's first sequence (every rank computes,
    its experts' rows cross the ranks) and, on rank 0, those of its export loaded by
    ``from_pretrained``."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    ids = torch.from_numpy(batches()[0][:1])
    with torch.no_grad():
        out = {"trained": net(input_ids=ids).logits.numpy()}
    hp.export_full(directory, net, config=net.config.to_dict(), key_map=hf_names)
    if hp.get_platform().rank() == 0:
        from safetensors import safe_open

        with safe_open(os.path.join(directory, "model.safetensors"), "np") as file:
            out["names"] = sorted(file.keys())
        loaded = Qwen3MoeForCausalLM.from_pretrained(directory)
        with torch.no_grad():
            out["loaded"] = loaded(input_ids=ids).logits.numpy()
    return out


def run(ep: int, implementations: tuple = ("eager", "grouped_mm"),
        directory: str | None = None) -> dict:
    """Per experts implementation: the one-process reference and the ep run (with
    ``directory``: the first one's export, ``exported_logits``); and the seconds the job
    took on this rank."""
    start = time.perf_counter()
    rank, world = hp.get_platform().rank(), hp.get_platform().world_size()
    per_rank = SEQS // world
    out = {}
    for impl in implementations:
        reference = train(model(impl), slice(None))
        net = parallelized(impl, ep)
        ep_run = train(net, slice(rank * per_rank, (rank + 1) * per_rank))
        out[impl] = {"reference": reference, "ep": ep_run}
        if directory is not None and impl == implementations[0]:
            out[impl]["export"] = exported_logits(net, os.path.join(directory, impl))
    out["seconds"] = time.perf_counter() - start
    return out
