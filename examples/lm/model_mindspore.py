"""The Llama-style decoder of model_torch.py in MindSpore, with the same parameter names
(Hugging Face ``LlamaForCausalLM``'s) and the same math, so checkpoints cross frameworks and
``hp.export_full`` of it loads with ``from_pretrained``. Every parameter is made from an
initializer, so a build under ``no_init_parameters()`` allocates nothing until
``fully_shard`` materialises each rank's shard."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops
from mindspore.common.initializer import initializer

import hyper_parallel as hp
from examples.lm.config import EPS, SIZES, VOCAB, initial, rope_tables
from examples.lm.expert_parallel import EXPERTS, TOP_K


class RMSNorm(nn.Cell):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = Parameter(initializer("ones", (dim,), ms.float32), name="weight")

    def construct(self, x):
        x32 = x.astype(ms.float32)
        x32 = x32 * ops.rsqrt((x32 * x32).mean(-1, keep_dims=True) + EPS)
        return self.weight * x32.astype(x.dtype)


class Embedding(mint.nn.Embedding):
    """mint's Embedding (``weight`` named as torch's, and a layer tensor parallelism splits
    by its vocabulary), looking rows up with ``ops.gather``: mint's own lookup has no CPU
    kernel."""

    def __init__(self, vocab: int, dim: int):
        super().__init__(vocab, dim, _weight=initializer("zeros", (vocab, dim), ms.float32))

    def construct(self, ids):
        return ops.gather(self.weight, ids, 0)


def _linear(d_in: int, d_out: int):
    return nn.Dense(d_in, d_out, has_bias=False)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + ops.cat([-x[..., half:], x[..., :half]], -1) * sin


class Attention(nn.Cell):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj = _linear(hidden, heads * self.head_dim)
        self.k_proj = _linear(hidden, kv_heads * self.head_dim)
        self.v_proj = _linear(hidden, kv_heads * self.head_dim)
        self.o_proj = _linear(heads * self.head_dim, hidden)

    def construct(self, x, cos, sin):
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism a rank computes its own heads only
        q = self.q_proj(x).reshape(b, t, -1, self.head_dim).swapaxes(1, 2)
        k = self.k_proj(x).reshape(b, t, -1, self.head_dim).swapaxes(1, 2)
        v = self.v_proj(x).reshape(b, t, -1, self.head_dim).swapaxes(1, 2)
        # the whole sequence's positions: under tensor parallelism x is the gathered sequence
        q, k = _rotate(q, cos[:t], sin[:t]), _rotate(k, cos[:t], sin[:t])
        repeat = q.shape[1] // k.shape[1]
        k, v = ops.repeat_interleave(k, repeat, 1), ops.repeat_interleave(v, repeat, 1)
        # over the whole sequence under hp.context_parallel (docs/context-parallel.md)
        out = hp.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.swapaxes(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class MLP(nn.Cell):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = _linear(hidden, intermediate)
        self.up_proj = _linear(hidden, intermediate)
        self.down_proj = _linear(intermediate, hidden)

    def construct(self, x):
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedExperts(nn.Cell):
    """See model_torch.py's GroupedExperts."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        for name, shape in (("gate_proj", (EXPERTS, hidden, intermediate)),
                            ("up_proj", (EXPERTS, hidden, intermediate)),
                            ("down_proj", (EXPERTS, intermediate, hidden))):
            setattr(self, name, Parameter(initializer("zeros", shape, ms.float32), name=name))

    def construct(self, x, num_tokens_per_expert):
        outs, start = [], 0
        for e, n in enumerate(int(c) for c in num_tokens_per_expert.asnumpy()):
            # no rows: an empty product, as a grouped GEMM's, of a new empty tensor
            # (MindSpore's gradient of a slice of an empty tensor fails)
            rows = x[start:start + n] if n else mint.zeros((0, x.shape[-1]), dtype=x.dtype)
            hidden = ops.silu(ops.matmul(rows, self.gate_proj[e])) * ops.matmul(rows, self.up_proj[e])
            outs.append(ops.matmul(hidden, self.down_proj[e]))
            start += n
        return ops.cat(outs)


