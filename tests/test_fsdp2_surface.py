"""What training code written for torch FSDP2 relies on, on both frameworks: parameters no
backward reached get no gradient (torch), and the FSDPModule methods.

The suite's shared 2-rank launch (tests/shared_launch.py) runs the rank-side scenarios
(tests/fsdp2_surface_scenarios.py and the files it runs); each test reads its part. Parity: the mean of the
ranks' losses equals a single-process reference's loss on the global batch, and the
gathered parameters equal the reference's; on torch the losses also equal FSDP2's where
FSDP2 runs the same steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.tolerance import ADAMW_RTOL, FP32_RTOL, LOW_PRECISION_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
MODES = ["plain", "no_sync", "defer_all_reduce"]
# what FSDP2's error for a parameter shared across units says, which ours says too
# (checked on ranks by tests/test_bad_input.py)
FSDP2_SHARED_PARAMETER_WORDING = ("parameter already managed by another FSDP group",
                                  "fully_shard([module_a, module_b])")

shared_launch.register(__name__, "fsdp2_surface", 2, "tests.fsdp2_surface_scenarios:run_all",
                       timeout_s=300)


def _part(backend: str, name: str) -> list:
    return [r[name] for r in shared_launch.results("fsdp2_surface", backend)]


def _assert_parity(per_rank: list, param_atol: float = FP32_RTOL) -> None:
    mean_losses = np.mean([r["losses"] for r in per_rank], axis=0)
    assert_close(mean_losses, per_rank[0]["ref_losses"], FP32_RTOL)
    for r in per_rank:
        assert r["param_diff"] <= param_atol, f"gathered parameters differ by {r['param_diff']}"


# ---------------------------------------------------------------------------- unused parameters
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layer_no_rank_uses_trains_like_the_reference(backend, mode):
    """A layer the forward never calls, AdamW with weight decay, in each accumulation mode
    (one backward per step, gradient sync off for the first of two micro-batches, the
    replicate all-reduce deferred for the first of two): at parity with the reference. On
    torch it gets no gradient and AdamW leaves it unchanged, as in the reference and FSDP2;
    on MindSpore value_and_grad returns zeros for it, as for the reference, and weight
    decay moves it the same in both."""
    per_rank = _part(backend, f"spare_{mode}")
    _assert_parity(per_rank, ADAMW_RTOL)
    for r in per_rank:
        if backend == "torch":
            assert r["spare_moved"] == 0.0 == r["ref_spare_moved"]
            assert r["grads"]["ours"] == r["grads"]["ref"]
            assert r["grads"]["ours"]["blocks.1.spare.weight"] is True
        else:
            assert r["spare_moved"] == pytest.approx(r["ref_spare_moved"], abs=FP32_RTOL)
            assert r["spare_moved"] > 0.0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["plain", "no_sync"])
def test_a_layer_no_rank_uses_trains_like_fsdp2(mode):
    for r in _part("torch", f"spare_{mode}"):
        np.testing.assert_array_equal(r["losses"], r["their_losses"])  # the same math
        assert r["their_spare_moved"] == 0.0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODES)
def test_ranks_that_use_different_experts_stay_in_step(mode):
    """torch: an expert used on one rank only gets its gradient on every rank, an expert
    no rank used gets none, step by step exactly as in the reference (AdamW over five
    steps, in each accumulation mode); no collective is mismatched. (FSDP2 hangs or
    mismatches its reduce-scatter here unless told set_reduce_scatter_unused_params, which
    then gives zeros where the reference gives none.)"""
    per_rank = _part("torch", f"routed_{mode}")
    _assert_parity(per_rank, ADAMW_RTOL)
    for r in per_rank:
        assert r["grads"] == r["ref_grads"]
        assert ["moe.experts.2.weight", "moe.experts.2.bias"] in r["grads"]
        assert [] in r["grads"]  # the step where rank 0 used expert 2


@pytest.mark.timeout(600)
def test_ranks_that_use_different_experts_in_bfloat16():
    """The same in bfloat16 (parameters and reduction), against the float32 reference:
    the same parameters get no gradient, and the losses agree to bfloat16's precision."""
    per_rank = _part("torch", "routed_bf16")
    mean_losses = np.mean([r["losses"] for r in per_rank], axis=0)
    assert_close(mean_losses, per_rank[0]["ref_losses"], LOW_PRECISION_RTOL["bfloat16"])
    for r in per_rank:
        assert r["grads"] == r["ref_grads"]


