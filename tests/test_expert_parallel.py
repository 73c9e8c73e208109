"""Expert parallelism (hyper_parallel.expert_parallel) on both frameworks.

One shared 2-rank launch per backend (tests/ep_scenarios.py) trains the MoE model of
tests/ep_models.py (top-2 routing with softmax and with sigmoid scores, a shared expert,
the auxiliary loss, bias-based balancing, an expert no token chooses) at ep2: the experts
split by ``hp.ExpertParallel`` and sharded by ``fully_shard`` inside the expert group, the
dense parts sharded over both ranks, each rank its own sequences; and the same model in
one process on the whole batch. Over 5 AdamW steps with ``hp.clip_grad_norm_``:

- the losses (the mean of the ranks' means) and the gradient norms (each expert counted
  once) equal the reference's within FP32_RTOL; the whole parameters after every step
  (``get_full_state_dict``: all experts) within ADAMW_RTOL; the expert bias moves as the
  reference's (the counts summed over the ranks);
- the routing leaves experts without rows on some rank (checked, so the case is covered);
- the checkpoint saved at ep2 loads into the plain model in one process: every value and
  the optimizer state equal.

Under ``-m slow`` a 4-rank launch runs the same at dp2 x ep2 (two expert groups, experts
sharded over 2 ranks inside each). Bad input fails before anything changes, in the test
process on a mesh without groups.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.ep_models import EMPTY
from tests.tolerance import FP32_RTOL, assert_close

SCORES = ("softmax", "sigmoid")
EP = 2

shared_launch.register(__name__, "expert_parallel_ep2", EP, "tests.ep_scenarios:run_all",
                       lambda backend: (backend, EP, shared_launch.directory("ep2")),
                       timeout_s=300)
shared_launch.register(__name__, "expert_parallel_dp2_ep2", 2 * EP, "tests.ep_scenarios:run_all",
                       lambda backend: (backend, EP, shared_launch.directory("dp2-ep2")),
                       timeout_s=600, slow=True)


def _check_parity(per_rank: list, score: str) -> None:
    runs = [result[score] for result in per_rank]
    reference = runs[0]["reference"]
    losses = np.mean([run["ep"]["losses"] for run in runs], axis=0)
    assert_close(losses, reference["losses"], FP32_RTOL, "losses")
    for rank, run in enumerate(runs):
        assert_close(run["ep"]["norms"], reference["norms"], FP32_RTOL,
                     f"rank {rank}: gradient norms")
        np.testing.assert_allclose(run["ep"]["bias"], reference["bias"], rtol=0, atol=1e-7,
                                   err_msg=f"rank {rank}: expert bias")
        for step, expected in enumerate(reference["params"]):
            got = run["ep"]["params"][step]
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                assert got[name].shape == value.shape, name  # every expert, whole
                assert_close(got[name], value, FP32_RTOL, f"rank {rank}, step {step}: {name}")
    counts = [run["counts"] for run in runs]
    assert all(c[EMPTY] == 0 for c in counts), counts


@pytest.mark.timeout(600)
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_ep2_matches_one_process(backend, score):
    _check_parity(shared_launch.results("expert_parallel_ep2", backend), score)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_ep2_checkpoint_loads_in_one_process(backend):
    for rank, result in enumerate(shared_launch.results("expert_parallel_ep2", backend)):
        saved, loaded = result["softmax"]["saved"], result["softmax"]["loaded"]
        assert saved.keys() == loaded.keys()
        for key, value in saved.items():
            np.testing.assert_array_equal(loaded[key], value, err_msg=f"rank {rank}: {key}")


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_dp2_ep2_matches_one_process(backend, score):
    _check_parity(shared_launch.results("expert_parallel_dp2_ep2", backend), score)
