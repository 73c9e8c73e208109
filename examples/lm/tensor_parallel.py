"""The example model's tensor-parallel plan, written once for both frameworks.

[Note: the plan]
Megatron's split as torchtitan writes it for Llama, over the tensor-parallel dim of the
mesh, with hyper_parallel's public names (on torch they are torch's own styles and
placements, on MindSpore hyper_parallel.tensor_parallel's):

- the embedding vocabulary-parallel (rows split), its output split on the sequence;
- in each decoder layer, the norms sequence-parallel; the attention's and the MLP's input
  gathered from the sequence shards; q/k/v and gate/up column-wise (each rank computes its
  heads and its part of the MLP's width), o and down row-wise, their partial sums
  reduce-scattered back onto the sequence shards; a mixture of experts in place of the MLP
  (``--moe``) is computed whole by every rank of the group on the gathered sequence, its
  experts split over the expert-parallel ranks instead, and its output cut back onto the
  sequence shards;
- the final norm sequence-parallel, the head column-wise with its logits left split on the
  vocabulary, for the loss (``loss_parallel``), which never gathers them.

Every rank of a tensor-parallel group feeds the same batch. The head is untied from the
embedding (Hugging Face Llama's default). Both styles split a tied weight the same way
(rows of the vocabulary), but each gives its module a parameter of its own: on MindSpore
``parallelize_module`` refuses a tied weight (ValueError naming both modules); torch's
would silently make two parameters of it. So the example offers no tied head.
"""

from __future__ import annotations

from examples.lm.config import SIZES, VOCAB


def check_degree(size: str, tp: int, seq: int) -> str | None:
    """Why ``size`` cannot be split over ``tp`` ranks (None if it can): every split layer
    must divide evenly, and each rank must hold whole attention heads."""
    s = SIZES[size]
    for what, n in (("heads", s["heads"]), ("kv heads", s["kv_heads"]),
                    ("MLP width", s["intermediate"]), ("vocabulary", VOCAB),
                    ("sequence length (--seq)", seq)):
        if n % tp:
            return f"size {size}'s {what} ({n}) does not divide over --tp {tp}"
    return None


def lm_plan(hp, attention_inputs: int, moe: bool = False) -> dict:
    """``{submodule key: style}`` for ``hp.parallelize_module(model, tp_mesh, plan)``;
    ``attention_inputs``: how many positional inputs the attention takes (the hidden
    states first; the rotary tables that follow are the same on every rank); ``moe``: the
    MLPs are mixtures of experts, which every rank of the group computes whole on the
    gathered sequence (their experts split over the expert-parallel ranks instead), their
    output cut back onto the sequence shards."""
    Shard, Replicate = hp.Shard, hp.Replicate
    constants = (None,) * (attention_inputs - 1)
    layer = {
        "input_layernorm": hp.SequenceParallel(),
        "self_attn": hp.PrepareModuleInput(input_layouts=(Shard(1),) + constants,
                                           desired_input_layouts=(Replicate(),) + constants),
        "self_attn.[qkv]_proj": hp.ColwiseParallel(),
        "self_attn.o_proj": hp.RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": hp.SequenceParallel(),
    }
    if moe:
        layer["mlp"] = hp.PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
            use_local_input=True, output_layouts=Replicate(), desired_output_layouts=Shard(1))
    else:
        layer.update({
            "mlp": hp.PrepareModuleInput(input_layouts=(Shard(1),),
                                         desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": hp.ColwiseParallel(),
            "mlp.up_proj": hp.ColwiseParallel(),
            "mlp.down_proj": hp.RowwiseParallel(output_layouts=Shard(1)),
        })
    plan = {"model.embed_tokens": hp.RowwiseParallel(input_layouts=Replicate(),
                                                     output_layouts=Shard(1))}
    plan.update({f"model.layers.*.{key}": style for key, style in layer.items()})
    plan["model.norm"] = hp.SequenceParallel()
    plan["lm_head"] = hp.ColwiseParallel(input_layouts=Shard(1), use_local_output=False)
    return plan
