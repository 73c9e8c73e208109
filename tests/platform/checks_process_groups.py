"""Conformance checks of the platform contract: process groups and meshes (1-D and 2-D).

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from hyper_parallel.platform.base import Platform
from tests.platform.conformance import (
    _check, _check_gathered, _f32, _same, _values, collective_check, local_check)


@collective_check()
def check_process_group(ctx):
    """rank() and world_size() are the default group's (group None), distinct on every
    rank; the device is the capabilities' one."""
    p = ctx.p
    ranks = p.all_gather(_f32(ctx, [ctx.rank]), ctx.mesh1.get_group(0)).wait().pieces
    _check(p.is_initialized() is True, "is_initialized() is not True inside a launch")
    _check(0 <= ctx.rank < ctx.world, f"rank() {ctx.rank} outside world_size() {ctx.world}")
    _check((p.group_rank(None), p.group_size(None)) == (ctx.rank, ctx.world),
           f"(group_rank(None), group_size(None)) = {(p.group_rank(None), p.group_size(None))}"
           f", but (rank(), world_size()) = {(ctx.rank, ctx.world)}")
    _same(np.concatenate([_values(ctx, piece) for piece in ranks]),
          np.arange(ctx.world, dtype=np.float32), "every rank reports a distinct rank()")
    device = p.capabilities.device_type
    _check(device in ("cpu", "cuda", "npu"), f"capabilities.device_type = {device!r}")
    _check(p.device_type() == device, f"device_type() = {p.device_type()!r}, but "
           f"capabilities.device_type = {device!r}")


@collective_check()
def check_default_group(ctx):
    """group None is every rank, for the collectives too."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    reduced = _f32(ctx, [float(r), 1.0])
    p.all_reduce(reduced, None)
    gathered = p.all_gather(_f32(ctx, [float(r)]), None).wait()
    chunk = p.reduce_scatter([[_f32(ctx, [10.0 * q + r + 1])] for q in range(w)], None).wait()
    p.barrier(None)
    s = w * (w - 1) / 2
    _same(_values(ctx, reduced), [s, float(w)], "all_reduce over group None")
    _same(np.concatenate([_values(ctx, piece) for piece in gathered.pieces]),
          np.arange(w, dtype=np.float32), "all_gather over group None")
    _same(_values(ctx, chunk), [10.0 * w * r + s + w], "reduce_scatter over group None")


@local_check
def check_option_from_native(ctx):
    """Only the framework's own fully_shard option objects convert, field for field;
    hyper_parallel's and look-alikes with the same field names are not taken for them."""
    p = ctx.p

    class LookAlike:
        param_dtype, reduce_dtype, pin_memory, shard, replicate = None, None, True, "dp", None

    ours = (hp.MixedPrecisionPolicy(), hp.CPUOffloadPolicy(), hp.DataParallelMeshDims(shard="dp"))
    for other in (object(), LookAlike(), *ours):
        _check(p.option_from_native(other) is None,
               f"option_from_native({type(other).__name__}) is not None")
    for native, name, expected in getattr(ctx.side, "native_options", list)():
        described = p.option_from_native(native)
        _check(described is not None, f"option_from_native({name}) is None")
        got_name, fields = described
        _check(got_name == name, f"option_from_native({name}) names {got_name!r}")
        wrong = {k: fields.get(k) for k, v in expected.items() if fields.get(k) != v}
        _check(not wrong, f"option_from_native({name}) fields {wrong}, expected {expected}")


@collective_check()
def check_mesh_1d_groups(ctx):
    p = ctx.p
    group = ctx.mesh1.get_group(0)
    _check(p.group_size(group) == ctx.world, f"group_size(world mesh group) {p.group_size(group)}")
    _check(p.group_rank(group) == ctx.rank, f"group_rank(world mesh group) {p.group_rank(group)}")
    _check(ctx.mesh1.get_local_rank(0) == ctx.rank, "mesh.get_local_rank(0)")
    native = ctx.mesh1.native
    _check(p.mesh_from_native(object()) is None, "mesh_from_native(not a mesh) is not None")
    # what shard_placement_fn returns most often: a dim, or nothing to convert
    _check(p.shard_placement_from_native(1) is None,
           "shard_placement_from_native(a dim) is not None")
    if native is not None:
        described = p.mesh_from_native(native)
        _check(described is not None, "mesh_from_native(the mesh's own native mesh) is None")
        shape, names, groups = described.shape, described.dim_names, described.groups
        device, grid = described.device_type, described.rank_grid
        _check(tuple(shape) == (ctx.world,) and tuple(names) == ("shard",),
               f"mesh_from_native: shape {shape}, names {names}")
        _check(device == p.capabilities.device_type, f"mesh_from_native device {device}")
        _check(list(grid) == list(range(ctx.world)), f"mesh_from_native rank grid {grid}")
        _check(p.group_size(groups[0]) == ctx.world, "mesh_from_native group size")


