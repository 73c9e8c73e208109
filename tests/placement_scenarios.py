"""Rank side of tests/test_shard_placement.py: a mixture-of-experts model whose experts
``shard_placement_fn`` places on a mesh of their own, on 4 ranks, for both frameworks.

The model (tests/kit.py ``MoE``): an input projection, two MoE blocks and a head. A block
holds a dense layer and a router, sharded over the whole 4-rank mesh like the projection
and the head, and three expert tensors of 4 experts each (the last block's expert bias
unused: no backward reaches it). Each block is one unit whose expert tensors are sharded
on dim 0 over a 2 x 2 (replicate, shard) mesh: each pair of ranks holds all the experts
between them (2 per rank) and the two pairs are replicas (HSDP for the experts only).
Training runs on this rank's slice of each global batch, next to a single-process
reference on the whole batch (same initial values); on torch also FSDP2 with torch's own
``ShardPlacementResult``, which hyper_parallel is given too.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

import hyper_parallel as hp
from tests.bad_input import _attempt
from tests.clip_grad_scenarios import _backward, _Clippers, _full_torch
from tests.kit import get_kit, make_batches
from tests.mesh_scenarios import _group_ranks
from tests.scenarios import D_IN, D_OUT, GLOBAL_BATCH, STEPS, _named

DIM, HIDDEN, EXPERTS, BLOCKS = 16, 12, 4, 2
MAX_NORM = 0.05  # below the gradients' 2-norm at every step: every step clips
MICRO_BATCHES = 2


def _build(kit, seed: int = 0):
    model = kit.MoE(D_IN, DIM, HIDDEN, EXPERTS, BLOCKS, D_OUT)
    kit.load(model, seed)
    return model


def expert_mesh():
    """The experts' (replicate, shard) mesh: pairs of ranks shard, the pairs replicate."""
    platform = hp.get_platform()
    return hp.init_device_mesh(platform.device_type(), (2, platform.world_size() // 2),
                               mesh_dim_names=("replicate", "shard"))


def _wrap(model, place, shard=hp.fully_shard, **options):
    """Each block a unit whose expert tensors ``place`` places, then the root."""
    experts = {id(p) for block in model.blocks for p in block.experts()}
    for block in model.blocks:
        shard(block, shard_placement_fn=lambda p: place if id(p) in experts else None, **options)
    shard(model, **options)
    return model


def _rows() -> slice:
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    return slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)


def _train_clipped(kit, model, clip, rows: slice) -> tuple:
    """AdamW steps, each clipping the gradients' 2-norm to MAX_NORM with ``clip``:
    (losses, norms, the optimizer)."""
    params = [p for p in kit.params(model) if p.requires_grad]
    opt = kit.optimizer(params, kind="adamw")
    losses, norms = [], []
    for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=21):
        def loss_fn(x=kit.tensor(x[rows]), y=kit.tensor(y[rows])):
            return ((model(x) - y) ** 2).mean()

        loss, grads = _backward(kit, loss_fn, params)
        grads, norm = clip(params, grads, MAX_NORM, 2.0)
        if grads is None:
            opt.step()
            opt.zero_grad()
        else:
            opt(grads)
        losses.append(loss)
        norms.append(norm)
    return losses, norms, opt


def _diff(full: dict, reference: dict) -> float:
    assert sorted(full) == sorted(reference), (sorted(full), sorted(reference))
    return max(float(np.abs(full[k] - reference[k]).max()) for k in reference)


def _reference_full(kit, ref) -> dict:
    return {k: kit.to_numpy(v) for k, v in _named(kit, ref).items()}


def _units(platform, model) -> list:
    states = []
    for _, sub in platform.named_modules(model):
        state = sub.__dict__.get("_hp_state")
        if state is not None and all(state is not s for s in states):
            states.append(state)
    return states


def _groups(platform, model) -> list:
    """Per unit, per parameter group: its parameters' names and the global ranks of its
    shard and replicate groups."""
    return [[{"params": [fp.fqn for fp in group.params],
              "shard": _group_ranks(platform, group.mesh_info.shard_group,
                                    group.mesh_info.shard_size),
              "replicate": _group_ranks(platform, group.mesh_info.replicate_group,
                                        group.mesh_info.replicate_size)}
             for group in state.groups] for state in _units(platform, model)]


def _counted(comms) -> dict:
    """{"op dim": calls} of one window of ``track_comms``."""
    counts: dict = {}
    for (op, _wire, dim), record in comms.records.items():
        counts[f"{op} {dim}"] = counts.get(f"{op} {dim}", 0) + record.calls
    return counts


