"""State dicts on both frameworks (tests/state_dict_scenarios.py): checkpoints saved at 4
ranks and loaded at 2 and 1 (and the 2-rank one at 1), full state dicts gathered to rank 0 and loaded into sharded models, torch DCP resharding, the
framework's own same-world-size round trip, and bad input.

Three launches per backend form one chain over a shared directory (4, then 2, then 1
ranks). Parity: after each load the full state (model and AdamW state) equals the saving
run's, and the resumed run's losses and parameters equal the uninterrupted run's and the
single-process reference's.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest

from tests import shared_launch
from tests.multirank import FAST_MINDSPORE, run_ranks
from tests.tolerance import FP32_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
# losses and parameters: the same sums in another order at another world size
PARAM_ATOL = 1e-4


@shared_launch.once
def _chain(backend: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="hp-state-dict-") as directory:
        return {world: run_ranks("tests.state_dict_scenarios:run_phase", world, backend,
                                 "save" if world == 4 else "load", directory, timeout_s=400,
                                 env=FAST_MINDSPORE)
                for world in (4, 2, 1)}


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), f"keys differ: {sorted(set(a) ^ set(b))}"
    return max(float(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)).max())
               for k in a)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_full_state_on_rank0_only(backend):
    saved = _chain(backend)[4]
    full = saved[0]["full_state"]
    assert full and all(r["full_state"] == {} for r in saved[1:])
    assert any(k.startswith("optim.") for k in full), sorted(full)
    both = _chain(backend)[2]
    for r in both:  # rank0_only=False: every rank
        assert _max_diff(r["all_ranks_full"], full) == 0.0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_framework_round_trip_at_same_world_size(backend):
    for r in _chain(backend)[4]:
        assert r["native_round_trip_diff"] == 0.0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_load_reshards_and_resumes(backend, world):
    """Every checkpoint loads into a model with other values at another world size with
    exactly the saved state, and training resumes (from the sharded checkpoint of 4 ranks
    at 2, of 2 ranks at 1) as if never interrupted."""
    chain = _chain(backend)
    saved = chain[4][0]
    reference = chain[1][0]["reference"]
    sources = [s for s in chain[world][0]
               if s not in ("all_ranks_full", "reference", "bad_input", "nn_adam")]
    assert "sharded_from_4" in sources and "full" in sources
    for source in sources:
        assert _max_diff(chain[world][0][source]["loaded"], saved["full_state"]) == 0.0, source
    resumed = [s for s in sources if "after" in chain[world][0][s]]
    assert len(resumed) == 1, resumed
    for r in chain[world]:
        after = r[resumed[0]]["after"]
        assert_close(after, saved["after"], FP32_RTOL)
        assert_close(after, reference["losses"][-len(after):], FP32_RTOL)
    final = chain[world][0][resumed[0]]["final"]
    assert _max_diff(final, saved["final"]) <= PARAM_ATOL
    assert _max_diff(final, reference["final"]) <= PARAM_ATOL
    assert_close(saved["before"], reference["losses"][:len(saved["before"])], FP32_RTOL)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_names_the_key_and_changes_nothing(backend):
    bad = _chain(backend)[1][0]["bad_input"]
    expect = {"other_model": ["head.weight", "(40, 16)", "(37, 16)"],
              "wrong_shape": ["head.weight", "(38, 16)", "(37, 16)"],
              "missing_key": [bad["missing_key"]["key"], "missing"],
              "unexpected_key": ["extra.weight", "unexpected"],
              "missing_rank_file": ["rank-00003.safetensors", "missing"]}
    for case, words in expect.items():
        message = bad[case]["error"]
        assert message is not None, f"{case}: no error"
        for word in words:
            assert word in message, f"{case}: {word!r} not in {message!r}"
        assert bad[case]["unchanged"], f"{case}: the model changed"


@pytest.mark.timeout(900)
def test_mindspore_nn_adam_state_round_trips():
    """``nn.Adam`` keeps its moments in Parameters named ``moment1.<name>`` and its step and
    beta powers in its own: all of them go through a checkpoint."""
    rank0 = _chain("mindspore")[2][0]["nn_adam"]
    saved = rank0["saved"]
    assert {"optim.global_step", "optim.beta1_power"} <= set(saved), sorted(saved)
    assert any(k.startswith("optim.moment1.") for k in saved), sorted(saved)
    assert _max_diff(rank0["loaded"], saved) == 0.0
