"""The example model's sizes and initial values, shared by both frameworks.

Initial values are drawn with numpy, seeded by parameter name, so the torch and MindSpore
models start identical and a checkpoint of one resumes on the other.
"""

from __future__ import annotations

import zlib

import numpy as np

VOCAB = 256  # bytes
SIZES = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=172, seq=32),  # tests
    "small": dict(hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1024, seq=256),
    "bench": dict(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536, seq=128),
    "124m": dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, seq=256),
}
ROPE_THETA, EPS = 10000.0, 1e-6


def hf_config(size: str) -> dict:
    """The ``transformers`` ``LlamaConfig`` of this model, as ``config.json`` holds it."""
    s = SIZES[size]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
            "hidden_size": s["hidden"], "intermediate_size": s["intermediate"],
            "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv_heads"], "rms_norm_eps": EPS,
            "max_position_embeddings": s["seq"], "rope_theta": ROPE_THETA,
            "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
            "mlp_bias": False, "torch_dtype": "float32"}


def parameter_count(size: str) -> int:
    """Parameters of one model of ``size``: embedding, decoder layers, final norm, head."""
    s = SIZES[size]
    head_dim = s["hidden"] // s["heads"]
    attention = 2 * s["hidden"] * head_dim * (s["heads"] + s["kv_heads"])
    layer = attention + 3 * s["hidden"] * s["intermediate"] + 2 * s["hidden"]
    return 2 * VOCAB * s["hidden"] + s["layers"] * layer + s["hidden"]


def initial(name: str, shape: tuple) -> np.ndarray:
    """Ones for norms, N(0, 0.02) otherwise (Llama's initializer range), seeded by name."""
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return (rng.standard_normal(shape) * 0.02).astype(np.float32)


def rope_tables(seq: int, head_dim: int) -> tuple:
    """cos and sin, ``(seq, head_dim)``, laid out as Llama's rotate-half convention wants."""
    inv_freq = 1.0 / ROPE_THETA ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    angles = np.outer(np.arange(seq, dtype=np.float32), inv_freq)
    angles = np.concatenate([angles, angles], -1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def set_initial_values(model) -> None:
    """Give a sharded model (built without values: meta or ``no_init_parameters``) the
    values ``initial`` defines, one parameter at a time: each rank keeps its rows, and no
    more than one full parameter exists at once."""
    import hyper_parallel as hp

    for key, value in hp.get_state_dict(model).items():
        hp.set_state_dict(model, {key: initial(key, tuple(value.global_shape))}, strict=False)