def run_clipped_and_checkpointed(directory: str) -> dict:
    """AdamW with clipping against the reference (which clips with the framework's own
    whole-model clipping), the parameter groups' ranks and one step's collectives; then a
    checkpoint saved and loaded into a fresh model and optimizer."""
    kit = get_kit()
    platform = hp.get_platform()
    clippers = _Clippers(kit)
    ref = _build(kit)
    ref_losses, ref_norms, _ = _train_clipped(kit, ref, clippers.framework, slice(None))
    model = _wrap(_build(kit), hp.ShardPlacementResult(0, expert_mesh()))
    with hp.track_comms() as comms:
        losses, norms, opt = _train_clipped(kit, model, clippers.hp, _rows())
    full = hp.gather_full_state_dict(model)
    out = {"losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms,
           "param_diff": _diff(full, _reference_full(kit, ref)),
           "groups": _groups(platform, model),
           "comms_per_step": {k: v / STEPS for k, v in _counted(comms).items()}}
    path = os.path.join(directory, platform.name)
    hp.save_checkpoint(path, model, opt)
    saved = hp.get_full_state_dict(model, opt, rank0_only=False)
    fresh = _wrap(_build(kit, seed=1), hp.ShardPlacementResult(0, expert_mesh()))
    fresh_opt = kit.optimizer([p for p in kit.params(fresh) if p.requires_grad], kind="adamw")
    hp.load_checkpoint(path, fresh, fresh_opt)
    loaded = hp.get_full_state_dict(fresh, fresh_opt, rank0_only=False)
    out["checkpoint_keys"] = sorted(saved) == sorted(loaded) and any(
        k.startswith("optim") for k in saved)
    out["checkpoint_equal"] = all(np.array_equal(saved[k], loaded[k]) for k in saved)
    return out


def run_accumulated_resharded_to_pairs() -> dict:
    """SGD with two micro-batches per step, the first with the replicate all-reduce
    deferred (set_requires_all_reduce(False)); blocks reshard after forward to pairs of
    ranks (reshard_after_forward=2: the dense group's post-forward group; the experts'
    shard group is a pair already), reduce-scatters over a communicator of their own."""
    kit = get_kit()
    platform = hp.get_platform()
    ref = _build(kit)
    model = _wrap(_build(kit), hp.ShardPlacementResult(0, expert_mesh()),
                  reshard_after_forward=2)
    model.set_separate_reduce_scatter_group()
    infos = [g.mesh_info for state in _units(platform, model) for g in state.groups]
    opt, ref_opt = kit.optimizer(kit.params(model)), kit.optimizer(kit.params(ref))
    losses, ref_losses, windows = [], [], []
    for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=31):
        with hp.track_comms() as comms:
            losses.append(kit.train_step(
                model, opt, x[_rows()], y[_rows()], micro_batches=MICRO_BATCHES,
                sync_fn=lambda i, last: model.set_requires_all_reduce(last)))
        windows.append(_counted(comms))
        ref_losses.append(kit.train_step(ref, ref_opt, x, y, micro_batches=MICRO_BATCHES))
    return {"losses": losses, "ref_losses": ref_losses,
            "param_diff": _diff(hp.gather_full_state_dict(model), _reference_full(kit, ref)),
            "separate": all(i.reduce_scatter_group is not i.shard_group for i in infos),
            "comms_per_step": windows[-1]}


