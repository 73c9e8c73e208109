"""Conformance checks of the platform contract: process groups and meshes (1-D and 2-D).

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.platform.conformance import _check, _f32, _same, _values, collective_check


@collective_check()
def check_process_group(ctx):
    p = ctx.p
    ranks = p.zeros((ctx.world,), p.dtype("float32"))
    p.all_gather_into(ranks, _f32(ctx, [ctx.rank]), ctx.mesh1.get_group(0))
    _check(p.is_initialized() is True, "is_initialized() is not True inside a launch")
    _check(0 <= ctx.rank < ctx.world, f"rank() {ctx.rank} outside world_size() {ctx.world}")
    _same(_values(ctx, ranks), np.arange(ctx.world, dtype=np.float32),
          "every rank reports a distinct rank()")
    _check(p.device_type() in ("cpu", "cuda", "npu"), f"device_type() = {p.device_type()!r}")


@collective_check()
def check_mesh_1d_groups(ctx):
    p = ctx.p
    group = ctx.mesh1.get_group(0)
    _check(p.group_size(group) == ctx.world, f"group_size(world mesh group) {p.group_size(group)}")
    _check(p.group_rank(group) == ctx.rank, f"group_rank(world mesh group) {p.group_rank(group)}")
    _check(ctx.mesh1.get_local_rank(0) == ctx.rank, "mesh.get_local_rank(0)")
    native = ctx.mesh1.native
    _check(p.mesh_from_native(object()) is None, "mesh_from_native(not a mesh) is not None")
    if native is not None:
        described = p.mesh_from_native(native)
        _check(described is not None, "mesh_from_native(the mesh's own native mesh) is None")
        shape, names, groups = described.shape, described.dim_names, described.groups
        device, grid = described.device_type, described.rank_grid
        _check(tuple(shape) == (ctx.world,) and tuple(names) == ("shard",),
               f"mesh_from_native: shape {shape}, names {names}")
        _check(device == p.device_type(), f"mesh_from_native device {device}")
        _check(list(grid) == list(range(ctx.world)), f"mesh_from_native rank grid {grid}")
        _check(p.group_size(groups[0]) == ctx.world, "mesh_from_native group size")


@collective_check()
def check_new_mesh_groups(ctx):
    """Direct call (hp.init_device_mesh wraps it): one group per dim; a size-1 dim too."""
    p, w = ctx.p, ctx.world
    device = p.device_type()
    made = {shape: p.new_mesh_groups(device, shape, names)
            for shape, names in (((w,), ("a",)), ((1, w), ("one", "all")))}
    probe = _f32(ctx, [1.0])
    p.all_reduce(probe, made[(1, w)][0][1])  # the size-w dim of the (1, w) mesh
    for shape, (groups, native) in made.items():
        _check(len(groups) == len(shape), f"new_mesh_groups{shape}: {len(groups)} groups")
        sizes = [p.group_size(g) for g in groups]
        _check(sizes == list(shape), f"new_mesh_groups{shape}: group sizes {sizes}")
        if native is not None:
            described = p.mesh_from_native(native)
            _check(described is not None and tuple(described.shape) == shape,
                   f"mesh_from_native(new_mesh_groups{shape} native) = {described}")
    _check(p.group_rank(made[(w,)][0][0]) == ctx.rank, "group_rank in the 1-D mesh group")
    _check(p.group_rank(made[(1, w)][0][0]) == 0, "group_rank in a size-1 dim group")
    _same(_values(ctx, probe), [float(w)], "all_reduce on the size-w dim of a (1, w) mesh")


@collective_check(even=True)
def check_new_group(ctx):
    """Groups over explicit rank lists (evens, odds), made by every rank in the same order:
    each rank's own group has the right size, rank and members; a framework mesh over it
    (where the platform makes one) lists the same ranks."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    evens, odds = list(range(0, w, 2)), list(range(1, w, 2))
    groups = {0: p.new_group(evens), 1: p.new_group(odds)}
    peers, mine = (evens, odds)[r % 2], groups[r % 2]
    _check(p.group_size(mine) == len(peers), f"new_group({peers}): size {p.group_size(mine)}")
    _check(p.group_rank(mine) == peers.index(r), f"new_group({peers}): rank {p.group_rank(mine)}")
    probe = _f32(ctx, [float(r)])
    p.all_reduce(probe, mine)
    _same(_values(ctx, probe), [float(sum(peers))], f"all_reduce over new_group({peers})")
    native = p.mesh_from_groups(p.device_type(), [mine], peers, ("dp",))
    if native is not None:
        described = p.mesh_from_native(native)
        _check(described is not None and list(described.rank_grid) == peers,
               f"mesh_from_groups over {peers}: described as {described}")


