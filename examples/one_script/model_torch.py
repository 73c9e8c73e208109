"""The model of examples/one_script/train.py, written with torch, and torch's training step.

This file and model_mindspore.py are the only framework code of the example: the same
small transformer (an embedding, pre-norm blocks of causal attention and an MLP, a final
norm and a head), its parameters named as in model_mindspore.py once MindSpore's own
layer names are read as torch's (``hp.torch_nn_names``), and one optimizer step the way
the framework trains. Everything else (meshes, tensor parallelism, fully_shard, the
loss, checkpoints, export) is train.py's, the same lines on both frameworks.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(3))
        # no key bias: softmax ignores a shift shared by all keys, so its gradient is zero
        # up to rounding, which AdamW would blow up into steps no two runs agree on
        self.wk = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape  # heads = -1: a tensor-parallel rank computes its own heads
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal, float("-inf")).softmax(-1)
        return self.wo((scores @ v).transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, head_dim: int, hidden: int):
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(dim), Attention(dim, head_dim)
        self.ffn_norm, self.ffn = nn.LayerNorm(dim), FeedForward(dim, hidden)

    def forward(self, h):
        h = h + self.attn(self.attn_norm(h))
        return h + self.ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, head_dim: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, head_dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        # a pipeline stage's part of the model (hp.pipelining.pipeline_module_split) lacks
        # the modules of the other stages: None, or blocks left out of the list
        h = self.embed(ids) if self.embed is not None else ids
        for block in self.blocks:
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h


def build(values: dict, **sizes) -> Transformer:
    """The model with ``values`` (``{torch name: numpy array}``) as its parameters."""
    model = Transformer(**sizes)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(values[name]))
    return model


def optimizer(model, lr: float):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def train_step(model, opt, loss_fn, ids, targets, max_norm: float, clip) -> float:
    """One step of torch's own loop: ``loss_fn(ids, targets)``, backward, ``clip``
    (``hp.clip_grad_norm_``) to ``max_norm``, the optimizer; returns the loss."""
    loss = loss_fn(ids, targets)
    loss.backward()
    clip(model.parameters(), max_norm)
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def numpy_of(tensor) -> np.ndarray:
    return tensor.detach().numpy()