def run_torch_result_against_fsdp2(directory: str) -> dict:
    """torch: FSDP2's own ShardPlacementResult given to hyper_parallel and to FSDP2; AdamW,
    no clipping (torch's clip_grad_norm_ cannot stack norms of DTensors on different
    meshes). An HSDPMeshInfo over the 2 x 2 torch mesh: both against the reference. An
    FSDPMeshInfo over the pair sub-mesh (``mesh["shard"]``, as an expert-parallel layout
    writes it): the experts' gradients are reduced over the pair only, so the two pairs'
    experts part ways and no single process computes this; against FSDP2 only, and a
    checkpoint of it is refused (its mesh leaves ranks out)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult)
    from torch.distributed.tensor import Shard

    kit = get_kit()
    world = hp.get_platform().world_size()
    torch_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    place = ShardPlacementResult(Shard(0), HSDPMeshInfo(torch_mesh, shard_mesh_dim=1,
                                                        replicate_mesh_dim=0))
    ours, theirs, ref = _wrap(_build(kit), place), _wrap(_build(kit), place, fully_shard), \
        _build(kit)
    out = {}
    for name, model, rows in (("ours", ours, _rows()), ("theirs", theirs, _rows()),
                              ("ref", ref, slice(None))):
        out[name], _, _ = _train_clipped(kit, model, lambda p, g, *_: (None, 0.0), rows)
    full, their_full = hp.gather_full_state_dict(ours), _full_torch(kit, theirs)
    ref_full = _reference_full(kit, ref)
    out["param_diff"] = _diff(full, ref_full)
    out["their_param_diff"] = _diff(their_full, ref_full)
    out["fsdp2_diff"] = _diff(full, their_full)
    out["local_shapes_match"] = all(
        tuple(a.to_local().shape) == tuple(b.to_local().shape)
        for a, b in zip(ours.parameters(), theirs.parameters()))
    pair = ShardPlacementResult(Shard(0), FSDPMeshInfo(torch_mesh["shard"], shard_mesh_dim=0))
    ours, theirs = _wrap(_build(kit), pair), _wrap(_build(kit), pair, fully_shard)
    for name, model in (("pair_ours", ours), ("pair_theirs", theirs)):
        out[name], _, _ = _train_clipped(kit, model, lambda p, g, *_: (None, 0.0), _rows())
    out["pair_fsdp2_diff"] = _diff(hp.gather_full_state_dict(ours), _full_torch(kit, theirs))
    out["pair_checkpoint"] = _attempt(kit, hp.get_platform(), ours, lambda: hp.save_checkpoint(
        os.path.join(directory, "pair"), ours))[:2]
    x, y = make_batches(1, GLOBAL_BATCH, D_IN, D_OUT, seed=21)[0]
    _backward(kit, lambda: ((ours(kit.tensor(x[_rows()])) - kit.tensor(y[_rows()])) ** 2).mean(),
              None)
    out["pair_clip"] = _attempt(kit, hp.get_platform(), ours, lambda: hp.clip_grad_norm_(
        list(ours.parameters()), MAX_NORM))[:2]
    # whole blocks (dense layers and experts) as units over the pair sub-mesh, the root over
    # every rank: the meshes differ between units rather than inside one
    blocks_on_pairs = _build(kit)
    for block in blocks_on_pairs.blocks:
        hp.fully_shard(block, mesh=torch_mesh["shard"])
    hp.fully_shard(blocks_on_pairs)
    out["units_on_pairs_checkpoint"] = _attempt(
        kit, hp.get_platform(), blocks_on_pairs, lambda: hp.save_checkpoint(
            os.path.join(directory, "units-on-pairs"), blocks_on_pairs))[:2]
    return out


def run_bad_placements() -> dict:
    """Each bad placement: (error type, message, module untouched?)."""
    kit = get_kit()
    platform = hp.get_platform()
    world, rank = platform.world_size(), platform.rank()
    mesh = expert_mesh()
    pair = mesh._lines((1,))  # the ranks of each shard group
    others = next(line for line in pair if rank not in line)
    group = mesh.get_group(1)
    cases = {
        "not_this_rank": hp.ShardPlacementResult(
            0, hp.DeviceMesh(platform.device_type(), (2,), ("shard",), [group], ranks=others)),
        "outside_the_job": hp.ShardPlacementResult(
            0, hp.DeviceMesh(platform.device_type(), (2,), ("shard",), [group],
                             ranks=(world, world + 1))),
        "dim_out_of_range": hp.ShardPlacementResult(5, mesh),
        "three_dims": hp.ShardPlacementResult(0, hp.init_device_mesh(
            platform.device_type(), (1, 2, world // 2))),
    }
    out = {}
    for name, place in cases.items():
        model = _build(kit)
        out[name] = _attempt(kit, platform, model.blocks[0], lambda m=model: _wrap(m, place))
    model = _build(kit)
    out["reshard_not_a_factor"] = _attempt(
        kit, platform, model.blocks[0],
        lambda: _wrap(model, hp.ShardPlacementResult(0, mesh), reshard_after_forward=world))
    model = _wrap(_build(kit), hp.ShardPlacementResult(0, mesh))
    before = [s.reshard_after_forward for s in _units(platform, model)]
    error = _attempt(kit, platform, model, lambda: model.set_reshard_after_forward(world))
    out["setter_not_a_factor"] = error[:2] + (
        [s.reshard_after_forward for s in _units(platform, model)] == before,)
    return out


@contextlib.contextmanager
def _collectives(sync: str):
    """``HP_SYNC_COLLECTIVES`` set while a model's root initializes (and trains)."""
    saved = os.environ.get("HP_SYNC_COLLECTIVES")
    os.environ["HP_SYNC_COLLECTIVES"] = sync
    try:
        yield
    finally:
        if saved is None:
            del os.environ["HP_SYNC_COLLECTIVES"]
        else:
            os.environ["HP_SYNC_COLLECTIVES"] = saved


def run_all(directory: str) -> dict:
    """Both reduction paths on both frameworks: the clipped run reduces synchronously (on
    MindSpore each unit's backward returns the reduced shards), the accumulated one
    through the overlapped pipeline (on MindSpore into placeholders filled later)."""
    with _collectives("1"):
        clipped = run_clipped_and_checkpointed(directory)
    with _collectives("0"):
        accumulated = run_accumulated_resharded_to_pairs()
    out = {"clipped": clipped, "accumulated": accumulated, "bad": run_bad_placements()}
    if get_kit().name == "torch":
        out["fsdp2"] = run_torch_result_against_fsdp2(directory)
    return out