# ---------------------------------------------------------------------------- explicit unshard
@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["async_wait", "async", "sync"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_unshard_before_the_first_forward_is_not_a_replacement(backend, how):
    """Blocks unsharded before the root's first forward (and between two later steps):
    async and waited, async and left to the forward, or blocking. The root's lazy init
    does not take the registered full parameters for replacements, and the gathered
    parameters are used by the forward's own node (on MindSpore one made inside
    value_and_grad): training at parity, on torch equal to FSDP2's."""
    per_rank = _part(backend, f"unshard_first_{how}")
    _assert_parity(per_rank)
    if backend == "torch":
        for r in per_rank:
            np.testing.assert_array_equal(r["losses"], r["their_losses"])  # the same math


# ---------------------------------------------------------------------------- error messages
def test_shared_parameter_error_carries_fsdp2s_wording():
    """Code that matches FSDP2's message for a parameter shared across two units finds it
    in ours (the rank-side check is tests/test_bad_input.py's "tied_across_units")."""
    import inspect

    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    theirs = inspect.getsource(FSDPState._validate_no_duplicate_params)
    for phrase in FSDP2_SHARED_PARAMETER_WORDING:
        assert phrase in theirs, f"FSDP2's message no longer says {phrase!r}"


# ---------------------------------------------------------------------------- FSDPModule methods
def _assert_same_as_fsdp2(per_rank: list) -> None:
    for r in per_rank:
        np.testing.assert_array_equal(r["losses"], r["their_losses"])  # the same math


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_scatter_divide_factor_is_the_deprecated_gradient_divide_factor(backend):
    """set_reduce_scatter_divide_factor(4) on 2 ranks warns (FutureWarning, naming
    set_gradient_divide_factor) and halves the gradients, like FSDP2."""
    per_rank = _part(backend, "divide_factor")
    _assert_parity(per_rank)
    for r in per_rank:
        assert r["factors"] == [4.0, 4.0, 4.0]
        assert [w[0] for w in r["warnings"]] == ["FutureWarning"]
        assert "set_gradient_divide_factor" in r["warnings"][0][1]
    if backend == "torch":
        _assert_same_as_fsdp2(per_rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_unshard_in_backward_false_skips_the_gather_before_backward(backend):
    """A unit whose backward reads none of its parameters (a first layer, whose input is
    the data): with set_unshard_in_backward(False) no all-gather before its backward (one
    per step), at parity and, on torch, as FSDP2."""
    per_rank = _part(backend, "unshard_in_backward")
    _assert_parity(per_rank)
    for r in per_rank:
        assert r["gathers"]["True"] - r["gathers"]["False"] == 5, r["gathers"]  # one per step
    if backend == "torch":
        _assert_same_as_fsdp2(per_rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_all_reduce_hook_sees_and_changes_the_reduced_gradients(backend):
    """A hook halving every unit's reduced gradients (in place on torch, returning a new
    tensor on MindSpore) trains like the reference with halved gradients, and on torch
    like FSDP2 with the same hook; bad hooks and a stream are refused by name."""
    per_rank = _part(backend, "all_reduce_hook")
    _assert_parity(per_rank)
    for r in per_rank:
        assert r["calls"] == 15  # 3 units x 5 steps, one leg each
        assert r["not_callable"][0] == "TypeError"
        assert r["stream"][0] == "NotImplementedError" and "leave stream out" in r["stream"][1]
        assert r["bad_shape"][0] == "ValueError" and "must return None or a tensor" in r["bad_shape"][1]
    if backend == "torch":
        _assert_same_as_fsdp2(per_rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_post_optim_event_is_waited_once_by_the_next_forward(backend):
    per_rank = _part(backend, "post_optim_event")
    _assert_parity(per_rank)
    for r in per_rank:
        assert r["waited"] == [1, 1, 1, 1]
        assert r["nested"][0] == "ValueError" and "call it on the root" in r["nested"][1]
        assert r["no_event"][0] == "TypeError"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_separate_reduce_scatter_group(backend):
    """Reduce-scatters over a communicator of their own (the shard ranks), at parity and,
    on torch, like FSDP2 with the same call; False puts them back on the shard group."""
    per_rank = _part(backend, "separate_reduce_scatter_group")
    _assert_parity(per_rank)
    for r in per_rank:
        assert r["separate"] and r["reset"]
        assert r["reduce_scatters"] == 15
    if backend == "torch":
        _assert_same_as_fsdp2(per_rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_scatter_unused_params_gives_zero_gradients(backend):
    """With it, the layer nobody calls gets zero gradients, so AdamW's weight decay moves
    it: on torch exactly as FSDP2 with the same setting; the single-process reference,
    whose layer gets no gradient on torch, differs there by that layer only."""
    per_rank = _part(backend, "reduce_scatter_unused_params")
    mean_losses = np.mean([r["losses"] for r in per_rank], axis=0)
    assert_close(mean_losses, per_rank[0]["ref_losses"], FP32_RTOL)
    for r in per_rank:
        assert r["spare_moved"] > 0.0
        if backend == "torch":
            assert r["spare_moved"] == r["their_spare_moved"]  # the same math
        else:  # the reference's zeros move it the same
            assert r["param_diff"] <= ADAMW_RTOL
    if backend == "torch":
        _assert_same_as_fsdp2(per_rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_scatter_max_input_buffers_is_validated_like_fsdp2(backend):
    r = _part(backend, "method_checks")[0]
    expected = {2: None, 0: "ValueError", -1: "ValueError", True: "TypeError",
                1.5: "TypeError", "2": "TypeError"}
    for value, error in expected.items():
        assert r[f"max_input_buffers {value!r}"][0] == error, value
        if backend == "torch":
            assert r[f"fsdp2 max_input_buffers {value!r}"] == error, value
    assert r["max_input_buffers stored"] == [2, 2, 2]
    assert r["max_input_buffers not recursed"] == [3, 2, 2]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("check, reason", [
    ("allocate True", "never from a process group's own allocator"),
    ("symm_mem", "not into symmetric memory"),
    ("custom_all_gather", "FSDP2's AllGather protocol"),
    ("custom_reduce_scatter", "FSDP2's ReduceScatter protocol"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_methods_without_meaning_here_say_why(backend, check, reason):
    r = _part(backend, "method_checks")[0]
    assert r[check][0] == "NotImplementedError"
    assert reason in r[check][1]
    assert r["allocate False"] == (None, "")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_share_comm_ctx_takes_units_only(backend):
    r = _part(backend, "method_checks")[0]
    assert r["share_comm_ctx"] == (None, "") and r["share_comm_ctx empty"] == (None, "")
    assert r["share_comm_ctx plain"][0] == "ValueError"
    assert "call fully_shard on it first" in r["share_comm_ctx plain"][1]


# ---------------------------------------------------------------------------- the whole surface
# Public names of torch.distributed.fsdp (and methods of its FSDPModule) that hyper_parallel
# does not have, each with the reason; docs/api.md repeats them.
FSDP1 = ("FSDP1's API (FullyShardedDataParallel and its configuration); hyper_parallel "
         "implements FSDP2's fully_shard, which torch recommends instead")
LEFT_OUT = {name: FSDP1 for name in (
    "BackwardPrefetch", "CPUOffload", "FlatParameter", "FullOptimStateDictConfig",
    "FullStateDictConfig", "FullyShardedDataParallel", "LocalOptimStateDictConfig",
    "LocalStateDictConfig", "MixedPrecision", "OptimStateDictConfig", "OptimStateKeyType",
    "ShardedOptimStateDictConfig", "ShardedStateDictConfig", "ShardingStrategy",
    "StateDictConfig", "StateDictSettings", "StateDictType")}
MESH_INFO = ("FSDP2's description of a parameter group's mesh, which its ShardPlacementResult "
             "carries; hp.ShardPlacementResult takes the mesh and its dp_mesh_dims instead, "
             "and on torch accepts FSDP2's own ShardPlacementResult as it is")
LEFT_OUT.update({name: MESH_INFO for name in ("FSDPMeshInfo", "HSDPMeshInfo")})
METHODS_LEFT_OUT: dict = {}
# what FSDP2's shard_placement_fn may return: not exported by torch.distributed.fsdp, but
# written by code that places parameters on meshes of their own
PLACEMENT_NAMES = ("ShardPlacementResult", "FSDPMeshInfo", "HSDPMeshInfo")


def _fsdp2_public_names() -> tuple:
    import inspect

    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    names = {n for n in getattr(fsdp, "__all__", [])}
    names |= {n for n in dir(fsdp) if not n.startswith("_")
              and not inspect.ismodule(getattr(fsdp, n))}
    names |= {n for n in PLACEMENT_NAMES if hasattr(_fsdp_common, n)}
    methods = {n for n in dir(fsdp.FSDPModule) if not n.startswith("_")
               and callable(getattr(fsdp.FSDPModule, n))}
    return sorted(names), sorted(methods)


def test_every_public_fsdp2_name_exists_or_has_a_documented_reason():
    """Against the installed torch: every public name of torch.distributed.fsdp (and the
    names of what its shard_placement_fn may return) is in hyper_parallel or in LEFT_OUT, and every public method of its FSDPModule is on
    hp.FSDPModule or in METHODS_LEFT_OUT; a reason for something that exists is stale."""
    import hyper_parallel as hp

    names, methods = _fsdp2_public_names()
    missing = [n for n in names if not hasattr(hp, n) and n not in LEFT_OUT]
    assert not missing, f"FSDP2 names hyper_parallel lacks without a documented reason: {missing}"
    missing = [m for m in methods if not callable(getattr(hp.FSDPModule, m, None))
               and m not in METHODS_LEFT_OUT]
    assert not missing, f"FSDPModule methods hyper_parallel lacks without a reason: {missing}"
    stale = [n for n in LEFT_OUT if hasattr(hp, n)] + \
        [m for m in METHODS_LEFT_OUT if hasattr(hp.FSDPModule, m)]
    assert not stale, f"documented as left out, but present: {stale}"
    assert len(methods) >= 23  # torch 2.13's FSDPModule
    assert set(PLACEMENT_NAMES) <= set(names)  # torch 2.13 has per-parameter meshes


def test_the_left_out_names_are_documented():
    from pathlib import Path

    api = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    for name in [*LEFT_OUT, *METHODS_LEFT_OUT]:
        assert f"`{name}`" in api, f"docs/api.md does not name {name} among the left-out names"


# ---------------------------------------------------------------------------- torchtitan's pattern
@pytest.mark.timeout(600)
def test_checkpoint_wrapper_with_a_chunked_loss_trains_like_fsdp2():
    """torch: torchtitan's default wrapping (checkpoint_wrapper on each block, fully_shard
    on the wrapper) with its chunked loss (a head-only backward, whose end reshards every
    unit, then the trunk's backward, whose recomputations read the blocks' parameters):
    at parity with the reference and equal to FSDP2."""
    per_rank = _part("torch", "checkpointed_chunked_loss")
    _assert_parity(per_rank)
    _assert_same_as_fsdp2(per_rank)


# ---------------------------------------------------------------------------- FSDP2's policies
@pytest.mark.timeout(600)
def test_fsdp2s_own_policy_objects_train_as_ours_and_as_fsdp2():
    """torch: torch.distributed.fsdp's MixedPrecisionPolicy (every field set somewhere),
    OffloadPolicy and CPUOffloadPolicy given to hp.fully_shard become hyper_parallel's
    equivalents, field by field, and train bit for bit as hyper_parallel's own policies
    and as FSDP2 with the same objects; a policy of the wrong kind stays a TypeError."""
    for r in _part("torch", "torch_policies"):
        assert r["converted"] == [True] * 6
        ours = r["ours"]
        assert ours["out_dtypes"] == ["torch.float32"]  # the root's output_dtype
        for run in (r["torch_policies"], r["fsdp2"]):
            assert run["losses"] == ours["losses"]
            assert run["out_dtypes"] == ours["out_dtypes"]
            for key, value in ours["params"].items():
                np.testing.assert_array_equal(run["params"][key], value, err_msg=key)
        assert r["wrong_kind"][0] == "TypeError"
        assert "offload_policy must be a hp.OffloadPolicy, got MixedPrecisionPolicy(" \
            in r["wrong_kind"][1]


def test_a_framework_policy_field_we_lack_is_an_error_not_dropped():
    """A framework policy the platform recognises is rebuilt field by field; a field
    hyper_parallel's class lacks (a newer torch's, say) is a TypeError naming it."""
    from hyper_parallel.fully_shard.policy import MixedPrecisionPolicy, as_policy

    native = object()
    fields = {"param_dtype": "bfloat16", "reduce_dtype": None, "output_dtype": None,
              "cast_forward_inputs": False}
    describe = lambda value: ("MixedPrecisionPolicy", dict(fields)) if value is native else None  # noqa: E731
    assert as_policy(native, MixedPrecisionPolicy, "mp_policy", describe) == \
        MixedPrecisionPolicy(**fields)
    fields["prefetch_dtype"] = "float16"
    with pytest.raises(TypeError, match=r"has fields \['prefetch_dtype'\] that "
                                        r"hp.MixedPrecisionPolicy does not have"):
        as_policy(native, MixedPrecisionPolicy, "mp_policy", describe)