class MoE(nn.Cell):
    """See model_torch.py's MoE (a stable sort by expert: sorted by expert, then position)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate = _linear(hidden, EXPERTS)
        self.experts = GroupedExperts(hidden, intermediate // TOP_K)
        self.expert_bias = mint.zeros(EXPERTS, dtype=ms.float32)  # constants, not parameters
        self.tokens_per_expert = mint.zeros(EXPERTS, dtype=ms.float32)

    def construct(self, x):
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        scores = ops.softmax(self.gate(h).astype(ms.float32), -1)
        chosen = ops.topk(ops.stop_gradient(scores) + self.expert_bias, TOP_K, dim=-1)[1]
        weights = ops.gather_elements(scores, 1, chosen).astype(h.dtype)
        flat = chosen.reshape(-1)
        counts = ops.bincount(flat, minlength=EXPERTS)
        self.tokens_per_expert += ops.stop_gradient(counts).astype(ms.float32)
        n = flat.shape[0]
        order = ops.argsort(flat.astype(ms.int32) * n + Tensor(np.arange(n, dtype=np.int32)))
        token_of = Tensor(np.repeat(np.arange(n // TOP_K, dtype=np.int32), TOP_K))
        out = self.experts(h[token_of[order]], counts)
        unsorted = out[ops.argsort(order.astype(ms.int32))].reshape(-1, TOP_K, shape[-1])
        return (unsorted * weights.expand_dims(-1)).sum(1).reshape(shape)


class DecoderLayer(nn.Cell):
    def __init__(self, s: dict, moe: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(s["hidden"])
        self.self_attn = Attention(s["hidden"], s["heads"], s["kv_heads"])
        self.post_attention_layernorm = RMSNorm(s["hidden"])
        self.mlp = (MoE if moe else MLP)(s["hidden"], s["intermediate"])

    def construct(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Cell):
    def __init__(self, s: dict, moe: bool = False):
        super().__init__()
        self.embed_tokens = Embedding(VOCAB, s["hidden"])
        self.layers = nn.CellList([DecoderLayer(s, moe) for _ in range(s["layers"])])
        self.norm = RMSNorm(s["hidden"])
        self.recompute_layers = False  # True: each layer's forward runs again in backward
        cos, sin = rope_tables(s["seq"], s["hidden"] // s["heads"])
        self.cos, self.sin = Tensor(cos), Tensor(sin)  # constants, not parameters

    def construct(self, ids):
        """See model_torch.py's Body.forward."""
        x = self.embed_tokens(ids) if self.embed_tokens is not None else ids
        cos, sin = self.cos.astype(x.dtype), self.sin.astype(x.dtype)
        for layer in self.layers:  # a part without layers holds an empty list
            x = self._layer(layer, x, cos, sin)
        return self.norm(x) if self.norm is not None else x

    def _layer(self, layer, *args):
        """A decoder layer (a fully_shard unit), recomputed in backward under
        ``recompute_layers``."""
        return ms.recompute(layer, *args) if self.recompute_layers else layer(*args)


class LlamaLM(nn.Cell):
    def __init__(self, size: str, moe: bool = False):
        super().__init__()
        s = SIZES[size]
        self.model = Body(s, moe)
        self.lm_head = _linear(s["hidden"], VOCAB)

    def construct(self, ids):
        h = self.model(ids)
        return self.lm_head(h) if self.lm_head is not None else h


def build(size: str, platform, moe: bool = False) -> LlamaLM:
    """``platform``: hyper_parallel's, whose module walk gives the qualified names."""
    model = LlamaLM(size, moe)
    for module_name, sub in platform.named_modules(model):
        for attr, p in platform.direct_params(sub):
            name = f"{module_name}.{attr}" if module_name else attr
            p.set_data(Tensor(initial(name, tuple(p.shape))))
    return model
