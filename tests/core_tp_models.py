"""The models and plans of the core tensor-parallel tests (tests/core_tp_scenarios.py), one
per framework with the same structure, parameter names and initial values.

A small language model: a vocabulary-parallel embedding, one pre-norm block (attention with
q/k/v column-wise (k without bias: a key bias gets a zero gradient, whose rounding noise
AdamW's normalisation would amplify into steps that differ between any two runs) and o row-wise; an MLP with w1 column-wise and w2 row-wise), a final norm
and a column-wise head. Two plans:

- ``replicated``: activations replicated between blocks (the styles' default layouts),
  norms left whole, the head's logits gathered (``output_layouts=Replicate()``);
- ``layouts``: the other moves: a column-wise embedding (torch), a replicated input and a
  row-wise layer's replicated output kept as layout tensors (``PrepareModuleInputOutput``,
  ``use_local_output=False``), a replicated input split on the sequence and gathered
  again (``PrepareModuleInput``), the final norm's output split on the batch
  (``PrepareModuleOutput``) for a head that gathers its rows;
- ``sequence``: torchtitan's sequence-parallel plan: embedding and row-wise outputs
  Shard(1), norms ``SequenceParallel``, the attention's input prepared by
  ``PrepareModuleInput`` and the MLP's by ``PrepareModuleInputOutput``, the head's
  logits left split on the class dim for loss parallelism.

The head reads ``h.reshape(-1, dim)``: under the sequence plan each rank's rows are its
own sequence part, so the gathered rows are rank-major (``targets_for``).
"""

from __future__ import annotations

import numpy as np

VOCAB, DIM, HEAD_DIM, HIDDEN = 16, 8, 4, 16
BATCH, SEQ = 2, 4
STEPS = 3


def init_values(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"embed.weight": (VOCAB, DIM), "attn_norm.weight": (DIM,), "attn_norm.bias": (DIM,),
              "ffn_norm.weight": (DIM,), "ffn_norm.bias": (DIM,), "norm.weight": (DIM,),
              "norm.bias": (DIM,), "head.weight": (VOCAB, DIM)}
    for name in ("wq", "wk", "wv", "wo"):
        shapes[f"attn.{name}.weight"], shapes[f"attn.{name}.bias"] = (DIM, DIM), (DIM,)
    del shapes["attn.wk.bias"]  # its gradient is zero (softmax ignores a shift of all keys)
    shapes["ffn.w1.weight"], shapes["ffn.w1.bias"] = (HIDDEN, DIM), (HIDDEN,)
    shapes["ffn.w2.weight"], shapes["ffn.w2.bias"] = (DIM, HIDDEN), (DIM,)
    values = {}
    for name, shape in shapes.items():
        scale = 1.0 if name.endswith("norm.weight") else 0.3
        base = 1.0 if name.endswith("norm.weight") else 0.0
        values[name] = (base + scale * rng.standard_normal(shape)).astype(np.float32)
    return values


def batches(seed: int = 1) -> list:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64),
             rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64)) for _ in range(STEPS)]


def targets_for(targets: np.ndarray, plan: str, tp: int) -> np.ndarray:
    """The head's rows' targets: natural order, or rank-major under the sequence plan."""
    if plan != "sequence":
        return targets.reshape(-1)
    return np.concatenate([part.reshape(-1) for part in np.split(targets, tp, axis=1)])


