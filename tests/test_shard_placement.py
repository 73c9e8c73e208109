"""``shard_placement_fn`` returning a ``ShardPlacementResult``: a unit whose parameters are
sharded over different meshes, on both frameworks (tests/placement_scenarios.py, a
mixture-of-experts model whose experts are sharded over pairs of ranks and replicated
across the pairs, the rest over all 4 ranks).

The rank side runs in the suite's shared 4-rank launch (tests/shared_launch.py). Parity:
the mean of the ranks' losses equals a single-process reference's loss on the global
batch, and the gathered parameters equal the reference's; with clipping, the norms equal
the reference's whole-model norms; on torch the losses and parameters equal FSDP2's with
the same (torch) ``ShardPlacementResult``. Collective counts follow from the parameter
groups the run reports. The clipped run reduces synchronously and the accumulated one
through the overlapped pipeline (``HP_SYNC_COLLECTIVES``), so both paths run on both
frameworks.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.tolerance import ADAMW_RTOL, FP32_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
WORLD = 4

shared_launch.register(__name__, "shard_placement", WORLD, "tests.placement_scenarios:run_all",
                       lambda backend: (shared_launch.directory("shard-placement"),),
                       timeout_s=300)


def _part(backend: str, name: str) -> list:
    return [r[name] for r in shared_launch.results("shard_placement", backend)]


def _assert_parity(per_rank: list, param_atol: float) -> None:
    mean_losses = np.mean([r["losses"] for r in per_rank], axis=0)
    assert_close(mean_losses, per_rank[0]["ref_losses"], FP32_RTOL)
    for rank, r in enumerate(per_rank):
        assert r["param_diff"] <= param_atol, f"rank {rank}: parameters differ by {r['param_diff']}"


def _pair(rank):  # the experts' shard group: ranks 2k, 2k+1
    return [rank - rank % 2, rank - rank % 2 + 1]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_mesh_is_a_parameter_group_of_its_own(backend):
    """The root holds one group over all ranks; each block two: its experts, sharded over
    a pair of ranks and replicated across the pairs, and its dense layers over all ranks."""
    for rank, r in enumerate(_part(backend, "clipped")):
        root, *blocks = r["groups"]
        assert root == [{"params": ["proj.weight", "proj.bias", "head.weight", "head.bias"],
                         "shard": list(range(WORLD)), "replicate": [rank]}]
        for i, (experts, dense) in enumerate(blocks):
            assert experts == {"params": [f"blocks.{i}.{n}" for n in ("w_in", "w_out", "b_out")],
                               "shard": _pair(rank), "replicate": [rank % 2, rank % 2 + 2]}
            assert dense == {"params": [f"blocks.{i}.{n}" for n in
                                        ("attn.weight", "attn.bias", "router.weight")],
                             "shard": list(range(WORLD)), "replicate": [rank]}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_on_their_own_mesh_train_and_clip_like_the_reference(backend):
    """AdamW, every step clipped by the 2-norm: the norm over parameters sharded on two
    meshes equals the reference's whole-model norm, and training matches. Per step, each
    group gathers once in forward and, in the blocks (which reshard after forward), again
    before backward; reduce-scatters once over its shard group; the experts' groups
    all-reduce over their replicate group; the norm is reduced once per shard group."""
    per_rank = _part(backend, "clipped")
    _assert_parity(per_rank, ADAMW_RTOL)
    for r in per_rank:
        assert_close(r["norms"], r["ref_norms"], FP32_RTOL)
        assert all(norm > 0.05 for norm in r["ref_norms"]), "a step did not clip"
        root, *blocks = r["groups"]
        groups = len(root) + sum(len(b) for b in blocks)
        shard_groups = {tuple(g["shard"]) for unit in r["groups"] for g in unit}
        assert r["comms_per_step"] == {
            "all_gather shard": groups + sum(len(b) for b in blocks),
            "reduce_scatter shard": groups,
            "all_reduce replicate": sum(len(g["replicate"]) > 1 for b in blocks for g in b),
            "all_reduce shard": len(shard_groups)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_round_trip_over_two_meshes(backend):
    """save_checkpoint of the trained model and its AdamW state, load_checkpoint into a
    fresh model wrapped alike (other initial values): the full state dicts, model and
    optimizer, are equal bit for bit."""
    for r in _part(backend, "clipped"):
        assert r["checkpoint_keys"], "the full state dicts differ in keys, or hold no optimizer state"
        assert r["checkpoint_equal"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulation_and_reshard_to_pairs_over_two_meshes(backend):
    """Two micro-batches a step, the first with the replicate all-reduce deferred;
    reshard_after_forward=2 (the dense groups, sharded over 4 ranks, keep half and
    re-gather over pairs; the experts' groups, sharded over pairs already, re-gather over
    their shard group); reduce-scatters over communicators of their own: at parity (SGD).
    Per step: the deferred all-reduce runs once per experts' group, in the last
    micro-batch."""
    groups = _part(backend, "clipped")[0]["groups"]
    blocks = groups[1:]
    n_groups = sum(len(unit) for unit in groups)
    dense = n_groups - len(blocks)  # groups over all 4 ranks: one per unit
    per_rank = _part(backend, "accumulated")
    _assert_parity(per_rank, FP32_RTOL)
    for r in per_rank:
        assert r["separate"], "a group still reduce-scatters over its shard group"
        assert r["comms_per_step"] == {
            "all_gather shard": 2 * (n_groups + len(blocks)),
            "all_gather post_forward": 2 * dense,
            "reduce_scatter shard": 2 * n_groups,
            "all_reduce replicate": len(blocks)}


@pytest.mark.timeout(600)
def test_torchs_shard_placement_result_trains_like_fsdp2():
    """torch: FSDP2's ShardPlacementResult(Shard(0), HSDPMeshInfo(...)) given to
    hyper_parallel as it is trains like FSDP2 given the same, and both like the reference
    (AdamW). Not bit for bit: after the first backward, a few elements of the dense
    weights' gradients (summed over 4 ranks; the experts' over 2 ranks are equal) differ
    from FSDP2's in the last place, the four ranks' parts added in another order."""
    for r in _part("torch", "fsdp2"):
        assert_close(r["ours"], r["theirs"], FP32_RTOL)
        assert r["fsdp2_diff"] <= FP32_RTOL
        assert r["param_diff"] <= ADAMW_RTOL and r["their_param_diff"] <= ADAMW_RTOL
        assert r["local_shapes_match"]


@pytest.mark.timeout(600)
def test_experts_over_a_sub_mesh_train_like_fsdp2():
    """torch: the experts on a pair sub-mesh alone (FSDP2's FSDPMeshInfo(mesh["shard"],
    shard_mesh_dim=0), as an expert-parallel layout writes it; gradients reduced over the
    pair only, so no single process computes this): like FSDP2 (the same tolerance and
    reason as above). A checkpoint of it is refused, naming the mesh's size, and so is one
    of whole units over the pair sub-mesh beside a root over every rank; clipping by the
    total norm is refused too (no rank sees the other pair's experts' gradients)."""
    for r in _part("torch", "fsdp2"):
        assert_close(r["pair_ours"], r["pair_theirs"], FP32_RTOL)
        assert r["pair_fsdp2_diff"] <= FP32_RTOL
        for key in ("pair_checkpoint", "units_on_pairs_checkpoint"):
            error_type, message = r[key]
            assert error_type == "CheckpointError" and "spans 2 of 4 ranks" in message, key
        error_type, message = r["pair_clip"]
        assert error_type == "NotImplementedError" and "spanning 2 and 4 ranks" in message


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case, error_type, message", [
    ("not_this_rank", "ValueError", "which does not hold this rank"),
    ("outside_the_job", "ValueError", "which is not a mesh of this job's 4 ranks"),
    ("dim_out_of_range", "ValueError", "return a dim in [-3, 3)"),
    ("three_dims", "ValueError", "dp_mesh_dims=hp.DataParallelMeshDims("),
    ("reshard_not_a_factor", "ValueError",
     "must be a factor of the shard group size of each of the unit's meshes (2 and 4), got 4"),
    ("setter_not_a_factor", "ValueError",
     "must be a factor of the shard group size of each of the unit's meshes (2 and 4), got 4"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_placements_are_rejected_cleanly(backend, case, error_type, message):
    found_type, found_message, untouched = _part(backend, "bad")[0][case]
    assert found_type == error_type, found_message
    assert message in found_message
    assert untouched, "a call that failed changed the module (or a unit's setting)"


def test_shard_placement_result_checks_its_fields():
    import hyper_parallel as hp

    mesh = hp.DeviceMesh("cpu", (1,), ("shard",), [None])
    assert hp.ShardPlacementResult(None, mesh).dp_mesh_dims is None
    for placement in ("0", 1.0, True):
        with pytest.raises(TypeError, match="placement must be Shard.dim., an int dim or None"):
            hp.ShardPlacementResult(placement, mesh)
    with pytest.raises(TypeError, match="return the dim alone"):
        hp.ShardPlacementResult(0, None)
    with pytest.raises(TypeError, match="dp_mesh_dims must be a hp.DataParallelMeshDims"):
        hp.ShardPlacementResult(0, mesh, dp_mesh_dims="shard")
