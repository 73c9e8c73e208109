"""Conformance checks of the platform contract: the collective entry points (collectives.py),
their handles and results, the desync check they pass through, and CommStats.

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import time

import numpy as np

import hyper_parallel as hp
from hyper_parallel.collective_check import CollectiveCheck, CollectiveDesyncError
from hyper_parallel.platform import Handle
from tests.platform.conformance import (
    _arange, _check, _check_gathered, _f32, _same, _values, collective_check)


def _only(window, op, wire, dim, nbytes, what):
    """The CommStats window holds exactly one call of (op, wire, dim) with nbytes."""
    records = {key: (rec.calls, rec.nbytes) for key, rec in window.records.items()}
    expected = {(op, wire, dim): (1, nbytes)}
    _check(records == expected, f"{what}: CommStats recorded {records}, expected {expected}")


def _rank_input(rank: int, n: int) -> np.ndarray:
    """What rank ``rank`` sends: different on every rank, so rank-major order shows."""
    return ((np.arange(n) + 1) * (rank + 1) + 10 * rank).astype(np.float32)


def _waited(handle, what: str):
    """``handle.wait()``'s result, checked to be the handle's own and the same on a second
    wait (a sync call's handle included)."""
    _check(isinstance(handle, Handle), f"{what} returned {type(handle).__name__}, want a Handle")
    result = handle.wait()
    _check(handle.wait() is result, f"{what}: a second wait() returned another result")
    _check(handle.result is result, f"{what}: handle.result is not what wait() returned")
    return result


@collective_check()
def check_all_gather(ctx):
    """With ``out`` the gather lands in it and ``flat`` is it; without, the output is new
    memory. ``wait()`` of a sync call returns the result; the input is left as it was."""
    p, w, r, n = ctx.p, ctx.world, ctx.rank, 3
    group = ctx.mesh1.get_group(0)
    source = _f32(ctx, _rank_input(r, n))
    out = p.zeros((w * n,), p.dtype("float32"))
    with_out, without = p.all_gather(source, group, out=out), p.all_gather(source, group)
    results = {"all_gather(out=...)": _waited(with_out, "all_gather(out=...)"),
               "all_gather": _waited(without, "all_gather")}
    expected = [_rank_input(k, n) for k in range(w)]
    for what, gathered in results.items():
        _check_gathered(ctx, gathered, expected, what)
    _check(results["all_gather(out=...)"].flat is out, "all_gather(out=...): flat is not out")
    _same(_values(ctx, out), np.concatenate(expected), "all_gather(out=...): out (rank-major)")
    _same(_values(ctx, source), _rank_input(r, n), "all_gather changed its input")


@collective_check()
def check_all_gather_async(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    group = ctx.mesh1.get_group(0)
    out = p.zeros((w * 2,), p.dtype("float32"))
    with_out = p.all_gather(_f32(ctx, [r, -r]), group, async_op=True, out=out)
    without = p.all_gather(_f32(ctx, [-r, r]), group, async_op=True)
    _check(isinstance(with_out, Handle) and isinstance(without, Handle),
           f"async all_gather returned {type(with_out).__name__}, {type(without).__name__}")
    gathered = {"async all_gather": _waited(without, "async all_gather"),
                "async all_gather(out=...)": _waited(with_out, "async all_gather(out=...)")}
    _check_gathered(ctx, gathered["async all_gather(out=...)"],
                    [np.array([k, -k], np.float32) for k in range(w)], "async all_gather(out=...)")
    _check(gathered["async all_gather(out=...)"].flat is out,
           "async all_gather(out=...): flat is not out")
    _check_gathered(ctx, gathered["async all_gather"],
                    [np.array([-k, k], np.float32) for k in range(w)], "async all_gather")


@collective_check()
def check_all_gather_view_input(ctx):
    """The input may be a narrowed/reshaped read of a bigger tensor, gathered into ``out``
    or into new memory."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    group = ctx.mesh1.get_group(0)
    big = p.from_numpy(_arange(3, 4, start=100 * r))
    results = {}
    for row in (1, 0):
        source = p.reshape(p.narrow(big, 0, row, 1), (4,))
        out = p.zeros((w * 4,), p.dtype("float32"))
        results[row, "out"] = p.all_gather(source, group, out=out).wait()
        results[row, "new"] = p.all_gather(source, group).wait()
    for (row, how), gathered in results.items():
        _check_gathered(ctx, gathered, [_arange(3, 4, start=100 * k)[row] for k in range(w)],
                        f"all_gather ({how}) of row {row} (a narrow) of a (3, 4) tensor")


@collective_check()
def check_all_gather_result_owns_memory(ctx):
    """Without ``out`` the pieces are the collective's own memory, never the input's: a
    write to the input after the gather leaves them alone, and so does an in-place
    all_reduce of ``flat`` (where there is one) on the input."""
    p, w, r, n = ctx.p, ctx.world, ctx.rank, 3
    group = ctx.mesh1.get_group(0)
    expected = [_rank_input(k, n) for k in range(w)]
    for async_op in (False, True):
        source = _f32(ctx, _rank_input(r, n))
        gathered = p.all_gather(source, group, async_op=async_op).wait()
        p.copy_into(source, _f32(ctx, np.zeros(n)))
        _check_gathered(ctx, gathered, expected, f"all_gather (async_op={async_op}) after its "
                        "input was overwritten: a piece aliases the input")
        if gathered.flat is not None:
            p.all_reduce(gathered.flat, group).wait()
            _same(_values(ctx, gathered.flat), w * np.concatenate(expected),
                  f"all_reduce in place of an all_gather's flat (async_op={async_op})")
        _same(_values(ctx, source), np.zeros(n, np.float32), "the input after the write")


def _chunk_sizes(world: int) -> tuple:
    """Per-rank chunk lengths whose fp32 inputs fall on both sides of 1 MiB, where a
    platform may switch collective algorithms by size (torch on gloo does)."""
    return 3, (1 << 18) // world + 5


def _scatter_input(rank: int, world: int, n: int) -> np.ndarray:
    return np.arange(world * n, dtype=np.float32) * (rank + 1) + rank


def _scatter_total(world: int, n: int) -> np.ndarray:
    return sum(_scatter_input(q, world, n) for q in range(world))


@collective_check()
def check_reduce_scatter(ctx):
    """One tensor per rank (``pieces[q] = [t]``): this rank receives the SUM of everyone's
    ``pieces[rank]``, as ``wait()``'s result (a sync call too); the parts are unchanged."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    for n in _chunk_sizes(w):
        mine = _scatter_input(r, w, n)
        pieces = [[_f32(ctx, mine[q * n:(q + 1) * n])] for q in range(w)]
        chunk = _waited(p.reduce_scatter(pieces, ctx.mesh1.get_group(0)), "reduce_scatter")
        _same(_values(ctx, chunk), _scatter_total(w, n)[r * n:(r + 1) * n],
              f"reduce_scatter chunk of rank {r} (n={n})")
        for q, (part,) in enumerate(pieces):
            _same(_values(ctx, part), mine[q * n:(q + 1) * n], f"reduce_scatter changed the "
                  f"part for rank {q} (n={n})")


@collective_check()
def check_reduce_scatter_async(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    mine = _scatter_input(r, w, 2)
    handle = p.reduce_scatter([[_f32(ctx, mine[2 * q:2 * q + 2])] for q in range(w)],
                              ctx.mesh1.get_group(0), async_op=True)
    chunk = _waited(handle, "async reduce_scatter")
    _same(_values(ctx, chunk), _scatter_total(w, 2)[2 * r:2 * r + 2],
          "async reduce_scatter chunk after wait()")


@collective_check()
def check_reduce_scatter_view_input(ctx):
    """Parts may be reads of a bigger tensor: narrows at an offset or at 0 of a padded
    buffer, reshapes; the buffer is left as it was."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    group = ctx.mesh1.get_group(0)
    mine = _scatter_input(r, w, 2)
    padded_np = np.concatenate([np.full(3, 99, np.float32), mine, np.full(3, 99, np.float32)])
    padded, tail = p.from_numpy(padded_np), p.from_numpy(padded_np[3:])
    square = p.from_numpy(mine.reshape(w, 2))
    layouts = {
        "narrows at offset 3 of a padded buffer": [[p.narrow(padded, 0, 3 + 2 * q, 2)]
                                                   for q in range(w)],
        "narrows from 0 of a buffer with padding after": [[p.narrow(tail, 0, 2 * q, 2)]
                                                          for q in range(w)],
        "reshaped rows of a (W, 2) tensor": [[p.reshape(p.narrow(square, 0, q, 1), (2,))]
                                             for q in range(w)],
    }
    chunks = {how: p.reduce_scatter(pieces, group).wait() for how, pieces in layouts.items()}
    total = _scatter_total(w, 2)[2 * r:2 * r + 2]
    failures = {how: _values(ctx, c).tolist() for how, c in chunks.items()
                if not np.array_equal(_values(ctx, c), total)}
    _check(not failures, f"reduce_scatter is wrong for: {failures} (rank {r} expected {total})")
    _same(_values(ctx, padded), padded_np, "reduce_scatter changed the buffer its parts read")
    _same(_values(ctx, square), mine.reshape(w, 2), "reduce_scatter changed a reshaped part")


@collective_check()
def check_reduce_scatter_pieces(ctx):
    """Each rank's part given as views of one gradient, as one tensor, or as several parts
    (a view plus zeros, the padded case); the parts stay as they were and the result, scaled
    as the core scales it, is memory of its own: an in-place all_reduce of it lands, and a
    write to the gradient afterwards does not reach it."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    group = ctx.mesh1.get_group(0)
    # both sizes (both sides of a size switch, see above) in both modes; each mode is
    # scaled on one size and not on the other
    small, large = _chunk_sizes(w)
    for n, async_op, scale in ((small, False, 1.0), (small, True, 0.25),
                               (large, False, 0.25), (large, True, 1.0)):
        mine = _scatter_input(r, w, n)
        mine[-1] = 0.0  # the last rank's last element is padding: zero on every rank
        total = _scatter_total(w, n)
        total[-1] = 0.0
        total = total * np.float32(scale)  # a power of two: exact
        for how in ("views", "tensors", "parts"):
            whole = _f32(ctx, mine)
            pieces = {
                "views": lambda: [[p.narrow(whole, 0, q * n, n)] for q in range(w)],
                "tensors": lambda: [[_f32(ctx, mine[q * n:(q + 1) * n])] for q in range(w)],
                "parts": lambda: [[p.narrow(whole, 0, q * n, n - 1),
                                   _f32(ctx, mine[(q + 1) * n - 1:(q + 1) * n])]
                                  for q in range(w - 1)] + [[p.narrow(whole, 0, (w - 1) * n, n - 1),
                                                             p.zeros((1,), p.dtype("float32"))]],
            }[how]()
            before = [[_values(ctx, t) for t in parts] for parts in pieces]
            handle = p.reduce_scatter(pieces, group, async_op=async_op)
            what = f"({how}, n={n}, async_op={async_op}, scale={scale})"
            result = p.scale(_waited(handle, f"reduce_scatter {what}"), scale, may_overwrite=True)
            _same(_values(ctx, result), total[r * n:(r + 1) * n], f"reduce_scatter chunk {what}")
            for q, parts in enumerate(pieces):
                for t, old in zip(parts, before[q]):
                    _same(_values(ctx, t), old, f"reduce_scatter changed a part of rank {q} {what}")
            p.all_reduce(result, group)  # its own memory: the in-place write lands
            _same(_values(ctx, result), total.reshape(w, n).sum(0),
                  f"all_reduce of the reduce_scatter result {what}")
            _same(_values(ctx, whole), mine, f"reduce_scatter changed the gradient {what}")
            p.copy_into(whole, _f32(ctx, np.full(w * n, -1.0)))
            _same(_values(ctx, result), total.reshape(w, n).sum(0),
                  f"the reduce_scatter result aliases the gradient {what}")


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
        _check(_waited(p.all_reduce(t, group, op=op), f"all_reduce({op!r})") is t,
               f"all_reduce({op!r}).wait() is not the tensor reduced in place")
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
    _check(_waited(handle, "async all_reduce") is t,
           "async all_reduce: wait() is not the tensor reduced in place")
    s = w * (w - 1) / 2
    _same(_values(ctx, t), np.array([s, w, 2 * s], np.float32), "async all_reduce after wait()")


@collective_check()
def check_async_overlap(ctx):
    """Three collectives in flight at once (prefetch, reduction), waited in reverse order."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    group = ctx.mesh1.get_group(0)
    gathered = p.zeros((w,), p.dtype("float32"))
    first = p.all_gather(_f32(ctx, [r + 1]), group, async_op=True, out=gathered)
    second = p.reduce_scatter([[_f32(ctx, [q + r])] for q in range(w)], group, async_op=True)
    reduced = _f32(ctx, [1.0, r])
    third = p.all_reduce(reduced, group, op="max", async_op=True)
    third.wait()
    chunk = second.wait()
    first.wait()
    _same(_values(ctx, gathered), np.arange(1, w + 1, dtype=np.float32), "overlapped all_gather")
    _same(_values(ctx, chunk), [float(w * r + w * (w - 1) / 2)], "overlapped reduce_scatter")
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
def check_collectives_are_cross_checked(ctx):
    """Every entry point, barrier included, passes the desync check (HP_DEBUG=collectives)
    before it issues anything: one cross-check each, the check's own exchange neither
    counted nor checked; ranks about to issue different ones (a barrier against an
    all-reduce) all raise CollectiveDesyncError, none is left waiting."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    group = ctx.mesh1.get_group(0)
    previous, check = p.collective_check, CollectiveCheck(p)
    p.collective_check = check
    counted, outcome = {}, None
    try:
        calls = {
            "all_gather": lambda: p.all_gather(_f32(ctx, [r]), group).wait(),
            "reduce_scatter": lambda: p.reduce_scatter([[_f32(ctx, [1.0])]] * w, group).wait(),
            "all_reduce": lambda: p.all_reduce(_f32(ctx, [1.0]), group).wait(),
            "barrier": lambda: p.barrier(group),
        }
        for op, call in calls.items():
            before = check.checked
            with hp.track_comms() as window:
                call()
            counted[op] = (check.checked - before, window.calls())
        expected = {op: (1, 0 if op == "barrier" else 1) for op in calls}
        # every rank runs the same platform code, so every rank stops here alike
        _check(counted == expected, f"(cross-checks, CommStats calls) per entry point: "
               f"{counted}, expected {expected}")
        try:
            if r == 0:
                p.barrier()
            else:
                p.all_reduce(_f32(ctx, [1.0]), None)
        except CollectiveDesyncError as error:
            outcome = str(error)
    finally:
        p.collective_check = previous
    _check(outcome is not None, "a barrier on rank 0 against an all_reduce on the others "
           "raised no CollectiveDesyncError on this rank")
    _check("barrier" in outcome and "all_reduce" in outcome,
           f"the desync error does not name both collectives: {outcome}")
    p.barrier()  # every rank raised before issuing anything: the group still works


@collective_check()
def check_comm_stats(ctx):
    """op, wire (``COMPOSED_WIRE``) and bytes of each entry point, once per call, also where
    the platform composes the collective (bfloat16, a reduce-scatter over the world)."""
    p, w = ctx.p, ctx.world
    group = ctx.mesh1.get_group(0)
    _check(hp.comm_stats() is p.comm_stats, "hp.comm_stats() is not platform.comm_stats")
    f32, bf16 = p.dtype("float32"), p.dtype("bfloat16")
    windows = {}
    n = 5
    with hp.track_comms() as windows["all_gather"]:
        p.all_gather(p.zeros((n,), f32), group, out=p.zeros((w * n,), f32), dim="shard")
    with hp.track_comms() as windows["all_gather new"]:
        p.all_gather(p.zeros((n,), f32), group, dim="shard").wait()
    with hp.track_comms() as windows["all_gather bf16"]:
        p.all_gather(p.zeros((n,), bf16), group, async_op=True, dim="shard").wait()
    with hp.track_comms() as windows["reduce_scatter"]:
        p.reduce_scatter([[p.zeros((n - 1,), f32), p.zeros((1,), f32)]] * w, group, dim="shard")
    with hp.track_comms() as windows["reduce_scatter bf16"]:
        p.reduce_scatter([[p.zeros((n,), bf16)]] * w, group, async_op=True, dim="shard").wait()
    with hp.track_comms() as windows["all_reduce"]:
        p.all_reduce(p.zeros((n,), f32), group, op="avg", dim="replicate")
    with hp.track_comms() as windows["async"]:
        p.all_reduce(p.zeros((3,), f32), group, async_op=True).wait()
    with hp.track_comms() as windows["barrier"]:
        p.barrier(group)
    before = p.comm_stats.snapshot()
    with hp.track_comms() as windows["mixed"]:
        p.all_reduce(p.zeros((n,), f32), group)
        p.all_reduce(p.zeros((2 * n,), f32), group)
        p.all_gather(p.zeros((1,), f32), group, out=p.zeros((w,), f32))
    live_delta = p.comm_stats.minus(before)
    for key, op, dtype, dim, nbytes, what in (
            ("all_gather", "all_gather", "float32", "shard", 4 * w * n, "bytes = output"),
            ("all_gather new", "all_gather", "float32", "shard", 4 * w * n, "into new memory"),
            ("all_gather bf16", "all_gather", "bfloat16", "shard", 2 * w * n, "bfloat16, async"),
            ("reduce_scatter", "reduce_scatter", "float32", "shard", 4 * w * n,
             "bytes = input, two parts per rank"),
            ("reduce_scatter bf16", "reduce_scatter", "bfloat16", "shard", 2 * w * n,
             "bfloat16, async"),
            ("all_reduce", "all_reduce", "float32", "replicate", 4 * n, "op avg"),
            ("async", "all_reduce", "float32", "", 12, "async")):
        _only(windows[key], op, ctx.wire(op, dtype), dim, nbytes, f"{key} ({what})")
    _check(windows["barrier"].calls() == 0, f"a barrier moved no data but CommStats recorded "
           f"{windows['barrier'].summary()}")
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


def _routed(src: int, dst: int) -> np.ndarray:
    """What rank ``src`` sends rank ``dst`` in the all-to-all checks: (src + dst) % 3
    elements (some pairs none), each value naming its source, destination and index."""
    return (100 * src + 10 * dst + np.arange((src + dst) % 3)).astype(np.float32)


@collective_check()
def check_all_to_all(ctx):
    """Uneven and zero splits land in rank order, the input is left as it was, and CommStats
    counts the bytes that left this rank (its own slice stays)."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    group = ctx.mesh1.get_group(0)
    outgoing = np.concatenate([_routed(r, d) for d in range(w)])
    source = _f32(ctx, outgoing)
    with hp.track_comms() as window:
        received = _waited(p.all_to_all(source, [(r + d) % 3 for d in range(w)],
                                        [(s + r) % 3 for s in range(w)], group, dim="shard"),
                           "all_to_all")
    _same(_values(ctx, received), np.concatenate([_routed(s, r) for s in range(w)]),
          f"all_to_all result on rank {r}")
    _same(_values(ctx, source), outgoing, "all_to_all changed its input")
    _only(window, "all_to_all", ctx.wire("all_to_all"), "shard",
          4 * (outgoing.size - _routed(r, r).size), "all_to_all")
    try:
        p.all_to_all(source, [outgoing.size + 1] + [0] * (w - 1), [0] * w, group)
    except ValueError as error:
        _check("do not add up" in str(error), f"all_to_all's error on bad splits: {error}")
    else:
        raise AssertionError("all_to_all accepted splits that do not add up to its input")


@collective_check()
def check_send_recv(ctx):
    """Each rank sends to the next and the previous rank at once (both started before any
    wait: no rank waits on another), messages between a pair arrive in the order sent, the
    sender's bytes are counted, and a rank cannot be its own peer."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    group, f32 = ctx.mesh1.get_group(0), p.dtype("float32")
    forward, backward = _arange(2, 3, start=10 * r), _arange(2, 3, start=-10 * r)
    with hp.track_comms() as window:
        handles = [p.send(_f32(ctx, forward), (r + 1) % w, group, dim="shard"),
                   p.recv((2, 3), f32, (r - 1) % w, group, dim="shard"),
                   p.send(_f32(ctx, backward), (r - 1) % w, group, dim="shard"),
                   p.recv((2, 3), f32, (r + 1) % w, group, dim="shard")]
        results = [_waited(handle, "send/recv") for handle in handles]
    _same(_values(ctx, results[1]), _arange(2, 3, start=10 * ((r - 1) % w)),
          "recv from the previous rank")
    _same(_values(ctx, results[3]), _arange(2, 3, start=-10 * ((r + 1) % w)),
          "recv from the next rank")
    records = {key: (rec.calls, rec.nbytes) for key, rec in window.records.items()}
    _check(records == {("send", "send", "shard"): (2, 48)},
           f"send/recv: CommStats recorded {records}, expected two sends of 24 bytes")
    for peer in (r, w):
        try:
            p.send(_f32(ctx, forward), peer, group)
        except ValueError as error:
            _check("another rank of the group" in str(error), f"send's error: {error}")
        else:
            raise AssertionError(f"send to rank {peer} from rank {r} of {w} was accepted")