def plan(names, kind: str, colwise_embedding: bool = True, local_norms: bool = False) -> dict:
    """The plan ``kind`` with the styles and placements of ``names`` (a module: torch's
    ``torch.distributed.tensor.parallel`` + placements, or hyper_parallel.tensor_parallel).
    ``colwise_embedding=False``: the ``layouts`` plan keeps the embedding
    vocabulary-parallel (MindSpore's ``nn.Embedding`` computes with its rows split only).
    ``local_norms=True``: the sequence plan's block norms hand plain tensors to the blocks
    (``ms.recompute`` differentiates a recomputed cell by its framework-tensor inputs only)."""
    Shard, Replicate = names.Shard, names.Replicate
    col, row = names.ColwiseParallel, names.RowwiseParallel
    if kind == "replicated":
        return {"embed": row(input_layouts=Replicate()), "attn.w[qkv]": col(),
                "attn.wo": row(), "ffn.w1": col(), "ffn.w2": row(),
                "head": col(output_layouts=Replicate())}
    if kind == "layouts":
        return {
            "embed": col(output_layouts=Replicate()) if colwise_embedding
            else row(input_layouts=Replicate()),
            "attn": names.PrepareModuleInputOutput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                output_layouts=(Replicate(),), desired_output_layouts=(Replicate(),)),
            "attn.w[qkv]": col(), "attn.wo": row(use_local_output=False),
            "ffn": names.PrepareModuleInput(input_layouts=(Replicate(),),
                                            desired_input_layouts=(Shard(1),)),
            "ffn.w1": col(), "ffn.w2": row(),
            "norm": names.PrepareModuleOutput(output_layouts=Replicate(),
                                              desired_output_layouts=Shard(0)),
            "head": col(input_layouts=Shard(0), output_layouts=Replicate()),
        }
    return {
        "embed": row(input_layouts=Replicate(), output_layouts=Shard(1)),
        "*_norm": names.SequenceParallel(use_local_output=local_norms),
        "attn": names.PrepareModuleInput(input_layouts=(Shard(1),),
                                         desired_input_layouts=(Replicate(),)),
        "attn.w[qkv]": col(), "attn.wo": row(output_layouts=Shard(1)),
        "ffn": names.PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
            output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),)),
        "ffn.w1": col(), "ffn.w2": row(output_layouts=Shard(1), use_local_output=False),
        "norm": names.SequenceParallel(use_local_output=True),
        "head": col(input_layouts=Shard(0), use_local_output=False),
    }