def _coords(ctx):
    s_size = ctx.world // 2
    return ctx.rank // s_size, ctx.rank % s_size, s_size


@collective_check(min_world=4, even=True)
def check_mesh2d_groups(ctx):
    p = ctx.p
    r_idx, s_idx, s_size = _coords(ctx)
    mesh = ctx.mesh2
    rep, shard = mesh.get_group("replicate"), mesh.get_group("shard")
    got = {"replicate": (p.group_rank(rep), p.group_size(rep)),
           "shard": (p.group_rank(shard), p.group_size(shard))}
    expected = {"replicate": (r_idx, 2), "shard": (s_idx, s_size)}
    _check(got == expected, f"rank {ctx.rank}: (group_rank, group_size) {got}, expected {expected}")
    _check((mesh.get_local_rank(0), mesh.get_local_rank(1)) == (r_idx, s_idx),
           "mesh.get_local_rank")
    if mesh.native is not None:
        described = p.mesh_from_native(mesh.native)
        shape, names, grid = described.shape, described.dim_names, described.rank_grid
        _check(tuple(shape) == (2, s_size) and tuple(names) == ("replicate", "shard"),
               f"mesh_from_native shape {shape} names {names}")
        expected_grid = np.arange(ctx.world).reshape(2, s_size).tolist()
        _check([list(row) for row in grid] == expected_grid, f"rank grid {grid}")


@collective_check(min_world=4, even=True)
def check_mesh2d_all_reduce(ctx):
    p = ctx.p
    r_idx, s_idx, s_size = _coords(ctx)
    mine = float(10 ** ctx.rank)
    along_rep, along_shard = _f32(ctx, [mine]), _f32(ctx, [mine])
    with hp.track_comms() as window:
        p.all_reduce(along_rep, ctx.mesh2.get_group("replicate"), dim="replicate")
        p.all_reduce(along_shard, ctx.mesh2.get_group("shard"), dim="shard")
    rep_ranks = [k * s_size + s_idx for k in range(2)]
    shard_ranks = [r_idx * s_size + j for j in range(s_size)]
    _same(_values(ctx, along_rep), [sum(10.0 ** k for k in rep_ranks)],
          f"all_reduce along 'replicate' (ranks {rep_ranks})")
    _same(_values(ctx, along_shard), [sum(10.0 ** k for k in shard_ranks)],
          f"all_reduce along 'shard' (ranks {shard_ranks})")
    _check(window.calls("all_reduce", dim="replicate") == 1
           and window.calls("all_reduce", dim="shard") == 1,
           f"CommStats dims: {window.summary()}")


@collective_check(min_world=4, even=True)
def check_mesh2d_gather_scatter(ctx):
    p = ctx.p
    r_idx, s_idx, s_size = _coords(ctx)
    shard, rep = ctx.mesh2.get_group("shard"), ctx.mesh2.get_group("replicate")
    gathered = p.zeros((s_size * 2,), p.dtype("float32"))
    p.all_gather_into(gathered, _f32(ctx, [ctx.rank, -ctx.rank]), shard)
    chunk = p.zeros((2,), p.dtype("float32"))
    p.reduce_scatter(chunk, _f32(ctx, np.arange(4) * (ctx.rank + 1)), rep)
    members = [r_idx * s_size + j for j in range(s_size)]
    _same(_values(ctx, gathered), np.array([v for k in members for v in (k, -k)], np.float32),
          f"all_gather_into on the shard group {members}")
    rep_members = [k * s_size + s_idx for k in range(2)]
    total = np.arange(4) * sum(k + 1 for k in rep_members)
    _same(_values(ctx, chunk), total[2 * r_idx:2 * r_idx + 2].astype(np.float32),
          f"reduce_scatter on the replicate group {rep_members}")
