"""The mixture-of-experts model of the expert-parallel tests (tests/ep_scenarios.py), one per
framework with the same structure, parameter names and initial values, written as the
models write it (torchtitan's MoE): plain framework modules, nothing of hyper_parallel.

``proj`` (a dense linear layer), then one MoE layer:

- a router (``gate``, no bias) scoring each token's experts with softmax or sigmoid; the
  top ``TOP_K`` experts by score plus ``expert_bias`` (torchtitan's load-balancing bias,
  which only picks experts) are chosen, weighted by their scores (renormalised for
  sigmoid); no token is dropped;
- the chosen rows sorted by expert (stable), ``experts(rows, num_tokens_per_expert)`` (the
  grouped form: ``w1`` ``(E, DIM, HIDDEN)``, ``w2`` ``(E, HIDDEN, DIM)``, each expert's rows
  a run; an expert with no rows computes an empty product, as torchtitan's grouped GEMM,
  so every local expert's weights take part in backward), the results weighted and summed
  per token;
- a shared expert (a dense MLP) on every token;
- the sequence-wise auxiliary load-balancing loss (DeepSeek-V3's: per sequence, ``E/(k S)``
  times the count of each expert times its mean score, averaged over the sequences), so
  data-parallel ranks holding whole sequences compute the mean of one process's terms.

``expert_bias`` starts at ``-10`` for expert ``EMPTY``: no token chooses it, on any rank
(an expert with no tokens), and the few tokens of a rank leave other experts empty there.
The loss is the mean squared error against random targets plus ``AUX`` times the
auxiliary loss. ``recompute``: the experts' forward runs again in backward (activation
recompute: torch's ``checkpoint``, MindSpore's ``recompute``). ``capacity``: the model
drops rows itself as ``ExpertParallel(capacity_factor=...)`` does (``kept_rows``), the
reference of the capacity test.
"""

from __future__ import annotations

import numpy as np

DIM, HIDDEN, EXPERTS, TOP_K = 8, 16, 4, 2
SEQS, SEQ = 4, 6          # the whole batch: SEQS sequences of SEQ tokens
STEPS, LR, AUX = 5, 0.01, 0.01
EMPTY = 3                 # the expert no token chooses


def init_values(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"proj.weight": (DIM, DIM), "proj.bias": (DIM,),
              "moe.gate.weight": (EXPERTS, DIM),
              "moe.experts.w1": (EXPERTS, DIM, HIDDEN), "moe.experts.w2": (EXPERTS, HIDDEN, DIM),
              "moe.shared.w1.weight": (HIDDEN, DIM), "moe.shared.w2.weight": (DIM, HIDDEN)}
    return {name: (0.4 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in shapes.items()}


def initial_bias() -> np.ndarray:
    bias = np.zeros(EXPERTS, np.float32)
    bias[EMPTY] = -10.0
    return bias


def batches(seed: int = 1) -> list:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((SEQS, SEQ, DIM)).astype(np.float32),
             rng.standard_normal((SEQS, SEQ, DIM)).astype(np.float32)) for _ in range(STEPS)]


# ---------------------------------------------------------------- torch
def kept_rows(counts, capacity: float | None) -> np.ndarray:
    """1 for each row (sorted by expert) an expert takes under ``capacity`` (the first
    ``ceil(capacity * rows / EXPERTS)`` of its run), 0 for a dropped one: the capacity
    rule of docs/expert-parallel.md written out, for the reference model."""
    counts = np.asarray(counts, np.int64)
    rows = int(counts.sum())
    within = np.arange(rows) - np.repeat(np.cumsum(counts) - counts, counts)
    limit = rows if capacity is None else int(np.ceil(capacity * rows / EXPERTS))
    return (within < limit).astype(np.float32)[:, None]