def torch_model(recompute: bool = False):
    """``recompute``: the attention and the MLP recomputed in backward
    (``torch.utils.checkpoint``, non-reentrant)."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wv, self.wo = (nn.Linear(DIM, DIM) for _ in range(3))
            self.wk = nn.Linear(DIM, DIM, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (w(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
                       for w in (self.wq, self.wk, self.wv))
            scores = torch.softmax(q @ k.transpose(-1, -2) / HEAD_DIM ** 0.5, -1)
            return self.wo((scores @ v).transpose(1, 2).reshape(b, s, -1))

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

        def forward(self, x):
            return self.w2(torch.relu(self.w1(x)))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.attn_norm, self.attn = nn.LayerNorm(DIM), Attention()
            self.ffn_norm, self.ffn = nn.LayerNorm(DIM), FeedForward()
            self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, ids):
            h = self.embed(ids)
            h = h + self._block(self.attn, self.attn_norm(h))
            h = h + self._block(self.ffn, self.ffn_norm(h))
            h = self.norm(h)
            return self.head(h.reshape(-1, h.shape[-1]))

        def _block(self, block, x):
            return checkpoint(block, x, use_reentrant=False) if recompute else block(x)

    model = LM()
    values = init_values()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(values[name]))
    return model


#: MindSpore parameter names -> the torch names of init_values
MS_NAMES = {"embed.embedding_table": "embed.weight"}


def mindspore_name(name: str) -> str:
    """A MindSpore model's parameter name as torch's (gamma/beta of nn.LayerNorm)."""
    name = MS_NAMES.get(name, name)
    return name.replace(".gamma", ".weight").replace(".beta", ".bias")


def mindspore_model(with_values: bool = True, recompute: bool = False):
    """The MindSpore model; ``with_values=False`` keeps the layers' own initializers (built
    under ``no_init_parameters()``, its parameters stay deferred). Its LayerNorms take
    torch's epsilon, so the two frameworks' models compute the same function.
    ``recompute``: the attention and the MLP recomputed in backward (``ms.recompute``)."""
    import mindspore as ms
    from mindspore import mint, nn

    class Attention(nn.Cell):
        def __init__(self):
            super().__init__()
            self.wq, self.wv, self.wo = (nn.Dense(DIM, DIM) for _ in range(3))
            self.wk = nn.Dense(DIM, DIM, has_bias=False)

        def construct(self, x):
            b, s, _ = x.shape
            q, k, v = (w(x).view(b, s, -1, HEAD_DIM).swapaxes(1, 2)
                       for w in (self.wq, self.wk, self.wv))
            scores = mint.softmax(mint.matmul(q, k.swapaxes(-1, -2)) / HEAD_DIM ** 0.5, -1)
            return self.wo(mint.matmul(scores, v).swapaxes(1, 2).reshape(b, s, -1))

    class FeedForward(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = mint.nn.Linear(DIM, HIDDEN), mint.nn.Linear(HIDDEN, DIM)

        def construct(self, x):
            return self.w2(mint.nn.functional.relu(self.w1(x)))

    class LM(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.attn_norm, self.attn = nn.LayerNorm((DIM,), epsilon=1e-5), Attention()
            self.ffn_norm, self.ffn = nn.LayerNorm((DIM,), epsilon=1e-5), FeedForward()
            self.norm = nn.LayerNorm((DIM,), epsilon=1e-5)
            self.head = nn.Dense(DIM, VOCAB, has_bias=False)

        def construct(self, ids):
            h = self.embed(ids)
            h = h + self._block(self.attn, self.attn_norm(h))
            h = h + self._block(self.ffn, self.ffn_norm(h))
            h = self.norm(h)
            return self.head(h.reshape(-1, h.shape[-1]))

        def _block(self, block, x):
            return ms.recompute(block, x) if recompute else block(x)

    model = LM()
    if with_values:
        values = init_values()
        for name, param in model.parameters_and_names():
            param.set_data(ms.Tensor(values[mindspore_name(name)]))
    return model


def bad_input_model(backend: str):
    """Children a plan can name wrongly: ``fc`` Linear(8, 8), ``odd`` Linear(8, 5) (5 does not
    split over 2), ``conv`` a convolution, ``act`` a layer without parameters, ``embed``
    an Embedding(16, 8), ``head`` a Linear(8, 16) whose weight is ``embed``'s (tied); on
    MindSpore also ``dense_relu``, a Dense(8, 8) with its activation inside."""
    if backend == "torch":
        from torch import nn

        model = nn.Module()
        model.fc, model.odd, model.conv = nn.Linear(8, 8), nn.Linear(8, 5), nn.Conv1d(2, 2, 1)
        model.act, model.embed = nn.ReLU(), nn.Embedding(VOCAB, 8)
        model.head = nn.Linear(8, VOCAB, bias=False)
        model.head.weight = model.embed.weight
        return model
    from mindspore import nn

    model = nn.Cell()
    model.fc, model.odd, model.conv = nn.Dense(8, 8), nn.Dense(8, 5), nn.Conv1d(2, 2, 1)
    model.act, model.embed = nn.ReLU(), nn.Embedding(VOCAB, 8)
    model.head = nn.Dense(8, VOCAB, has_bias=False)
    model.head._params["weight"] = model.embed.embedding_table  # tied, as set_local_param
    model.dense_relu = nn.Dense(8, 8, activation="relu")
    return model


def forward_hook_count(backend: str, module) -> int:
    """The forward hooks (pre and post) installed on ``module``."""
    if backend == "torch":
        return len(module._forward_pre_hooks) + len(module._forward_hooks)
    return sum(len(getattr(module, attr, None) or {}) for attr in (
        "_lazy_forward_pre_hook", "_lazy_forward_hook", "_lazy_forward_pre_hook_with_kwargs",
        "_lazy_forward_hook_with_kwargs"))
