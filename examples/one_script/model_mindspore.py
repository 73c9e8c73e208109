"""The model of examples/one_script/train.py, written with MindSpore, and MindSpore's
training step (model_torch.py says why this file exists)."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import mint, nn

import hyper_parallel as hp


class Attention(nn.Cell):
    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wv, self.wo = (nn.Dense(dim, dim) for _ in range(3))
        self.wk = nn.Dense(dim, dim, has_bias=False)  # why: model_torch.py

    def construct(self, x):
        b, s, _ = x.shape  # heads = -1: a tensor-parallel rank computes its own heads
        q, k, v = (w(x).view(b, s, -1, self.head_dim).swapaxes(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        scores = mint.matmul(q, k.swapaxes(-1, -2)) / self.head_dim ** 0.5
        causal = mint.triu(mint.ones((s, s), dtype=ms.bool_), 1)
        scores = mint.softmax(scores.masked_fill(causal, float("-inf")), -1)
        return self.wo(mint.matmul(scores, v).swapaxes(1, 2).reshape(b, s, -1))


class FeedForward(nn.Cell):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w2 = nn.Dense(dim, hidden), nn.Dense(hidden, dim)

    def construct(self, x):
        return self.w2(mint.nn.functional.relu(self.w1(x)))


class Block(nn.Cell):
    def __init__(self, dim: int, head_dim: int, hidden: int):
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm((dim,), epsilon=1e-5), Attention(dim, head_dim)
        self.ffn_norm, self.ffn = nn.LayerNorm((dim,), epsilon=1e-5), FeedForward(dim, hidden)

    def construct(self, h):
        h = h + self.attn(self.attn_norm(h))
        return h + self.ffn(self.ffn_norm(h))


class Transformer(nn.Cell):
    def __init__(self, vocab: int, dim: int, head_dim: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.CellList([Block(dim, head_dim, hidden) for _ in range(layers)])
        self.norm = nn.LayerNorm((dim,), epsilon=1e-5)
        self.head = nn.Dense(dim, vocab, has_bias=False)

    def construct(self, ids):
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
    for name, param in model.parameters_and_names():
        param.set_data(ms.Tensor(values[hp.torch_nn_names(name)]))
    return model


def optimizer(model, lr: float):
    from mindspore.experimental.optim import AdamW

    return AdamW(model.trainable_params(), lr=lr, weight_decay=0.1)


def train_step(model, opt, loss_fn, ids, targets, max_norm: float, clip) -> float:
    """One step of MindSpore's own loop: the loss and gradients of ``loss_fn(ids,
    targets)``, ``clip`` (``hp.clip_grad_norm_``) to ``max_norm``, the optimizer."""
    loss, grads = ms.value_and_grad(loss_fn, None, opt.parameters)(ids, targets)
    grads, _ = clip(opt.parameters, max_norm, grads=grads)
    opt(grads)
    return float(loss)


def numpy_of(tensor) -> np.ndarray:
    return tensor.asnumpy()
