"""Conformance checks of the platform contract: collectives, async handles and CommStats.

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import time

import numpy as np

import hyper_parallel as hp
from hyper_parallel.platform.base import Handle
from tests.platform.conformance import Skip, _arange, _check, _f32, _same, _values, collective_check


def _only(window, op, wire, dim, nbytes, what):
    """The CommStats window holds exactly one call of (op, wire, dim) with nbytes."""
    records = {key: (rec.calls, rec.nbytes) for key, rec in window.records.items()}
    expected = {(op, wire, dim): (1, nbytes)}
    _check(records == expected, f"{what}: CommStats recorded {records}, expected {expected}")


@collective_check()
def check_all_gather_into(ctx):
    p, w, r, n = ctx.p, ctx.world, ctx.rank, 3
    mine = (np.arange(n, dtype=np.float32) + 1) * (r + 1) + 10 * r  # different on every rank
    out = p.zeros((w * n,), p.dtype("float32"))
    handle = p.all_gather_into(out, _f32(ctx, mine), ctx.mesh1.get_group(0))
    _check(isinstance(handle, Handle), f"all_gather_into returned {type(handle).__name__}")
    handle.wait()
    expected = np.concatenate([(np.arange(n) + 1) * (k + 1) + 10 * k for k in range(w)])
    _same(_values(ctx, out), expected.astype(np.float32), "all_gather_into output (rank-major)")


@collective_check()
def check_all_gather_into_async(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    out = p.zeros((w * 2,), p.dtype("float32"))
    src = _f32(ctx, [r, -r])
    handle = p.all_gather_into(out, src, ctx.mesh1.get_group(0), async_op=True)
    _check(isinstance(handle, Handle), f"async all_gather_into returned {type(handle).__name__}")
    handle.wait()
    handle.wait()  # a second wait is harmless
    expected = np.array([v for k in range(w) for v in (k, -k)], np.float32)
    _same(_values(ctx, out), expected, "async all_gather_into output after wait()")


@collective_check()
def check_all_gather_into_view_input(ctx):
    """The input may be a narrowed/reshaped read of a bigger tensor."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    big = p.from_numpy(_arange(3, 4, start=100 * r))
    outs = {row: p.zeros((w * 4,), p.dtype("float32")) for row in (1, 0)}
    for row, out in outs.items():
        p.all_gather_into(out, p.reshape(p.narrow(big, 0, row, 1), (4,)), ctx.mesh1.get_group(0))
    for row, out in outs.items():
        expected = np.concatenate([_arange(3, 4, start=100 * k)[row] for k in range(w)])
        _same(_values(ctx, out), expected, f"all_gather_into of row {row} (a narrow) of a "
              "(3, 4) tensor")


def _chunk_sizes(world: int) -> tuple:
    """Per-rank chunk lengths whose fp32 inputs fall on both sides of 1 MiB, where a
    platform may switch collective algorithms by size (torch on gloo does)."""
    return 3, (1 << 18) // world + 5


