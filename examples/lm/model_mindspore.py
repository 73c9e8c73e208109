"""The Llama-style decoder of model_torch.py in MindSpore, with the same parameter names
(Hugging Face ``LlamaForCausalLM``'s) and the same math, so checkpoints cross frameworks and
``hp.export_full`` of it loads with ``from_pretrained``. Every parameter is made from an
initializer, so a build under ``no_init_parameters()`` allocates nothing until
``fully_shard`` materialises each rank's shard."""

from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, Tensor, mint, nn, ops
from mindspore.common.initializer import initializer

import hyper_parallel as hp
from examples.lm.config import EPS, SIZES, VOCAB, initial, rope_tables


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
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
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


class DecoderLayer(nn.Cell):
    def __init__(self, s: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(s["hidden"])
        self.self_attn = Attention(s["hidden"], s["heads"], s["kv_heads"])
        self.post_attention_layernorm = RMSNorm(s["hidden"])
        self.mlp = MLP(s["hidden"], s["intermediate"])

    def construct(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Cell):
    def __init__(self, s: dict):
        super().__init__()
        self.embed_tokens = Embedding(VOCAB, s["hidden"])
        self.layers = nn.CellList([DecoderLayer(s) for _ in range(s["layers"])])
        self.norm = RMSNorm(s["hidden"])
        cos, sin = rope_tables(s["seq"], s["hidden"] // s["heads"])
        self.cos, self.sin = Tensor(cos), Tensor(sin)  # constants, not parameters

    def construct(self, ids):
        x = self.embed_tokens(ids)
        t = ids.shape[1]
        cos, sin = self.cos[:t].astype(x.dtype), self.sin[:t].astype(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaLM(nn.Cell):
    def __init__(self, size: str):
        super().__init__()
        s = SIZES[size]
        self.model = Body(s)
        self.lm_head = _linear(s["hidden"], VOCAB)

    def construct(self, ids):
        return self.lm_head(self.model(ids))


def build(size: str, platform) -> LlamaLM:
    """``platform``: hyper_parallel's, whose module walk gives the qualified names."""
    model = LlamaLM(size)
    for module_name, sub in platform.named_modules(model):
        for attr, p in platform.direct_params(sub):
            name = f"{module_name}.{attr}" if module_name else attr
            p.set_data(Tensor(initial(name, tuple(p.shape))))
    return model
