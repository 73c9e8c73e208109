"""Meshes read as FSDP2 reads them: a 2-D mesh by position whatever its dim names, and on a
mesh with more dims the data-parallel dims named by ``dp_mesh_dims`` (the others left
to tensor parallelism), on both frameworks.

All multi-rank scenarios of a backend (tests/mesh_scenarios.py) run in the suite's shared
4-rank launch (tests/shared_launch.py);
each test reads its scenario. Parity: losses and gathered parameters against a
single-process reference on the global batch. Groups: the ranks each unit's shard and
replicate groups hold, gathered over the groups themselves, against the mesh geometry.
Bad ``dp_mesh_dims`` fail in ``fully_shard``'s checks, before any collective, so they run
here in the test process on a mesh without groups.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import shared_launch
from tests.mesh_scenarios import SCENARIOS, TORCH_ONLY
from tests.tolerance import FP32_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
WORLD = 4


def _pair(r):  # ranks 2k, 2k+1: the ranks that differ only along the last of two dims
    return [r - r % 2, r - r % 2 + 1]


def _stride2(r):  # ranks r % 2, r % 2 + 2: the ranks that differ only along the first dim
    return [r % 2, r % 2 + 2]


def _all(r):
    return list(range(WORLD))


def _alone(r):
    return [r]


# name: (shard group ranks, replicate group ranks, training collectives' dims, DTensor mesh)
EXPECTED = {
    "hsdp_named": (_pair, _stride2, ["replicate", "shard"], lambda r: [[0, 1], [2, 3]]),
    "hsdp_torch_unnamed": (_pair, _stride2, ["replicate", "shard"], lambda r: [[0, 1], [2, 3]]),
    "dp_tp_by_name": (_stride2, _alone, ["shard"], _stride2),
    "dp_tp_by_position": (_stride2, _alone, ["shard"], _stride2),
    "tp_dp_by_position": (_pair, _alone, ["shard"], _pair),
    "dp_tp_torch_mesh": (_stride2, _alone, ["shard"], _stride2),
    "dp_tp_torch_dims": (_stride2, _alone, ["shard"], _stride2),
    "dp_slice_of_dp_tp": (_stride2, _alone, ["shard"], _stride2),
    "ddp_tp": (_alone, _stride2, ["replicate"], lambda r: [[x] for x in _stride2(r)]),
    "flatten_shard": (_all, _alone, ["shard"], _all),
    "flatten_shard_torch_mesh": (_all, _alone, ["shard"], _all),
    "hsdp_flatten_replicate": (_pair, _stride2, ["replicate", "shard"], lambda r: [[0, 1], [2, 3]]),
}


def _names(backend):
    return tuple(n for n in SCENARIOS if backend == "torch" or n not in TORCH_ONLY)


# MindSpore: 4 ranks on 2 cores take minutes, not seconds
shared_launch.register(__name__, "meshes", WORLD, "tests.mesh_scenarios:run_all",
                       lambda backend: (list(_names(backend)),), timeout_s=700)


def _launch(backend):
    return shared_launch.results("meshes", backend)


def _results(backend, name):
    if name not in _names(backend):
        pytest.skip(f"{name} passes torch's own DeviceMesh (and DataParallelMeshDims), which "
                    f"exist only on torch")
    return [per_rank[name] for per_rank in _launch(backend)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_parity(backend, name):
    per_rank = _results(backend, name)
    mean_losses = np.mean([r["losses"] for r in per_rank], axis=0)
    assert_close(mean_losses, per_rank[0]["ref_losses"], FP32_RTOL)
    for rank, result in enumerate(per_rank):
        assert result["param_diff"] <= FP32_RTOL, f"rank {rank}: gathered parameters differ by " \
                                             f"{result['param_diff']}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_groups_hold_only_data_parallel_peers(backend, name):
    shard, replicate, dims, dtensor_mesh = EXPECTED[name]
    for rank, result in enumerate(_results(backend, name)):
        assert result["shard_ranks"] == shard(rank), f"rank {rank}: shard group"
        assert result["replicate_ranks"] == replicate(rank), f"rank {rank}: replicate group"
        # every collective of a training step went over one of the two groups above
        assert result["counted_dims"] == dims, f"rank {rank}: collectives counted on"
        if backend == "torch":
            assert result["dtensor_meshes"] == [str(dtensor_mesh(rank))], f"rank {rank}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reshard_after_forward_to_a_smaller_group(backend):
    """reshard_after_forward=2 on 4 ranks: parity (and on torch the same as FSDP2's);
    forward gathers over the shard group, the re-gather before backward over pairs of
    ranks only, the blocks' whole full parameters; on MindSpore, which keeps the full
    parameters until backward (as with True), no re-gather."""
    per_rank = [per_rank["reshard_to_pairs"] for per_rank in _launch(backend)]
    mean_losses = np.mean([r["losses"] for r in per_rank], axis=0)
    assert_close(mean_losses, per_rank[0]["ref_losses"], FP32_RTOL)
    for rank, result in enumerate(per_rank):
        assert result["param_diff"] <= FP32_RTOL, f"rank {rank}"
        blocks = result["units"] - 1
        for step in result["gathered"]:
            assert step["shard"][0] == result["units"], f"rank {rank}: one forward gather per unit"
            assert step["post_forward"] == [blocks, result["block_gathered_bytes"]], f"rank {rank}"
        assert result["post_forward_ranks"] == _pair(rank), f"rank {rank}: post-forward group"
        # each of the pair keeps, and sends, half of the blocks' full parameters
        assert 2 * result["kept_bytes"] == result["block_gathered_bytes"], f"rank {rank}"
        if backend == "torch":
            np.testing.assert_array_equal(result["losses"], result["fsdp2_losses"])  # same math
            assert result["fsdp2_param_diff"] == 0.0, f"rank {rank}: against FSDP2"


def _fake_mesh(hp, shape, names):
    """A mesh of 4 ranks without process groups: enough for checks that come before any
    collective."""
    return hp.DeviceMesh("cpu", shape, names, [None] * len(shape))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, message", [
    ("three_dims_without_dp_mesh_dims", "dp_mesh_dims=hp.DataParallelMeshDims("),
    ("unknown_name", "names dim 'dq', which the mesh does not have; "
                     "its dims are ('dp', 'tp', 'cp')"),
    ("named_twice", "names a dim of the mesh twice"),
    ("shard_and_replicate_overlap", "names the dims ['tp'] both as shard and as replicate"),
    ("position_out_of_range", "dim position 3, out of range for the 3-D mesh"),
    ("flatten_part_of_the_job", "needs a mesh over all 1 ranks; this mesh holds 4"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_dp_mesh_dims_change_nothing(monkeypatch, backend, case, message):
    monkeypatch.setenv("HP_BACKEND", backend)
    import hyper_parallel as hp
    from tests.kit import get_kit

    kit = get_kit()
    platform = hp.get_platform()
    mesh = _fake_mesh(hp, (2, 2, 1), ("dp", "tp", "cp"))
    dims = {
        "three_dims_without_dp_mesh_dims": None,
        "unknown_name": hp.DataParallelMeshDims(shard="dq"),
        "named_twice": hp.DataParallelMeshDims(shard=("dp", 0)),
        "shard_and_replicate_overlap": hp.DataParallelMeshDims(shard="tp", replicate=("dp", 1)),
        "position_out_of_range": hp.DataParallelMeshDims(shard=3),
        "flatten_part_of_the_job": hp.DataParallelMeshDims(shard=("dp", "tp")),
    }[case]
    model = kit.Block(8, 12, 6)
    def param_ids():
        return [id(p) for _, sub in platform.named_modules(model)
                for _, p in platform.direct_params(sub)]

    before = param_ids()
    with pytest.raises(ValueError) as raised:
        hp.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    assert message in str(raised.value)
    assert type(model) is kit.Block and "_hp_state" not in model.__dict__
    assert param_ids() == before


def test_data_parallel_mesh_dims_needs_a_role_and_dim_names_or_positions():
    import hyper_parallel as hp

    with pytest.raises(ValueError, match="needs shard, replicate or both"):
        hp.DataParallelMeshDims()
    with pytest.raises(ValueError, match="empty tuple"):
        hp.DataParallelMeshDims(shard=())
    with pytest.raises(TypeError, match="dim names .str., dim positions .int."):
        hp.DataParallelMeshDims(shard=["dp"])
    with pytest.raises(TypeError, match="got True"):
        hp.DataParallelMeshDims(replicate=True)


def test_a_framework_dp_mesh_dims_is_rebuilt_as_ours(monkeypatch):
    """What the platform describes as its own DataParallelMeshDims becomes ours, field by
    field, wherever dp_mesh_dims is read; a field ours lacks is a TypeError naming it; an
    object the platform does not recognise keeps the type error."""
    import hyper_parallel as hp
    from hyper_parallel.fully_shard import mesh as mesh_module

    native, fields = object(), {"shard": "c", "replicate": "a"}
    monkeypatch.setenv("HP_BACKEND", "torch")  # this process may have imported both frameworks
    platform = hp.get_platform()
    monkeypatch.setattr(platform, "option_from_native", lambda value: (
        "DataParallelMeshDims", dict(fields)) if value is native else None)
    three = _fake_mesh(hp, (2, 1, 2), ("a", "b", "c"))
    assert mesh_module.as_dp_mesh_dims(native) == hp.DataParallelMeshDims(shard="c",
                                                                          replicate="a")
    assert mesh_module.data_parallel_dims(three, native) == ((0,), (2,))
    assert hp.ShardPlacementResult(0, three, native).dp_mesh_dims == \
        hp.DataParallelMeshDims(shard="c", replicate="a")
    with pytest.raises(TypeError, match="DataParallelMeshDims, got object"):
        mesh_module.data_parallel_dims(three, object())
    fields["context"] = "b"
    with pytest.raises(TypeError, match=r"has fields \['context'\] that "
                                        r"hp.DataParallelMeshDims does not have"):
        mesh_module.data_parallel_dims(three, native)


def test_a_sub_mesh_holds_the_ranks_that_share_this_ranks_other_coordinates(monkeypatch):
    """mesh["b"], mesh["a", "c"]: the named dims' shape and groups, and the ranks whose
    coordinates on the other dims are this rank's (here rank 3 of a (1, 2, 2) mesh)."""
    import hyper_parallel as hp

    mesh = hp.DeviceMesh("cpu", (1, 2, 2), ("a", "b", "c"), ["group a", "group b", "group c"])
    monkeypatch.setenv("HP_BACKEND", "torch")  # this process may have imported both frameworks
    monkeypatch.setattr(hp.get_platform(), "rank", lambda: 3)
    b = mesh["b"]
    assert (b.shape, b.mesh_dim_names, b.ranks, b.get_group(0)) == ((2,), ("b",), (1, 3),
                                                                    "group b")
    a_c = mesh["a", "c"]
    assert (a_c.shape, a_c.ranks, a_c.get_group("c")) == ((1, 2), (2, 3), "group c")
    with pytest.raises(KeyError, match="taken by dim names"):
        mesh["x"]
    with pytest.raises(KeyError, match="taken by dim names"):
        mesh[0]
    with pytest.raises(ValueError, match="in the mesh's order"):
        mesh["c", "a"]


def test_dims_are_read_by_position_and_roles_ascend():
    import hyper_parallel as hp
    from hyper_parallel.fully_shard.mesh import data_parallel_dims

    two = _fake_mesh(hp, (2, 2), ("dp_replicate", "dp_shard"))
    assert data_parallel_dims(two, None) == ((0,), (1,))
    three = _fake_mesh(hp, (2, 1, 2), ("a", "b", "c"))
    # only the shard role given: no replicate dim; a negative position counts from the end
    assert data_parallel_dims(three, hp.DataParallelMeshDims(shard=-1)) == ((), (2,))
    # no process group made for a single dim per role, so no world is needed
    both = hp.DataParallelMeshDims(shard="c", replicate="a")
    assert data_parallel_dims(three, both) == ((0,), (2,))
