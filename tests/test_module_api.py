"""fully_shard / FSDPModule API semantics on both frameworks: ignored_params outside the
module, reset_iter_state, register_fsdp_forward_method and reshard_after_forward as an int
or None.

The suite's shared 2-rank launch (tests/shared_launch.py) runs every scenario (tests/module_api_scenarios.py);
each test reads its part. Parity as in test_parity.py: the mean of the ranks' losses equals
a single-process reference's loss on the global batch, gathered parameters equal the
reference's (to rounding, tests/tolerance.py). On torch the same calls are also made on
torch's FSDP2, whose losses are the same bit for bit.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from hyper_parallel.fully_shard.fsdp_module import _resolve_reshard_after_forward
from tests import shared_launch
from tests.tolerance import FP32_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]


shared_launch.register(__name__, "module_api", 2, "tests.module_api_scenarios:run_all",
                       timeout_s=400)


def _results(backend: str) -> list:
    return shared_launch.results("module_api", backend)


def _part(backend: str, name: str) -> list:
    return [r[name] for r in _results(backend)]


def _assert_parity(per_rank: list) -> None:
    mean_losses = np.mean([r["losses"] for r in per_rank], axis=0)
    assert_close(mean_losses, per_rank[0]["ref_losses"], FP32_RTOL)
    assert len(mean_losses) >= 5
    for r in per_rank:
        assert r["param_diff"] <= FP32_RTOL, f"gathered parameters differ by {r['param_diff']}"


def _assert_same_as_fsdp2(per_rank: list) -> None:
    for r in per_rank:
        assert not isinstance(r["their_losses"], str), f"FSDP2 failed: {r['their_losses']}"
        np.testing.assert_array_equal(r["losses"], r["their_losses"])  # the same math


# ---------------------------------------------------------------------------- ignored_params
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_params_outside_the_module_are_left_alone(backend):
    per_rank = _part(backend, "ignored_outside")
    _assert_parity(per_rank)
    for r in per_rank:
        assert r["outsider_untouched"], "fully_shard changed a parameter it was told to ignore"
        assert r["outsider_unchanged_by_training"]
    if backend == "torch":
        _assert_same_as_fsdp2(per_rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("check, message", [
    ("name_not_param", "ignored_params holds a str ('head.bias'), which is not a parameter"),
    ("bare_param", "ignored_params must be a collection"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_params_that_are_not_parameters_are_rejected(backend, check, message):
    error_type, error_message, untouched = _part(backend, "ignored_outside")[0][check]
    assert error_type == "TypeError", error_message
    assert message in error_message
    assert untouched, "the module was changed by a call that failed"


# ---------------------------------------------------------------------------- reset_iter_state
# MindSpore 2.10 ends the process (segmentation fault) when a backward hook raises, so an
# exception inside backward is only recoverable, and tested, on torch.
RESET_CASES = [("torch", "forward"), ("torch", "between"), ("torch", "backward"),
               ("mindspore", "forward"), ("mindspore", "between")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend, mode", RESET_CASES)
def test_reset_iter_state_recovers_from_an_aborted_step(backend, mode):
    """An exception inside block 0's forward (an all-gather prefetched for block 1 in
    flight), in the loss after a complete forward, or inside backward (block 1's and the
    root's reductions issued): after reset_iter_state every module sees its sharded
    parameters and training goes on exactly like a reference that skipped the step."""
    per_rank = _part(backend, f"reset_{mode}")
    for r in per_rank:
        assert r["raised"] != "no exception"
        assert r["sharded_after_reset"], "a unit kept its full parameters after reset_iter_state"
    _assert_parity(per_rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["forward", "between"])
def test_reset_iter_state_matches_fsdp2(mode):
    """torch's FSDP2 recovers the same way. (After an exception inside backward, FSDP2
    2.13 on CPU keeps the aborted step's gradient of the root's parameters and adds it to
    the next step's, so that case is compared with the reference only.)"""
    _assert_same_as_fsdp2(_part("torch", f"reset_{mode}"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reset_iter_state_on_a_nested_unit_raises(backend):
    for r in _part(backend, "reset_forward"):
        error_type, message = r["nested_unit"]
        assert error_type == "RuntimeError" and "must be called on the root" in message
    before = _part(backend, "reset_before_first_forward")[0]
    assert before == {"root": (None, ""), "nested": (None, "")}  # nothing to reset yet


# ---------------------------------------------------------------------------- forward methods
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_registered_method_computes_with_full_parameters(backend):
    """generate() (three rounds of block 0, block 1 and the root's head) called before any
    forward, and again after training, returns the reference model's outputs; after it,
    every module sees its sharded parameters again."""
    for r in _part(backend, "forward_method"):
        assert r["wrapped"] and r["registered_once"]
        assert r["generate_first"] <= FP32_RTOL
        assert r["generate_last"] <= FP32_RTOL
        assert r["sharded_after_generate"]
        if backend == "torch":
            assert r["fsdp2_generate"] <= FP32_RTOL


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_registered_method_trains_at_parity(backend):
    """A step whose loss comes from generate(), then forward steps: all at parity."""
    _assert_parity(_part(backend, "forward_method"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_register_forward_method_on_a_plain_module_or_missing_method(backend):
    r = _part(backend, "forward_method")[0]
    assert r["plain_untouched"], "registering on a module that is not a unit changed it"
    assert r["missing"] == ("ValueError",
                            "FSDPGenStack has no method 'sample' to register as a forward method")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_deepcopy_of_a_unit_is_refused_and_the_unit_still_computes(backend):
    """As FSDP2 refuses it; before, torch failed inside the module's constructor and
    MindSpore made a copy that failed at its first forward."""
    for r in _part(backend, "forward_method"):
        error_type, message = r["deepcopy"]
        assert error_type == "TypeError", message
        assert message.startswith("FSDPGenStack is a fully_shard unit and cannot be deep-copied; "
                                  "copy the model before fully_shard"), message
        assert r["generate_after_deepcopy"] == 0.0


# ---------------------------------------------------------------------------- reshard_after_forward
@pytest.mark.timeout(600)
@pytest.mark.parametrize("value, error_type, message", [
    ("0", "ValueError", "must be a factor of the shard group size 2, got 0"),
    ("-1", "ValueError", "must be a factor of the shard group size 2, got -1"),
    ("3", "ValueError", "must be a factor of the shard group size 2, got 3"),
    ("1.5", "ValueError", "must be a bool, None or an int"),
    ("'2'", "ValueError", "must be a bool, None or an int"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_reshard_after_forward_int_is_validated(backend, value, error_type, message):
    r = _part(backend, "reshard_after_forward")[0]
    found_type, found_message, untouched = r[f"bad {value}"]
    assert (found_type, untouched) == (error_type, True), found_message
    assert message in found_message
    if backend == "torch":  # FSDP2 rejects the same values with the same type
        assert r["fsdp2"][value] == error_type


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reshard_after_forward_sub_group_needs_a_mesh_over_all_ranks(backend):
    """A non-trivial factor of the shard size (2 of 4) makes new groups: on a mesh that does
    not cover the job that is refused naming the fix, at fully_shard and at
    set_reshard_after_forward, changing nothing."""
    r = _part(backend, "reshard_after_forward")[0]
    found_type, message, untouched = r["sub_group"]
    found_setter_type, setter_message, values = r["setter"]["sub_group"]
    assert found_type == "ValueError" and untouched, message
    assert "needs a mesh over all 2 ranks" in message and "pass the whole mesh" in message
    assert found_setter_type == "ValueError", setter_message
    assert values == [False, False]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reshard_after_forward_int_maps_to_bool(backend):
    """1 is False (a UserWarning at each such call; Python's default filter shows it once
    per calling line), the shard size is True, None is kept for the
    state machine (True except on the root); the setter takes the same values."""
    r = _part(backend, "reshard_after_forward")[0]
    assert r["stored"] == [False, True, None]
    assert len(r["warnings"]) == 2 and all("reshard_after_forward=False" in w for w in r["warnings"])
    setter = r["setter"]
    assert setter["1"] == [False, False] and setter["2"] == [True, True]
    assert setter["None"] == [None, None]
    assert setter["True"] == [True, True] and setter["False"] == [False, False]
    for bad in ("bad 0", "bad 3", "bad 'yes'"):
        assert setter[bad][0] == "ValueError" and setter[bad][2] == [False, False], setter[bad]
    if backend == "torch":
        assert (r["fsdp2"]["1"], r["fsdp2"]["2"]) == (False, True)
    # blocks with 1 keep their full parameters: no re-gather before their backward
    assert r["gathers"] == {1: 3, 2: 3 + 2}


def test_reshard_after_forward_resolution_over_a_larger_shard_group():
    """The rule itself, for a shard group of 4 (in-process, no ranks)."""
    assert [_resolve_reshard_after_forward(v, [4]) for v in (None, True, False, 4)] == \
        [None, True, False, True]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _resolve_reshard_after_forward(1, [4]) is False
    assert _resolve_reshard_after_forward(2, [4]) == 2  # a post-forward group of 2 ranks
    for bad in (0, 3, 8, -4):
        with pytest.raises(ValueError, match="factor of the shard group size 4"):
            _resolve_reshard_after_forward(bad, [4])


def test_reshard_after_forward_resolution_over_several_meshes():
    """A unit of parameter groups on meshes of 4 and 2 shard ranks (shard_placement_fn):
    the int must divide both; equal to both it is True; a unit without parameters takes
    any int."""
    assert _resolve_reshard_after_forward(2, [4, 2]) == 2  # pairs; the 2-rank group: True
    assert _resolve_reshard_after_forward(2, [2, 2]) is True
    assert _resolve_reshard_after_forward(3, []) is True
    with pytest.raises(ValueError, match=r"each of the unit's meshes \(2 and 4\), got 4"):
        _resolve_reshard_after_forward(4, [4, 2])
