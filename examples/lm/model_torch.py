"""A Llama-style decoder in torch, with Hugging Face ``LlamaForCausalLM``'s parameter names
(so ``hp.export_full`` of it loads with ``from_pretrained``): RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU; with ``moe`` a mixture of grouped SwiGLU experts in place
of each MLP (examples/lm/expert_parallel.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from examples.lm.config import EPS, SIZES, VOCAB, initial, rope_tables
from examples.lm.expert_parallel import EXPERTS, TOP_K


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
        return self.weight * x32.to(x.dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism a rank computes its own heads only
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        # the whole sequence's positions: under tensor parallelism x is the gathered sequence
        q, k = _rotate(q, cos[:t], sin[:t]), _rotate(k, cos[:t], sin[:t])
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedExperts(nn.Module):
    """SwiGLU experts held grouped, torchtitan's form: ``experts(x, num_tokens_per_expert)``
    with the rows grouped by expert (an expert with no rows computes an empty product, so
    its weights take part in every backward, as with a grouped GEMM)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(EXPERTS, hidden, intermediate))
        self.up_proj = nn.Parameter(torch.empty(EXPERTS, hidden, intermediate))
        self.down_proj = nn.Parameter(torch.empty(EXPERTS, intermediate, hidden))

    def forward(self, x, num_tokens_per_expert):
        outs, start = [], 0
        for e, n in enumerate(num_tokens_per_expert.tolist()):
            rows = x[start:start + n]  # no rows: an empty product, as a grouped GEMM's
            hidden = F.silu(rows @ self.gate_proj[e]) * (rows @ self.up_proj[e])
            outs.append(hidden @ self.down_proj[e])
            start += n
        return torch.cat(outs)


class MoE(nn.Module):
    """Top-k softmax routing over grouped experts; the router's bias (outside autograd)
    only picks experts, and the counts it is updated from accumulate here."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate = nn.Linear(hidden, EXPERTS, bias=False)
        self.experts = GroupedExperts(hidden, intermediate // TOP_K)
        self.register_buffer("expert_bias", torch.zeros(EXPERTS), persistent=False)
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS), persistent=False)

    def forward(self, x):
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        scores = self.gate(h).float().softmax(-1)
        chosen = torch.topk(scores.detach() + self.expert_bias, TOP_K, dim=-1).indices
        weights = scores.gather(1, chosen).to(h.dtype)
        flat = chosen.reshape(-1)
        counts = torch.bincount(flat, minlength=EXPERTS)
        with torch.no_grad():
            self.tokens_per_expert += counts
        order = torch.sort(flat, stable=True).indices
        out = self.experts(h[order // TOP_K], counts)
        unsorted = out[torch.argsort(order)].reshape(-1, TOP_K, shape[-1])
        return (unsorted * weights.unsqueeze(-1)).sum(1).reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, s: dict, moe: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(s["hidden"])
        self.self_attn = Attention(s["hidden"], s["heads"], s["kv_heads"])
        self.post_attention_layernorm = RMSNorm(s["hidden"])
        self.mlp = (MoE if moe else MLP)(s["hidden"], s["intermediate"])

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, s: dict, moe: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, s["hidden"])
        self.layers = nn.ModuleList([DecoderLayer(s, moe) for _ in range(s["layers"])])
        self.norm = RMSNorm(s["hidden"])
        self.recompute_layers = False  # True: each layer's forward runs again in backward
        self.seq, self.head_dim = s["seq"], s["hidden"] // s["heads"]
        self.register_buffer("cos", torch.empty(self.seq, self.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(self.seq, self.head_dim), persistent=False)
        self.init_rope()

    def init_rope(self):
        """Fill the rotary tables: at construction, and again after ``to_empty`` (a model
        built on the meta device has no values until then)."""
        if self.cos.is_meta:
            return
        cos, sin = rope_tables(self.seq, self.head_dim)
        with torch.no_grad():
            self.cos.copy_(torch.from_numpy(cos))
            self.sin.copy_(torch.from_numpy(sin))

    def forward(self, ids):
        """Token ids, or a pipeline stage's input hidden states where this part has no
        embedding; parts a stage does not hold are None (or absent layers)."""
        x = self.embed_tokens(ids) if self.embed_tokens is not None else ids
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for layer in self.layers:  # a part without layers holds an empty list
            x = self._layer(layer, x, cos, sin)
        return self.norm(x) if self.norm is not None else x

    def _layer(self, layer, *args):
        """A decoder layer (a fully_shard unit), recomputed in backward under
        ``recompute_layers``."""
        if self.recompute_layers:
            return checkpoint(layer, *args, use_reentrant=False)
        return layer(*args)


class LlamaLM(nn.Module):
    def __init__(self, size: str, moe: bool = False):
        super().__init__()
        s = SIZES[size]
        self.model = Body(s, moe)
        self.lm_head = nn.Linear(s["hidden"], VOCAB, bias=False)

    def forward(self, ids):
        h = self.model(ids)
        return self.lm_head(h) if self.lm_head is not None else h


def build(size: str, moe: bool = False) -> LlamaLM:
    model = LlamaLM(size, moe)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(initial(name, tuple(p.shape))))
    return model
