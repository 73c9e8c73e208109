"""Rank side of the export suite (tests/test_export.py).

- ``export_run`` (either framework): the checkpoint suite's decoder sharded over every rank
  trains a few steps and is exported as one file, as several, and renamed by a ``key_map``;
  returns its full values gathered by ``get_full_state_dict``, which the files must hold
  bit for bit (parity with a single-process reference is tests/test_parity.py's), after a
  second export into "single" (an export replaces its own); and, for a directory holding
  weights or a config the user put there, the error each rank raised and whether every
  file was left byte for byte.
- ``hf_run`` (torch): a small ``transformers`` Llama with tied embeddings, sharded, trained
  a step and exported with its config; returns its logits on a batch.
"""

from __future__ import annotations

import os

import numpy as np

import hyper_parallel as hp
from tests.checkpoint_scenarios import STEPS, _sharded, _side, _train

SMALL_SHARD_BYTES = 4096  # splits the decoder over several files


def renamed(name: str) -> str | None:
    """The export's ``key_map`` test: a prefix, and the final norm left out."""
    return None if name == "norm.weight" else f"model.{name}"


def _users_directory(path: str, files: dict) -> None:
    """Rank 0 writes the user's files; every rank waits for them."""
    if hp.get_platform().rank() == 0:
        os.makedirs(path)
        for name, data in files.items():
            with open(os.path.join(path, name), "wb") as handle:
                handle.write(data)
    hp.get_platform().barrier()


def _refused(path: str, files: dict, export) -> dict:
    """Export into a directory of the user's ``files``: the error, and whether every file
    is unchanged and none was added."""
    _users_directory(path, files)
    try:
        export(path)
        error = None
    except Exception as caught:  # noqa: BLE001 - the test reads the type and message
        error = f"{type(caught).__name__}: {caught}"
    unchanged = sorted(os.listdir(path)) == sorted(files) and all(
        open(os.path.join(path, name), "rb").read() == data for name, data in files.items())
    return {"error": error, "unchanged": unchanged}


# weights and a config a user keeps: the original model a run fine-tunes
USERS_WEIGHTS = {"model.safetensors": b"the original weights", "tokenizer.json": b"{}"}
USERS_CONFIG = {"config.json": b'{"model_type": "theirs"}', "tokenizer.json": b"{}"}


def export_run(directory: str) -> dict:
    side = _side()
    model, opt = _sharded(side, (hp.get_platform().world_size(),))
    _train(side, model, opt, 0, STEPS)
    hp.export_full(os.path.join(directory, "single"), model, max_shard_bytes=SMALL_SHARD_BYTES)
    hp.export_full(os.path.join(directory, "single"), model)  # replaces its own export
    hp.export_full(os.path.join(directory, "sharded"), model, max_shard_bytes=SMALL_SHARD_BYTES)
    hp.export_full(os.path.join(directory, "renamed"), model, key_map=renamed)
    refused = {
        "weights": _refused(os.path.join(directory, "users-weights"), USERS_WEIGHTS,
                            lambda path: hp.export_full(path, model)),
        "config": _refused(os.path.join(directory, "users-config"), USERS_CONFIG,
                           lambda path: hp.export_full(path, model, config={"model_type": "ours"})),
    }
    return {"gathered": hp.get_full_state_dict(model, rank0_only=False), "refused": refused}


HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 61,
             "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
             "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": True,
             "torch_dtype": "float32"}


def hf_batch() -> np.ndarray:
    return np.random.default_rng(3).integers(0, HF_CONFIG["vocab_size"], size=(2, 12))


def hf_run(directory: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**HF_CONFIG))
    for layer in model.model.layers:
        hp.fully_shard(layer)
    hp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.from_numpy(hf_batch())
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    untied = {k: v for k, v in HF_CONFIG.items() if k != "tie_word_embeddings"}
    try:
        hp.export_full(directory, model, config=untied)
        refused = ""
    except ValueError as error:
        refused = str(error)
    wrote_nothing = not os.path.exists(directory)
    hp.export_full(directory, model, config=HF_CONFIG)
    with torch.no_grad():
        logits = model(ids).logits.numpy()
    return {"logits": logits, "refused": refused, "wrote_nothing": wrote_nothing}


def example_batch() -> np.ndarray:
    return np.random.default_rng(5).integers(0, 256, size=(2, 16))


def example_run(directory: str) -> np.ndarray:
    """The example's Llama-style model (tiny size) sharded and exported with its config;
    its logits on ``example_batch``."""
    from examples.lm.config import hf_config

    platform = hp.get_platform()
    if platform.name == "torch":
        import torch

        from examples.lm.model_torch import build

        model = build("tiny")
        ids = torch.from_numpy(example_batch())
    else:
        import mindspore as ms

        from examples.lm.model_mindspore import build

        model = build("tiny", platform)
        ids = ms.Tensor(example_batch().astype(np.int32))
    for layer in model.model.layers:
        hp.fully_shard(layer)
    hp.fully_shard(model)
    hp.export_full(directory, model, config=hf_config("tiny"))
    with platform.no_grad():
        return platform.to_numpy(model(ids))
