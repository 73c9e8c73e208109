"""One ``hp.*`` surface for tensor parallelism: the same call behaves the same on both
frameworks, whatever was imported first.

In-process checks use a mesh without process groups (``hp.DeviceMesh(..., [None])``) and
stop before any collective; the import-order checks run a fresh interpreter each (the
framework is chosen once per process); torch's own styles through ``hp.parallelize_module``
run on 2 real ranks (tests/one_surface_scenarios.py).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hyper_parallel.launch import find_free_port
from tests.multirank import REPO_ROOT, run_ranks

BACKENDS = ["torch", "mindspore"]


def _framework(backend: str, monkeypatch):
    pytest.importorskip(backend)
    monkeypatch.setenv("HP_BACKEND", backend)
    import hyper_parallel as hp

    return hp, hp.get_platform()


def _split_logits(hp, platform):
    """(2, 4) logits as a column-wise head with use_local_output=False hands them on (a
    1-rank mesh without groups: nothing here reaches a collective)."""
    from hyper_parallel import tensor_parallel as tp

    mesh = hp.DeviceMesh("cpu", (1,), ("tp",), [None])
    return tp.LayoutTensor(platform.from_numpy(np.zeros((2, 4), np.float32)), hp.Shard(1), mesh)


def test_shard_takes_an_integer_dim_and_names_the_problem_otherwise():
    import hyper_parallel as hp

    for bad in ("1", 1.0, True, None):
        with pytest.raises(TypeError, match="Shard\\(dim\\): dim must be an int"):
            hp.Shard(bad)
    assert hp.Shard(np.int64(1)) == hp.Shard(1)
    assert type(hp.Shard(np.int64(1)).dim) is int


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_framework_op_given_a_layout_tensor_names_the_way_out(monkeypatch, backend):
    hp, platform = _framework(backend, monkeypatch)
    logits = _split_logits(hp, platform)
    target = platform.from_numpy(np.zeros(2, np.int64 if backend == "torch" else np.int32))
    if backend == "torch":
        import torch

        call = lambda: torch.nn.functional.cross_entropy(logits, target)  # noqa: E731
    else:
        from mindspore import ops

        call = lambda: ops.cross_entropy(logits, target)  # noqa: E731
    with pytest.raises(TypeError, match=r"call hp.cross_entropy\(logits, targets\) inside "
                                        r"hp.loss_parallel\(\)"):
        call()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_over_whole_logits_is_the_frameworks_own(monkeypatch, backend):
    """One loss line for a model with and without tensor parallelism: over a framework
    tensor, ``hp.cross_entropy`` is the framework's own, inside ``loss_parallel`` or not."""
    hp, platform = _framework(backend, monkeypatch)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 5)).astype(np.float32)
    target = np.array([0, 4, 2, -100, 1, 3])
    target = target if backend == "torch" else target.astype(np.int32)
    if backend == "torch":
        import torch

        def own(smoothing):
            return torch.nn.functional.cross_entropy(
                torch.from_numpy(logits), torch.from_numpy(target),
                label_smoothing=smoothing).numpy()
    else:
        import mindspore as ms
        from mindspore import ops

        def own(smoothing):
            return ops.cross_entropy(ms.Tensor(logits), ms.Tensor(target),
                                     label_smoothing=smoothing).asnumpy()
    for smoothing in (0.0, 0.1):
        expected = own(smoothing)
        for context in (hp.loss_parallel, None):
            args = (platform.from_numpy(logits), platform.from_numpy(target))
            if context is None:
                loss = hp.cross_entropy(*args, label_smoothing=smoothing)
            else:
                with context():
                    loss = hp.cross_entropy(*args, label_smoothing=smoothing)
            np.testing.assert_array_equal(platform.to_numpy(loss), expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_split_logits_outside_loss_parallel_name_the_context(monkeypatch, backend):
    hp, platform = _framework(backend, monkeypatch)
    logits = _split_logits(hp, platform)
    with pytest.raises(RuntimeError, match=r"only inside hp.loss_parallel\(\)"):
        hp.cross_entropy(logits, platform.from_numpy(np.zeros(2, np.int32)))


def _model_with_head(backend: str):
    """A norm then a head over ``(batch, seq, dim)`` activations."""
    if backend == "torch":
        from torch import nn

        model = nn.Module()
        model.norm, model.head = nn.LayerNorm(8), nn.Linear(8, 16, bias=False)
        model.forward = lambda x: model.head(model.norm(x))
        return model
    from mindspore import nn

    class Model(nn.Cell):
        def __init__(self):
            super().__init__()
            self.norm, self.head = nn.LayerNorm((8,)), nn.Dense(8, 16, has_bias=False)

        def construct(self, x):
            return self.head(self.norm(x))

    return Model()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_style_told_another_layout_than_its_input_is_in_raises(monkeypatch, backend):
    """The once-documented plan: the norm hands on its sequence shard as a plain tensor,
    the head is told it is split on dim 0; gathered so, its rows would come in another
    order than the targets. The head's style raises, naming both (the right plan trains
    as one process: tests/test_one_script.py)."""
    hp, platform = _framework(backend, monkeypatch)
    mesh = hp.DeviceMesh("cpu", (1,), ("tp",), [None])
    x = platform.from_numpy(np.ones((2, 4, 8), np.float32))
    wrong = _model_with_head(backend)
    hp.parallelize_module(wrong, mesh, {
        "norm": hp.SequenceParallel(use_local_output=True),
        "head": hp.ColwiseParallel(input_layouts=hp.Shard(0), use_local_output=False),
    }, src_data_rank=None)
    with pytest.raises(ValueError, match=r"ColwiseParallel on \w+ is told its input is in "
                                         r"Shard\(dim=0\), but the input is the output of "
                                         r"SequenceParallel on \w+, which is in Shard\(dim=1\)"):
        wrong(x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_gather_codec_applies_to_split_parameters_set_before_or_after(monkeypatch, backend):
    hp, platform = _framework(backend, monkeypatch)
    from hyper_parallel.fully_shard.gather_codec import GATHER_CODEC_ATTR

    mesh = hp.DeviceMesh("cpu", (1,), ("tp",), [None])
    for before in (True, False):
        model = _model_with_head(backend)
        codec = hp.CastGather("float16")
        if before:
            hp.set_gather_codec(model, codec)
        hp.parallelize_module(model, mesh, {"head": hp.ColwiseParallel()}, src_data_rank=None)
        if not before:
            hp.set_gather_codec(model, codec)
        weight = platform.registered_param(model.head, "weight")
        assert getattr(weight, GATHER_CODEC_ATTR, None) is codec, before


_IMPORT_ORDER = """
from hyper_parallel import ColwiseParallel, init_device_mesh, parallelize_module
import hyper_parallel as hp
{framework_import}
hp.init_distributed()
model = {model}
parallelize_module(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)),
                   {{"{child}": ColwiseParallel()}})
from hyper_parallel.tensor_parallel import tensor_parallel_layout
print("framework:", hp.get_platform().name)
print("split:", tensor_parallel_layout(hp.get_platform().registered_param(model{child_attr}, "weight")))
hp.destroy_distributed()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_model_picks_the_framework_not_the_import_order(backend):
    """hp's names imported before the framework, HP_BACKEND unset, both frameworks
    installed: the model decides."""
    for name in BACKENDS:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"needs both frameworks installed ({name} is not)")
    if backend == "torch":
        code = _IMPORT_ORDER.format(framework_import="import torch",
                                    model="torch.nn.Sequential(torch.nn.Linear(4, 4))",
                                    child="0", child_attr="[0]")
    else:
        code = _IMPORT_ORDER.format(framework_import="import mindspore",
                                    model="mindspore.nn.SequentialCell([mindspore.nn.Dense(4, 4)])",
                                    child="0", child_attr="[0]")
    env = {k: v for k, v in os.environ.items() if k != "HP_BACKEND"}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(find_free_port()), PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"framework: {backend}" in done.stdout
    assert "split: ParamLayout(" in done.stdout


@pytest.mark.timeout(300)
def test_torchs_own_styles_and_meshes_through_hp_parallelize_module():
    pytest.importorskip("torch")
    results = run_ranks("tests.one_surface_scenarios:torch_styles", 2, "torch", timeout_s=240)
    for rank, result in enumerate(results):
        assert result == {"dtensor_weight": "(Shard(dim=0),)", "unmatched_key": "KeyError",
                          "mixed_plan": "TypeError", "torch_mesh_hp_styles": "ParamLayout",
                          "slice_of_hp_mesh": "ParamLayout",
                          "torch_function_hp_mesh": "names mesh.native"}, rank
