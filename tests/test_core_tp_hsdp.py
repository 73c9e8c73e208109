"""HSDP over the core's tensor parallelism on a 3-D ``(replicate, shard, tp)`` mesh, with
gradient accumulation (``set_requires_gradient_sync(False)`` microbatches) and recompute
(torch: ``torch.utils.checkpoint``; MindSpore: ``ms.recompute``) in the same run
(tests/core_tp_hsdp_scenarios.py):

- torch: the core's styles under ``hp.fully_shard`` against torch's DTensor tensor
  parallelism under FSDP2's HSDP, same model, data and recompute: losses and every rank's
  local shard after every step bitwise equal;
- MindSpore: against the model trained whole in one process on every sequence of each
  step: losses within 1e-6 relative, parameters assembled from every rank's shard within
  2e-6 (tests/test_core_tp_fully_shard.py's tolerances).

The (2, 1, 2) mesh (replicate over 2, shard over 1, tp 2) runs in the shared 4-rank
launch of the default run; the (2, 2, 2) mesh on 8 ranks, which also shards, runs under
``-m slow`` (tests/test_core_tp_fully_shard.py shards over 2 with tensor parallelism in
the default run).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.test_core_tp_fully_shard import LOSS_RTOL, PARAM_ATOL, _whole

SHAPES = {4: (2, 1, 2), 8: (2, 2, 2)}

for world, mesh_shape in SHAPES.items():
    shared_launch.register(__name__, f"core_tp_hsdp_{world}", world,
                           "tests.core_tp_hsdp_scenarios:run",
                           lambda backend, shape=mesh_shape: (backend, shape),
                           timeout_s=300 if world == 4 else 900, slow=world == 8)

WORLDS = [4, pytest.param(8, marks=pytest.mark.slow)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLDS)
def test_torch_equals_dtensor_tp_under_fsdp2_hsdp_bitwise(world):
    for rank, result in enumerate(shared_launch.results(f"core_tp_hsdp_{world}", "torch")):
        ours, theirs = result["core"], result["fsdp2"]
        assert ours["losses"] == theirs["losses"], f"rank {rank}: losses"
        assert len(theirs["shards"]) == len(ours["shards"]) > 0
        for step, shards in enumerate(theirs["shards"]):
            assert ours["shards"][step].keys() == shards.keys()
            for name, value in shards.items():
                np.testing.assert_array_equal(ours["shards"][step][name], value,
                                              err_msg=f"rank {rank}, step {step}: {name}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLDS)
def test_mindspore_matches_one_process(world):
    per_rank = shared_launch.results(f"core_tp_hsdp_{world}", "mindspore")
    reference = per_rank[0]["reference"]
    dp_losses = {}
    for result in per_rank:  # the ranks of one data-parallel rank's tp group agree
        dp_losses.setdefault(result["dp_rank"], result["parallel"]["losses"])
        assert result["parallel"]["losses"] == dp_losses[result["dp_rank"]]
    assert sorted(dp_losses) == list(range(world // 2))
    np.testing.assert_allclose(np.mean(list(dp_losses.values()), axis=0), reference["losses"],
                               rtol=LOSS_RTOL, atol=0)
    for step, expected in enumerate(reference["params"]):
        shapes = {name: value.shape for name, value in expected.items()}
        whole = _whole([result["parallel"]["params"][step] for result in per_rank], shapes)
        for name, value in expected.items():
            np.testing.assert_allclose(whole[name], value, rtol=0, atol=PARAM_ATOL,
                                       err_msg=f"step {step}: {name}")