@collective_check()
def check_reduce_scatter(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    for n in _chunk_sizes(w):
        k = np.arange(w * n, dtype=np.float32)
        mine = k * (r + 1) + r
        out = p.zeros((n,), p.dtype("float32"))
        handle = p.reduce_scatter(out, _f32(ctx, mine), ctx.mesh1.get_group(0))
        _check(isinstance(handle, Handle), f"reduce_scatter returned {type(handle).__name__}")
        handle.wait()
        total = k * (w * (w + 1) / 2) + w * (w - 1) / 2
        _same(_values(ctx, out), total[r * n:(r + 1) * n], f"reduce_scatter chunk of rank {r} (n={n})")


@collective_check()
def check_reduce_scatter_async(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    k = np.arange(w * 2, dtype=np.float32)
    out = p.zeros((2,), p.dtype("float32"))
    handle = p.reduce_scatter(out, _f32(ctx, k + r), ctx.mesh1.get_group(0), async_op=True)
    _check(isinstance(handle, Handle), f"async reduce_scatter returned {type(handle).__name__}")
    handle.wait()
    handle.wait()
    total = k * w + w * (w - 1) / 2
    _same(_values(ctx, out), total[2 * r:2 * r + 2], "async reduce_scatter chunk after wait()")


@collective_check()
def check_reduce_scatter_view_input(ctx):
    """The core passes reshape(cat(..)) as input; a narrowed read must work as well."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    k = _arange(w, 2)
    group = ctx.mesh1.get_group(0)
    outs = [p.zeros((2,), p.dtype("float32")) for _ in range(3)]
    p.reduce_scatter(outs[0], p.reshape(p.from_numpy(k + r), (2 * w,)), group)
    padded = np.concatenate([np.full(3, 99, np.float32), (k + r).reshape(-1),
                             np.full(3, 99, np.float32)])
    p.reduce_scatter(outs[1], p.narrow(p.from_numpy(padded), 0, 3, 2 * w), group)
    p.reduce_scatter(outs[2], p.narrow(p.from_numpy(padded[3:]), 0, 0, 2 * w), group)
    total = (k * w + w * (w - 1) / 2).reshape(-1)[2 * r:2 * r + 2]
    failures = [what for what, out in zip(
        ("a reshaped input", "narrow(buffer of 2W+6, 0, 3, 2W)", "narrow(buffer of 2W+3, 0, 0, 2W)"),
        outs) if not np.array_equal(_values(ctx, out), total)]
    _check(not failures, f"reduce_scatter is wrong for: {failures} (rank {r} expected {total}, "
           f"got {[_values(ctx, o).tolist() for o in outs]})")


@collective_check()
def check_all_gather_pieces(ctx):
    p, w, r, n = ctx.p, ctx.world, ctx.rank, 3
    mine = (np.arange(n, dtype=np.float32) + 1) * (r + 1) + 10 * r
    expected = [(np.arange(n) + 1) * (k + 1) + 10 * k for k in range(w)]
    for async_op in (False, True):
        source = _f32(ctx, mine)
        pieces, whole, handle = p.all_gather_pieces(source, ctx.mesh1.get_group(0), w,
                                                    async_op=async_op)
        _check(isinstance(handle, Handle), f"all_gather_pieces returned {type(handle).__name__}")
        handle.wait()
        _check(len(pieces) == w, f"all_gather_pieces gave {len(pieces)} pieces for {w} ranks")
        for k, piece in enumerate(pieces):
            _same(_values(ctx, piece), expected[k],
                  f"all_gather_pieces piece {k} (async_op={async_op})")
        if whole is not None:
            _same(_values(ctx, whole), np.concatenate(expected),
                  f"all_gather_pieces whole buffer (async_op={async_op})")
        p.copy_into(source, _f32(ctx, np.zeros(n)))
        _same(_values(ctx, pieces[r]), expected[r], "all_gather_pieces: a piece aliases the input")


@collective_check()
def check_all_gather_into_released(ctx):
    """The re-gather before backward: a full tensor autograd saved is released, then
    gathered into in place (sync and async); backward sees the gathered values and
    autograd does not complain about the write. Padded: the full tensor is a prefix of
    the gathered rows (the last rank's row is padding). With ``start``: the full tensor
    begins one row into the gathered buffer (another tensor's row before it), and
    ``handle.result`` is the whole buffer."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    if not p.capabilities.can_release_storage:
        raise Skip(f"{p.name}: can_release_storage is False")
    rows = np.stack([_arange(3, start=10 * k) for k in range(w)])   # rank k's row
    cases = [(async_op, kept, 0) for async_op in (False, True) for kept in (w, w - 1)]
    cases += [(async_op, w - 1, 1) for async_op in (False, True)]
    for async_op, kept, first in cases:
        gathered = []
        coef = _arange(kept, 3) * 0.1 + 1

        def loss_fn(inputs):
            buffer = p.zeros((w, 3), p.dtype("float32"))
            full = p.narrow(buffer, 0, first, kept)
            product = inputs[0] * full  # autograd saves ``full`` for the gradient of inputs[0]

            def before_backward():
                handle = p.all_gather_into_released(full, _f32(ctx, rows[r]),
                                                    ctx.mesh1.get_group(0), w, async_op=async_op,
                                                    start=3 * first)
                _check(isinstance(handle, Handle),
                       f"all_gather_into_released returned {type(handle).__name__}")
                handle.wait()
                gathered.append((_values(ctx, full), _values(ctx, handle.result)))
            p.register_grad_hook(product, before_backward)
            p.release_storage(full)
            return ctx.side.weighted_sum(product, coef)

        _, (grad,), _ = ctx.side.backward(loss_fn, [np.ones((kept, 3), np.float32)])
        how = f"(async_op={async_op}, {kept} of {w} rows from row {first})"
        _check(len(gathered) == 1, f"grad hook ran {len(gathered)} times {how}")
        _same(gathered[0][0], rows[first:first + kept], f"all_gather_into_released values {how}")
        _same(gathered[0][1], rows.reshape(-1), f"all_gather_into_released handle.result {how}")
        _same(grad, rows[first:first + kept] * coef,
              f"gradient through a tensor gathered in place {how}", tol=1e-6)


@collective_check()
def check_reduce_scatter_pieces(ctx):
    """Each rank's part of the input given as views of one gradient, as one tensor, or as
    several parts (a view plus zeros, the padded case); the parts stay as they were and
    the result, multiplied by ``scale``, is memory of its own."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    # both sizes (both sides of a size switch, see above) in both modes; each mode is
    # scaled on one size and not on the other
    small, large = _chunk_sizes(w)
    for n, async_op, scale in ((small, False, 1.0), (small, True, 0.25),
                               (large, False, 0.25), (large, True, 1.0)):
        k = np.arange(w * n, dtype=np.float32)
        mine = k * (r + 1) + r
        mine[-1] = 0.0  # the last rank's last element is padding: zero on every rank
        total = sum(k * (q + 1) + q for q in range(w))
        total[-1] = 0.0
        total = total * np.float32(scale)  # a power of two: exact
        whole = _f32(ctx, mine)
        layouts = {
            "views": [[p.narrow(whole, 0, q * n, n)] for q in range(w)],
            "tensors": [[_f32(ctx, mine[q * n:(q + 1) * n])] for q in range(w)],
            "parts": [[p.narrow(whole, 0, q * n, n - 1), _f32(ctx, mine[(q + 1) * n - 1:(q + 1) * n])]
                      for q in range(w - 1)] + [[p.narrow(whole, 0, (w - 1) * n, n - 1),
                                                 p.zeros((1,), p.dtype("float32"))]],
        }
        for how, pieces in layouts.items():
            before = [[_values(ctx, t) for t in parts] for parts in pieces]
            handle = p.reduce_scatter_pieces(pieces, ctx.mesh1.get_group(0), async_op=async_op)
            _check(isinstance(handle, Handle),
                   f"reduce_scatter_pieces returned {type(handle).__name__}")
            handle.wait()
            # scaled as the core scales it: in place where the platform can (its own memory)
            result = p.scale(handle.result, scale, may_overwrite=True)
            what = f"({how}, n={n}, async_op={async_op}, scale={scale})"
            _same(_values(ctx, result), total[r * n:(r + 1) * n],
                  f"reduce_scatter_pieces chunk {what}")
            for q, parts in enumerate(pieces):
                for t, old in zip(parts, before[q]):
                    _same(_values(ctx, t), old, f"reduce_scatter_pieces changed a part of rank {q} {what}")
            p.all_reduce(result, ctx.mesh1.get_group(0))  # its own memory
            _same(_values(ctx, result), total.reshape(w, n).sum(0),
                  f"all_reduce of the reduce_scatter_pieces result {what}")
            _same(_values(ctx, whole), mine, f"reduce_scatter_pieces changed the gradient {what}")


@collective_check()
def check_reduce_scatter_new(ctx):
    p, w, r, n = ctx.p, ctx.world, ctx.rank, 3
    k = np.arange(w * n, dtype=np.float32)
    mine = k * (r + 1) + r
    total = sum(k * (q + 1) + q for q in range(w))
    for (async_op, overwrite), scale in zip(((False, False), (True, False), (False, True), (True, True)),
                                            (1.0, 0.5, 0.25, 1.0)):
        source = p.cat([_f32(ctx, mine)], 0)  # a tensor of the caller's own
        handle = p.reduce_scatter_new(source, ctx.mesh1.get_group(0), w, async_op=async_op,
                                      may_overwrite_input=overwrite)
        _check(isinstance(handle, Handle), f"reduce_scatter_new returned {type(handle).__name__}")
        handle.wait()
        out = p.scale(handle.result, scale, may_overwrite=True)  # as the core scales it
        how = f"(async_op={async_op}, may_overwrite_input={overwrite}, scale={scale})"
        expected = total * np.float32(scale)  # a power of two: exact
        _same(_values(ctx, out), expected[r * n:(r + 1) * n], f"reduce_scatter_new chunk {how}")
        if not overwrite:
            _same(_values(ctx, source), mine, f"reduce_scatter_new changed its input {how}")
        p.all_reduce(out, ctx.mesh1.get_group(0))  # its own memory: an in-place write lands
        _same(_values(ctx, out), expected.reshape(w, n).sum(0),
              f"all_reduce of the reduce_scatter_new result {how}")


@collective_check()
def check_reduce_scatter_leaves_input(ctx):
    """Only the output buffer is written (Platform's note: the collectives' output buffers
    are the only writes besides copy_into and release/restore)."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    mine = _arange(2 * w, start=r)
    source = p.from_numpy(mine)
    p.reduce_scatter(p.zeros((2,), p.dtype("float32")), source, ctx.mesh1.get_group(0))
    _same(_values(ctx, source), mine, "reduce_scatter changed its input")


@collective_check()
def check_all_reduce_ops(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    group = ctx.mesh1.get_group(0)

    def values(k):
        return np.array([k + 1, -(k + 1), (7 * k) % 5, 0.5 * k, 3.0], np.float32)
    every = np.stack([values(k) for k in range(w)])
    expected = {"sum": every.sum(0), "avg": every.sum(0) / w, "max": every.max(0),
                "min": every.min(0)}
    got = {}
    for op in expected:
        t = _f32(ctx, values(r))
        handle = p.all_reduce(t, group, op=op)
        _check(isinstance(handle, Handle), f"all_reduce returned {type(handle).__name__}")
        handle.wait()
        got[op] = _values(ctx, t)
    default = _f32(ctx, values(r))
    p.all_reduce(default, group)
    for op, value in expected.items():
        _same(got[op], value, f"all_reduce op={op!r}", tol=1e-6)
    _same(_values(ctx, default), expected["sum"], "all_reduce default op is sum", tol=1e-6)


@collective_check()
def check_all_reduce_async(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    t = _f32(ctx, [r, 1.0, 2.0 * r])
    handle = p.all_reduce(t, ctx.mesh1.get_group(0), op="sum", async_op=True)
    _check(isinstance(handle, Handle), f"async all_reduce returned {type(handle).__name__}")
    handle.wait()
    handle.wait()
    s = w * (w - 1) / 2
    _same(_values(ctx, t), np.array([s, w, 2 * s], np.float32), "async all_reduce after wait()")


@collective_check()
def check_async_overlap(ctx):
    """Two collectives in flight at once (prefetch), waited in the reverse order."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    group = ctx.mesh1.get_group(0)
    gathered = p.zeros((w,), p.dtype("float32"))
    first = p.all_gather_into(gathered, _f32(ctx, [r + 1]), group, async_op=True)
    reduced = _f32(ctx, [1.0, r])
    second = p.all_reduce(reduced, group, op="max", async_op=True)
    second.wait()
    first.wait()
    _same(_values(ctx, gathered), np.arange(1, w + 1, dtype=np.float32), "overlapped all_gather")
    _same(_values(ctx, reduced), np.array([1.0, w - 1], np.float32), "overlapped all_reduce")


@collective_check()
def check_barrier(ctx):
    """barrier() blocks until the last rank arrives (the last rank comes 0.6 s late)."""
    p = ctx.p
    p.barrier()
    if ctx.rank == ctx.world - 1:
        time.sleep(0.6)
    start = time.perf_counter()
    p.barrier(ctx.mesh1.get_group(0))
    waited = time.perf_counter() - start
    p.barrier()
    if ctx.rank != ctx.world - 1:
        _check(waited > 0.3, f"barrier returned after {waited:.3f} s although the last rank "
               "arrived 0.6 s later: it does not block")


@collective_check()
def check_comm_stats(ctx):
    p, w = ctx.p, ctx.world
    group = ctx.mesh1.get_group(0)
    _check(hp.comm_stats() is p.comm_stats, "hp.comm_stats() is not platform.comm_stats")
    windows = {}
    n = 5
    with hp.track_comms() as windows["all_gather"]:
        p.all_gather_into(p.zeros((w * n,), p.dtype("float32")), p.zeros((n,), p.dtype("float32")),
                          group, dim="shard")
    with hp.track_comms() as windows["reduce_scatter"]:
        p.reduce_scatter(p.zeros((n,), p.dtype("float32")), p.zeros((w * n,), p.dtype("float32")),
                         group, dim="shard")
    with hp.track_comms() as windows["all_reduce"]:
        p.all_reduce(p.zeros((n,), p.dtype("float32")), group, op="avg", dim="replicate")
    with hp.track_comms() as windows["async"]:
        h = p.all_reduce(p.zeros((3,), p.dtype("float32")), group, async_op=True)
        h.wait()
    before = p.comm_stats.snapshot()
    with hp.track_comms() as windows["mixed"]:
        p.all_reduce(p.zeros((n,), p.dtype("float32")), group)
        p.all_reduce(p.zeros((2 * n,), p.dtype("float32")), group)
        p.all_gather_into(p.zeros((w,), p.dtype("float32")), p.zeros((1,), p.dtype("float32")),
                          group)
    live_delta = p.comm_stats.minus(before)
    _only(windows["all_gather"], "all_gather", ctx.wire("all_gather"), "shard", 4 * w * n,
          "all_gather (bytes = output)")
    _only(windows["reduce_scatter"], "reduce_scatter", ctx.wire("reduce_scatter"), "shard",
          4 * w * n, "reduce_scatter (bytes = input)")
    _only(windows["all_reduce"], "all_reduce", "all_reduce", "replicate", 4 * n, "all_reduce")
    _only(windows["async"], "all_reduce", "all_reduce", "", 12, "async all_reduce")
    mixed = windows["mixed"]
    _check(mixed.calls("all_reduce") == 2 and mixed.nbytes("all_reduce") == 12 * n,
           f"track_comms window: all_reduce {mixed.calls('all_reduce')} calls, "
           f"{mixed.nbytes('all_reduce')} bytes; expected 2 and {12 * n}")
    _check(mixed.calls("all_gather", wire=ctx.wire("all_gather")) == 1
           and mixed.nbytes("all_gather") == 4 * w,
           f"track_comms window all_gather: {mixed.summary()}")
    _check(mixed.calls() == 3, f"track_comms window counts {mixed.calls()} calls, expected 3")
    _check(live_delta.summary() == mixed.summary(),
           f"live comm_stats delta {live_delta.summary()} != window {mixed.summary()}")
