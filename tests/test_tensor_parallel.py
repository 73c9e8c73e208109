"""fully_shard over tensor parallelism (torch): parameters that ``parallelize_module`` made
DTensors over the "tp" dim of a (dp, tp) mesh are sharded further over "dp".

The suite's shared 4-rank torch launch (tests/shared_launch.py) runs every scenario
(tests/tp_scenarios.py); each test reads its part.
Parity is against a single-process reference on the global batch and against torch FSDP2
+ TP on the same model and data: losses, full parameters, and the sharded parameters'
layout (placements, mesh ranks, local values). DCP: a checkpoint saved from hyper_parallel
loads into fresh hyper_parallel and FSDP2 models. MindSpore has no DTensor: its tensor
parallelism is the core's (tests/test_core_tp_fully_shard.py composes it with fully_shard).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests import shared_launch
from tests.tolerance import FP32_RTOL, assert_close

WORLD = 4
# what FSDP2 makes of the model's parameters (tensor parallel on the right mesh dim)
PLACEMENTS = {
    **{f"attn.{n}.{kind}": "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
       for n in "qkv" for kind in ("weight", "bias")},
    "attn.o.weight": "(Shard(dim=0), Shard(dim=1))", "attn.o.bias": "(Shard(dim=0), Replicate())",
    "mlp.up.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
    "mlp.up.bias": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
    "mlp.down.weight": "(Shard(dim=0), Shard(dim=1))",
    "mlp.down.bias": "(Shard(dim=0), Replicate())",
    "head.weight": "(Shard(dim=0),)", "head.bias": "(Shard(dim=0),)",
}


shared_launch.register(__name__, "tensor_parallel", WORLD, "tests.tp_scenarios:run_all",
                       lambda backend: (shared_launch.directory("tp-dcp"),), backends=("torch",),
                       timeout_s=120)


def _launch() -> list:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    return shared_launch.results("tensor_parallel", "torch")


@pytest.mark.timeout(180)
def test_matches_single_process_reference():
    per_rank = _launch()
    for rank, result in enumerate(per_rank):
        assert result["initial_diff"] == 0.0, f"rank {rank}: sharding changed the values"
        assert result["moved"] > 1e-3, f"rank {rank}: training did not change the parameters"
        assert result["ref_diff"] <= FP32_RTOL, f"rank {rank}: parameters differ by {result['ref_diff']}"
        assert result["dp_mesh_diff"] <= FP32_RTOL, f"rank {rank}: mesh['dp']: {result['dp_mesh_diff']}"
        for key in ("gathered_full_diff", "dp_mesh_gathered_full_diff"):
            assert result[key] <= FP32_RTOL, f"rank {rank}: hp.gather_full_state_dict: {key} {result[key]}"
    # ranks 2k, 2k+1 form a tp group (same data); the dp groups' mean is the global loss
    for rank in (1, 3):
        np.testing.assert_array_equal(per_rank[rank]["losses"], per_rank[rank - 1]["losses"])
    mean_losses = np.mean([per_rank[0]["losses"], per_rank[2]["losses"]], axis=0)
    assert_close(mean_losses, per_rank[0]["ref_losses"], FP32_RTOL)


@pytest.mark.timeout(180)
def test_matches_fsdp2_with_tensor_parallel():
    for rank, result in enumerate(_launch()):
        np.testing.assert_array_equal(result["losses"], result["fsdp2_losses"])  # same math
        assert result["fsdp2_diff"] == 0.0, f"rank {rank}: {result['fsdp2_diff']}"
        assert result["layout_mismatch"] == [], f"rank {rank}: {result['layout_mismatch']}"
        assert result["placements"] == PLACEMENTS, f"rank {rank}"
        # both ways of making the shard's mesh ran
        assert result["mesh_from_slices"] == [False, True], f"rank {rank}"


@pytest.mark.timeout(180)
def test_meta_device_build_with_activation_checkpointing_trains_the_same():
    """Built on the meta device and materialised with ``to_empty`` after fully_shard, its
    blocks under activation checkpointing (as torchtitan builds a model): the layers still
    compute with tensor-parallel DTensors, in the forward and in the recomputation, and
    training is the eagerly built model's, bit for bit (the same math)."""
    for rank, result in enumerate(_launch()):
        np.testing.assert_array_equal(result["meta_checkpointed_losses"], result["losses"])
        assert result["meta_checkpointed_diff"] == 0.0, f"rank {rank}"


@pytest.mark.timeout(180)
def test_dcp_checkpoint_loads_into_hyper_parallel_and_fsdp2():
    for rank, result in enumerate(_launch()):
        assert result["fresh_differs"] > 1e-2, f"rank {rank}: the fresh model is not fresh"
        assert result["dcp_hp_diff"] == 0.0, f"rank {rank}: {result['dcp_hp_diff']}"
        assert result["dcp_fsdp2_diff"] == 0.0, f"rank {rank}: {result['dcp_fsdp2_diff']}"
        saved, *loaded = result["after_load"]
        np.testing.assert_array_equal(loaded, [saved, saved])  # the saved values, loaded


@pytest.mark.timeout(180)
def test_partial_dtensor_is_refused_before_anything_changes():
    for rank, result in enumerate(_launch()):
        assert result["partial_error"] is not None and \
            "placements (Partial(sum),)" in result["partial_error"], f"rank {rank}"
        assert result["partial_untouched"], f"rank {rank}: the module was changed"


@pytest.mark.timeout(120)
def test_mindspore_has_no_tensor_parallel_parameters():
    """MindSpore has no DTensor: its platform shards every parameter as it is (the default
    ``param_local_values``); the core's tensor parallelism keeps each rank's block as a
    plain parameter (tests/test_core_tp_fully_shard.py)."""
    if importlib.util.find_spec("mindspore") is None:
        pytest.skip("mindspore is not installed")
    import mindspore

    from hyper_parallel.platform.base import Platform
    from hyper_parallel.platform.mindspore.platform import MindSporePlatform

    assert not hasattr(mindspore, "DTensor") and not hasattr(mindspore.parallel, "DTensor")
    assert MindSporePlatform.param_local_values is Platform.param_local_values