def torch_model(score: str = "softmax", recompute: bool = False, capacity: float | None = None):
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class GroupedExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.empty(EXPERTS, DIM, HIDDEN))
            self.w2 = nn.Parameter(torch.empty(EXPERTS, HIDDEN, DIM))

        def forward(self, x, num_tokens_per_expert):
            outs, start = [], 0
            for e, n in enumerate(num_tokens_per_expert.tolist()):
                rows = x[start:start + n]  # no rows: an empty product, as a grouped GEMM's
                outs.append(F.silu(rows @ self.w1[e]) @ self.w2[e])
                start += n
            return torch.cat(outs)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
            self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)))

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(DIM, EXPERTS, bias=False)
            self.experts = GroupedExperts()
            self.shared = MLP()
            self.register_buffer("expert_bias", torch.from_numpy(initial_bias()),
                                 persistent=False)
            self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS), persistent=False)
            self.recompute = recompute

        def forward(self, x):
            seqs, seq, dim = x.shape
            h = x.reshape(-1, dim)
            logits = self.gate(h)
            scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
            _, chosen = torch.topk(scores.detach() + self.expert_bias, TOP_K, dim=-1)
            weights = scores.gather(1, chosen)
            if score == "sigmoid":
                weights = weights / weights.sum(-1, keepdim=True)
            flat = chosen.reshape(-1)
            counts = torch.bincount(flat, minlength=EXPERTS)
            with torch.no_grad():
                self.tokens_per_expert += counts
            order = torch.sort(flat, stable=True).indices
            if self.recompute:  # the experts' forward (dispatch and combine) run again
                out = checkpoint(self.experts, h[order // TOP_K], counts, use_reentrant=False)
            else:
                out = self.experts(h[order // TOP_K], counts)
            if capacity is not None:  # the reference's own drop (kept_rows)
                out = out * torch.from_numpy(kept_rows(counts.numpy(), capacity))
            unsorted = out[torch.argsort(order)].reshape(-1, TOP_K, dim)
            y = (unsorted * weights.unsqueeze(-1)).sum(1) + self.shared(h)
            per_seq = F.one_hot(chosen, EXPERTS).reshape(seqs, seq * TOP_K, EXPERTS).sum(1)
            share = per_seq.float() * EXPERTS / (TOP_K * seq)
            aux = (share * scores.reshape(seqs, seq, EXPERTS).mean(1)).sum(-1).mean()
            return y.reshape(seqs, seq, dim), aux

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(DIM, DIM)
            self.moe = MoE()

        def forward(self, x):
            return self.moe(self.proj(x))

    model = Model()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(init_values()[name]))
    return model


def torch_loss(model, x, target):
    import torch

    y, aux = model(torch.from_numpy(x))
    return ((y - torch.from_numpy(target)) ** 2).mean() + AUX * aux


# ---------------------------------------------------------------- MindSpore
def mindspore_model(score: str = "softmax", recompute: bool = False,
                    capacity: float | None = None):
    import mindspore as ms
    from mindspore import mint, nn, ops

    values = init_values()

    def param(name):
        return ms.Parameter(ms.Tensor(values[name]), name=name)

    class GroupedExperts(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1 = param("moe.experts.w1")
            self.w2 = param("moe.experts.w2")

        def construct(self, x, num_tokens_per_expert):
            outs, start = [], 0
            for e, n in enumerate(int(c) for c in num_tokens_per_expert.asnumpy()):
                # no rows: an empty product, as a grouped GEMM's, of a new empty tensor
                # (MindSpore's gradient of a slice of an empty tensor fails)
                rows = x[start:start + n] if n else mint.zeros((0, DIM), dtype=x.dtype)
                outs.append(mint.matmul(mint.nn.functional.silu(mint.matmul(rows, self.w1[e])),
                                        self.w2[e]))
                start += n
            return mint.cat(outs)

    def linear(name, n_in, n_out, bias):
        layer = mint.nn.Linear(n_in, n_out, bias=bias)
        layer.weight.set_data(ms.Tensor(values[f"{name}.weight"]))
        if bias:
            layer.bias.set_data(ms.Tensor(values[f"{name}.bias"]))
        return layer

    class MLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1 = linear("moe.shared.w1", DIM, HIDDEN, False)
            self.w2 = linear("moe.shared.w2", HIDDEN, DIM, False)

        def construct(self, x):
            return self.w2(mint.nn.functional.silu(self.w1(x)))

    class MoE(nn.Cell):
        def __init__(self):
            super().__init__()
            self.gate = linear("moe.gate", DIM, EXPERTS, False)
            self.experts = GroupedExperts()
            self.shared = MLP()
            self.expert_bias = ms.Tensor(initial_bias())
            self.tokens_per_expert = mint.zeros(EXPERTS, dtype=ms.float32)

        def construct(self, x):
            seqs, seq, dim = x.shape
            h = x.reshape(-1, dim)
            logits = self.gate(h)
            scores = mint.softmax(logits, -1) if score == "softmax" else mint.sigmoid(logits)
            _, chosen = ops.topk(ops.stop_gradient(scores) + self.expert_bias, TOP_K, dim=-1)
            weights = mint.gather(scores, 1, chosen)
            if score == "sigmoid":
                weights = weights / weights.sum(-1, keepdims=True)
            flat = chosen.reshape(-1)
            counts = ops.bincount(flat, minlength=EXPERTS)
            self.tokens_per_expert += ops.stop_gradient(counts).astype(ms.float32)
            n = flat.shape[0]  # sorted by (expert, position): a stable sort by expert
            order = ops.argsort(flat.astype(ms.int32) * n + ms.Tensor(np.arange(n, dtype=np.int32)))
            token_of = ms.Tensor(np.repeat(np.arange(n // TOP_K, dtype=np.int32), TOP_K))
            if recompute:  # the experts' forward (dispatch and combine) run again
                out = ms.recompute(self.experts, h[token_of[order]], counts)
            else:
                out = self.experts(h[token_of[order]], counts)
            if capacity is not None:  # the reference's own drop (kept_rows)
                out = out * ms.Tensor(kept_rows(counts.asnumpy(), capacity))
            unsorted = out[ops.argsort(order.astype(ms.int32))].reshape(-1, TOP_K, dim)
            y = (unsorted * weights.unsqueeze(-1)).sum(1) + self.shared(h)
            per_seq = ops.one_hot(chosen, EXPERTS, ms.Tensor(1.0), ms.Tensor(0.0)).reshape(
                seqs, seq * TOP_K, EXPERTS).sum(1)
            share = per_seq * EXPERTS / (TOP_K * seq)
            aux = (share * scores.reshape(seqs, seq, EXPERTS).mean(1)).sum(-1).mean()
            return y.reshape(seqs, seq, dim), aux

    class Model(nn.Cell):
        def __init__(self):
            super().__init__()
            self.proj = linear("proj", DIM, DIM, True)
            self.moe = MoE()

        def construct(self, x):
            return self.moe(self.proj(x))

    return Model()


def mindspore_loss(model, x, target):
    import mindspore as ms

    x, target = (ms.Tensor(v) if isinstance(v, np.ndarray) else v for v in (x, target))
    y, aux = model(x)
    return ((y - target) ** 2).mean() + AUX * aux
