"""Rank-side scenarios of the mesh suite (test_meshes.py), for both frameworks, on 4 ranks.

Each scenario builds a mesh, wraps the nested model with ``mesh`` (and ``dp_mesh_dims``)
and trains it a few SGD steps on this rank's slice of each global batch, next to a
single-process reference on the whole batch. The slice follows the data-parallel index
the scenario's layout gives this rank (``SCENARIOS``), never what fully_shard made of the
mesh, so a wrong reading of the mesh breaks parity. Ranks that differ only along a dim
that is not data parallel (tensor parallel) get the same slice.

Besides parity a scenario reports what the units communicated over: the global ranks of
each group (gathered over that group), the mesh dims the training collectives were
counted on, and on torch the ranks of the DTensor parameters' mesh.
"""

from __future__ import annotations

import math

import numpy as np

import hyper_parallel as hp
from hyper_parallel.fully_shard.state import STATE_ATTR
from tests.kit import get_kit, make_batches
from tests.scenarios import D_IN, D_OUT, GLOBAL_BATCH, STEPS, _build, _named

Dims = hp.DataParallelMeshDims

# name: (mesh maker, shape, dim names, dp_mesh_dims, data-parallel index of rank r, dp size);
# maker "hp_dp_slice": the hp mesh's sub-mesh mesh["dp"] (FSDP2's way with tensor parallelism);
# a dict of dp_mesh_dims is torch's own DataParallelMeshDims with those fields (torch only)
SCENARIOS = {
    "hsdp_named": ("hp", (2, 2), ("dp_replicate", "dp_shard"), None, lambda r: r, 4),
    "hsdp_torch_unnamed": ("torch", (2, 2), None, None, lambda r: r, 4),
    "dp_tp_by_name": ("hp", (2, 2), ("dp", "tp"), Dims(shard="dp"), lambda r: r // 2, 2),
    "dp_tp_by_position": ("hp", (2, 2), ("dp", "tp"), Dims(shard=0), lambda r: r // 2, 2),
    "tp_dp_by_position": ("hp", (2, 2), ("tp", "dp"), Dims(shard=1), lambda r: r % 2, 2),
    "dp_tp_torch_mesh": ("torch", (2, 2), ("dp", "tp"), Dims(shard="dp"), lambda r: r // 2, 2),
    "dp_tp_torch_dims": ("torch", (2, 2), ("dp", "tp"), {"shard": "dp"}, lambda r: r // 2, 2),
    "dp_slice_of_dp_tp": ("hp_dp_slice", (2, 2), ("dp", "tp"), None, lambda r: r // 2, 2),
    "ddp_tp": ("hp", (2, 2), ("dp", "tp"), Dims(replicate="dp"), lambda r: r // 2, 2),
    "flatten_shard": ("hp", (2, 2), ("a", "b"), Dims(shard=("a", "b")), lambda r: r, 4),
    "flatten_shard_torch_mesh": ("torch", (2, 2), ("a", "b"), Dims(shard=("a", 1)), lambda r: r, 4),
    "hsdp_flatten_replicate": ("hp", (2, 1, 2), ("a", "b", "c"),
                               Dims(replicate=("a", "b"), shard="c"), lambda r: r, 4),
}
TORCH_ONLY = ("hsdp_torch_unnamed", "dp_tp_torch_mesh", "dp_tp_torch_dims",
              "flatten_shard_torch_mesh")


def _mesh(maker: str, shape: tuple, names):
    platform = hp.get_platform()
    if maker == "torch":
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", shape, mesh_dim_names=names)
    mesh = hp.init_device_mesh(platform.device_type(), shape, mesh_dim_names=names)
    return mesh["dp"] if maker == "hp_dp_slice" else mesh


def _group_ranks(platform, group, size: int) -> list:
    """The global ranks of ``group``, in group order, as the group itself reports them."""
    if size == 1:
        return [platform.rank()]
    mine = platform.from_numpy(np.array([platform.rank()], np.float32))
    pieces = platform.all_gather(mine, group).wait().pieces
    return [int(platform.to_numpy(p)[0]) for p in pieces]


def run_scenario(name: str) -> dict:
    kit = get_kit()
    platform = hp.get_platform()
    rank = platform.rank()
    maker, shape, names, dims, dp_index, dp_size = SCENARIOS[name]
    mesh = _mesh(maker, shape, names)
    if isinstance(dims, dict):
        from torch.distributed.fsdp import DataParallelMeshDims

        dims = DataParallelMeshDims(**dims)
    model, ref = _build(kit, "nested"), _build(kit, "nested")
    kit.load(model, 0)
    kit.load(ref, 0)
    for block in model.blocks:
        hp.fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    hp.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    opt, ref_opt = kit.optimizer(kit.params(model)), kit.optimizer(kit.params(ref))
    size = GLOBAL_BATCH // dp_size
    local = slice(dp_index(rank) * size, (dp_index(rank) + 1) * size)
    losses, ref_losses, counted_dims = [], [], set()
    for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=5):
        with hp.track_comms() as comms:
            losses.append(kit.train_step(model, opt, x[local], y[local]))
        counted_dims |= {dim for (_op, _wire, dim) in comms.records}
        ref_losses.append(kit.train_step(ref, ref_opt, x, y))
    full = hp.gather_full_state_dict(model)
    ref_full = {k: kit.to_numpy(v) for k, v in _named(kit, ref).items()}
    (group,) = model.__dict__[STATE_ATTR].groups
    info = group.mesh_info
    return {
        "losses": losses, "ref_losses": ref_losses,
        "param_diff": max(float(np.abs(full[k] - ref_full[k]).max()) for k in ref_full),
        "counted_dims": sorted(counted_dims),
        "shard_ranks": _group_ranks(platform, info.shard_group, info.shard_size),
        "replicate_ranks": _group_ranks(platform, info.replicate_group, info.replicate_size),
        "dtensor_meshes": sorted({str(p.device_mesh.mesh.tolist()) for p in kit.params(model)})
        if platform.name == "torch" else None,
    }


def run_reshard_to_pairs() -> dict:
    """``reshard_after_forward=2`` on the 1-D mesh of the 4 ranks (block 0 given it by
    ``fully_shard``, the others by ``set_reshard_after_forward``): losses and gathered
    parameters next to the single-process reference and, on torch, to FSDP2 with
    ``reshard_after_forward=2``; what the all-gathers of each step sent, per mesh dim; the
    ranks of the group the re-gather before backward crossed."""
    kit = get_kit()
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    on_torch = platform.name == "torch"
    mesh = _mesh("torch" if on_torch else "hp", (world,), ("shard",))
    model, ref = _build(kit, "nested"), _build(kit, "nested")
    kit.load(model, 0)
    kit.load(ref, 0)
    for index, block in enumerate(model.blocks):
        hp.fully_shard(block, mesh=mesh, reshard_after_forward=2 if index == 0 else True)
    hp.fully_shard(model, mesh=mesh)
    for block in model.blocks[1:]:
        block.set_reshard_after_forward(2)
    models, opts = [model, ref], [kit.optimizer(kit.params(model)), kit.optimizer(kit.params(ref))]
    if on_torch:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        theirs = _build(kit, "nested")
        kit.load(theirs, 0)
        for block in theirs.blocks:
            torch_fully_shard(block, mesh=mesh, reshard_after_forward=2)
        torch_fully_shard(theirs, mesh=mesh)
        models.append(theirs)
        opts.append(kit.optimizer(kit.params(theirs)))
    size = GLOBAL_BATCH // world
    local = slice(rank * size, (rank + 1) * size)
    losses = [[] for _ in models]
    gathered = []  # per step: {dim: (calls, bytes)} of the all-gathers
    kept = []  # per step: what each block keeps after the forward, and sends in its re-gather
    model.register_forward_hook(lambda *_: kept.append(
        [block.__dict__[STATE_ATTR]._full.memory.post_forward for block in model.blocks]))
    for x, y in make_batches(3, GLOBAL_BATCH, D_IN, D_OUT, seed=5):
        with hp.track_comms() as comms:
            losses[0].append(kit.train_step(model, opts[0], x[local], y[local]))
        gathered.append({dim: [comms.calls("all_gather", dim=dim), comms.nbytes("all_gather", dim=dim)]
                         for dim in ("shard", "post_forward")})
        losses[1].append(kit.train_step(ref, opts[1], x, y))
        if on_torch:
            losses[2].append(kit.train_step(models[2], opts[2], x[local], y[local]))
    full = hp.gather_full_state_dict(model)
    ref_full = {k: kit.to_numpy(v) for k, v in _named(kit, ref).items()}
    states = [block.__dict__[STATE_ATTR] for block in model.blocks]
    info = states[0].groups[0].mesh_info
    result = {
        "losses": losses[0], "ref_losses": losses[1],
        "param_diff": max(float(np.abs(full[k] - ref_full[k]).max()) for k in ref_full),
        "gathered": gathered, "units": len(states) + 1,
        "block_gathered_bytes": sum(g.gathered_bytes for state in states for g in state.groups),
        "post_forward_ranks": _group_ranks(platform, info.post_forward_group(2), 2),
    }
    result["kept_bytes"] = sum(math.prod(platform.shape(shard)) *
                               platform.element_size(platform.dtype_of(shard))
                               for per_group in kept[-1] for pf in per_group
                               for shard in pf.shards)
    if on_torch:
        result["fsdp2_losses"] = losses[2]
        result["fsdp2_param_diff"] = max(float(np.abs(full[k] - v.full_tensor().detach().numpy()).max())
                                         for k, v in models[2].state_dict().items())
    return result


def run_all(names: list) -> dict:
    results = {name: run_scenario(name) for name in names}
    results["reshard_to_pairs"] = run_reshard_to_pairs()
    return results