def _mesh_shapes(w: int) -> list:
    shapes = [((w,), ("a",)), ((1, w), ("one", "all"))]
    return shapes + ([((2, w // 2), ("rep", "shard"))] if w >= 4 and w % 2 == 0 else [])


def _check_mesh_groups(ctx, made: dict, how: str) -> None:
    """Each dim's group has the dim's size, this rank's coordinate as its rank, and an
    all_reduce over it sums exactly that line of the rank grid."""
    p = ctx.p
    probes = {}
    for shape, (groups, _) in made.items():
        _check(len(groups) == len(shape), f"{how}{shape}: {len(groups)} groups")
        for dim, group in enumerate(groups):
            if shape[dim] > 1:  # the core issues no collective over a single rank
                probes[shape, dim] = _f32(ctx, [10.0 ** ctx.rank])
                p.all_reduce(probes[shape, dim], group)
    for shape, (groups, _) in made.items():
        grid = np.arange(ctx.world).reshape(shape)
        coords = np.argwhere(grid == ctx.rank)[0]
        for dim, group in enumerate(groups):
            line = np.moveaxis(grid, dim, -1)[tuple(np.delete(coords, dim))]
            got = (p.group_size(group), p.group_rank(group))
            _check(got == (shape[dim], int(coords[dim])), f"{how}{shape} dim {dim}: "
                   f"(group_size, group_rank) {got}, expected {(shape[dim], int(coords[dim]))}")
            if (shape, dim) in probes:
                _same(_values(ctx, probes[shape, dim]), [float(sum(10.0 ** k for k in line))],
                      f"{how}{shape}: all_reduce along dim {dim} (ranks {line.tolist()})")


@collective_check()
def check_new_mesh_groups(ctx):
    """Direct call (hp.init_device_mesh wraps it): one group per dim; a size-1 dim too."""
    p = ctx.p
    device = p.capabilities.device_type
    made = {shape: p.new_mesh_groups(device, shape, names) for shape, names in _mesh_shapes(ctx.world)}
    _check_mesh_groups(ctx, made, "new_mesh_groups")
    for shape, (_, native) in made.items():
        if native is not None:
            described = p.mesh_from_native(native)
            _check(described is not None and tuple(described.shape) == shape,
                   f"mesh_from_native(new_mesh_groups{shape} native) = {described}")


@collective_check()
def check_default_new_mesh_groups(ctx):
    """The base class's new_mesh_groups (every line of the rank grid a new_group, no native
    mesh) is right on every platform, also one that overrides it (torch)."""
    p = ctx.p
    device = p.capabilities.device_type
    made = {shape: Platform.new_mesh_groups(p, device, shape, names)
            for shape, names in _mesh_shapes(ctx.world)}
    _check(all(native is None for _, native in made.values()),
           "the default new_mesh_groups made a native mesh")
    _check_mesh_groups(ctx, made, "Platform.new_mesh_groups")


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
    native = p.mesh_from_groups(p.capabilities.device_type, [mine], peers, ("dp",))
    if native is not None:
        described = p.mesh_from_native(native)
        _check(described is not None and list(described.rank_grid) == peers,
               f"mesh_from_groups over {peers}: described as {described}")


@collective_check()
def check_distinct_new_group(ctx):
    """``new_group(every rank, distinct=True)`` is a communicator of its own, not the default
    group (set_separate_reduce_scatter_group reduces over it), and works as one."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    everyone = list(range(w))
    group = p.new_group(everyone, distinct=True)
    _check(group is not p.new_group(everyone), "new_group(every rank, distinct=True) is the "
                                                "default group")
    _check(p.group_size(group) == w and p.group_rank(group) == r,
           f"new_group({everyone}, distinct=True): size {p.group_size(group)}, "
           f"rank {p.group_rank(group)}")
    probe = _f32(ctx, [float(r)])
    p.all_reduce(probe, group)
    _same(_values(ctx, probe), [float(sum(everyone))], "all_reduce over a distinct group")


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
    with hp.track_comms() as window:
        gathered = p.all_gather(_f32(ctx, [ctx.rank, -ctx.rank]), shard, dim="shard").wait()
        chunk = p.reduce_scatter([[_f32(ctx, np.arange(2 * k, 2 * k + 2) * (ctx.rank + 1))]
                                  for k in range(2)], rep, dim="replicate").wait()
    members = [r_idx * s_size + j for j in range(s_size)]
    _check_gathered(ctx, gathered, [np.array([k, -k], np.float32) for k in members],
                    f"all_gather on the shard group {members}")
    rep_members = [k * s_size + s_idx for k in range(2)]
    total = np.arange(4) * sum(k + 1 for k in rep_members)
    _same(_values(ctx, chunk), total[2 * r_idx:2 * r_idx + 2].astype(np.float32),
          f"reduce_scatter on the replicate group {rep_members}")
    expected = {("all_gather", ctx.wire("all_gather", group=shard), "shard"): (1, 4 * 2 * s_size),
                ("reduce_scatter", ctx.wire("reduce_scatter", group=rep), "replicate"): (1, 16)}
    records = {key: (rec.calls, rec.nbytes) for key, rec in window.records.items()}
    _check(records == expected, f"CommStats of collectives over sub-groups: {records}, "
           f"expected {expected}")
