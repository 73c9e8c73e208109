"""Hugging Face-layout export (tests/export_scenarios.py): a model sharded over 2 ranks and
trained a few steps exports exactly (bit for bit) the full values ``get_full_state_dict``
gathers from it, as one file and as several with an index; on torch,
``transformers`` loads the export of a tied-embedding Llama and its logits match the
sharded model's (to FP32_RTOL, tests/tolerance.py: the same math in another process), and
a config that would not tie the embeddings back is refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.export_scenarios import SMALL_SHARD_BYTES, example_batch, hf_batch, renamed
from tests import shared_launch
from tests.multirank import run_ranks
from tests.tolerance import FP32_RTOL, assert_close

# MindSpore's logits against transformers' torch Llama: fp32, other kernels (not measured
# across CPUs: transformers is an optional extra)
EXAMPLE_CROSS_RTOL = 1e-4


def _read(directory: str) -> tuple:
    """The exported tensors and the files holding them."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(directory, "model.safetensors")), ["model.safetensors"]
    with open(index, encoding="utf-8") as file:
        weight_map = json.load(file)["weight_map"]
    names = sorted(set(weight_map.values()))
    tensors = {}
    for name in names:
        loaded = load_file(os.path.join(directory, name))
        assert set(loaded) == {k for k, v in weight_map.items() if v == name}
        tensors.update(loaded)
    return tensors, names


# in the suite's shared 2-rank launch (tests/shared_launch.py), into a directory per backend
shared_launch.register(__name__, "export", 2, "tests.export_scenarios:export_run",
                       lambda backend: (shared_launch.directory(f"export-{backend}"),),
                       timeout_s=240)


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_export_matches_reference(backend):
    gathered = shared_launch.results("export", backend)[0]["gathered"]
    exported = shared_launch.directory(f"export-{backend}")
    for layout, several in (("single", False), ("sharded", True)):
        tensors, names = _read(os.path.join(exported, layout))
        assert (len(names) > 1) == several, names
        assert set(tensors) == set(gathered)
        for key, value in gathered.items():
            np.testing.assert_array_equal(tensors[key], value, err_msg=key)
        if several:
            assert all(os.path.getsize(os.path.join(exported, layout, n)) < SMALL_SHARD_BYTES + 4096
                       for n in names)


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_export_key_map_renames_and_leaves_out(backend):
    gathered = shared_launch.results("export", backend)[0]["gathered"]
    tensors, _ = _read(os.path.join(shared_launch.directory(f"export-{backend}"), "renamed"))
    assert set(tensors) == {renamed(k) for k in gathered if renamed(k) is not None}
    for key, value in gathered.items():
        if renamed(key) is not None:
            np.testing.assert_array_equal(tensors[renamed(key)], value, err_msg=key)


@pytest.mark.parametrize("what", ["weights", "config"])
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_export_never_replaces_the_users_files(backend, what):
    """Weights or a config the user put in the directory (not an earlier export): every
    rank raises before anything is removed or written; the directory is byte for byte as it
    was. Replacing an earlier export of its own is test_export_matches_reference's "single"."""
    for rank in shared_launch.results("export", backend):
        refused = rank["refused"][what]
        assert refused["error"] is not None, f"{what}: the export went ahead"
        assert refused["unchanged"], f"{what}: the user's files were changed"
    first = shared_launch.results("export", backend)[0]["refused"][what]["error"]
    assert first.startswith("CheckpointError"), first
    assert ("model.safetensors" if what == "weights" else "config.json") in first, first
    assert "another" in first, first


def test_transformers_loads_the_export(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the hf test extra is not installed")
    import torch

    directory = tmp_path / "hf"
    result = run_ranks("tests.export_scenarios:hf_run", 2, "torch", str(directory),
                       timeout_s=240)[0]
    # a tied model with a config that would not tie it back is refused before any write
    assert "tie_word_embeddings" in result["refused"] and result["wrote_nothing"]
    tensors, _ = _read(str(directory))
    assert "lm_head.weight" not in tensors  # tied: written once, as HF does
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(directory))
    with torch.no_grad():
        hf_logits = loaded(torch.from_numpy(hf_batch())).logits.numpy()
    assert_close(hf_logits, result["logits"], FP32_RTOL)


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_transformers_loads_the_example_model(backend, tmp_path):
    """The example's model (examples/lm/), exported from 2 ranks on either framework, loads
    as a ``LlamaForCausalLM`` whose logits match it: to FP32_RTOL on torch (the same math,
    same kernels), to EXAMPLE_CROSS_RTOL from MindSpore (fp32, other kernels)."""
    transformers = pytest.importorskip("transformers", reason="the hf test extra is not installed")
    import torch

    logits = run_ranks("tests.export_scenarios:example_run", 2, backend, str(tmp_path),
                       timeout_s=240)[0]
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path))
    with torch.no_grad():
        hf_logits = loaded(torch.from_numpy(example_batch())).logits.numpy()
    assert_close(hf_logits, logits, FP32_RTOL if backend == "torch" else EXAMPLE_CROSS_RTOL)
