"""Conformance checks of the platform contract: explicit writes, the optional
``StorageRelease`` part (release, restore, ``copy_into_slice``, ``restored_flat`` and the
re-gather into it, kept memory), grad mode.

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import numpy as np

from hyper_parallel.platform import Gathered
from tests.platform.conformance import (
    DTYPE_SIZES, Skip, _arange, _check, _f32, _same, _storage_bytes, _values, collective_check,
    local_check)


def _releases(ctx) -> None:
    """Skip unless the platform implements StorageRelease (``can_release_storage``)."""
    if not ctx.p.capabilities.can_release_storage:
        raise Skip(f"{ctx.p.name}: can_release_storage is False (no StorageRelease)")


def _writes_in_place(ctx) -> None:
    """Skip unless the core writes into parts of a released full parameter
    (``copy_into_slice``, ``restored_flat``), which it does only where kernels read views
    (``kernels_read_views``)."""
    _releases(ctx)
    if not ctx.p.capabilities.kernels_read_views:
        raise Skip(f"{ctx.p.name}: kernels_read_views is False (full parameters own their "
                   f"memory and are refilled whole)")


@local_check
def check_copy_into(ctx):
    p = ctx.p
    for shape, name in (((6,), "float32"), ((2, 3), "float32"), ((4,), "float16"),
                        ((3,), "int64")):
        src_np = (np.arange(int(np.prod(shape))) + 1).reshape(shape).astype(name)
        dst, src = p.zeros(shape, p.dtype(name)), p.from_numpy(src_np)
        p.copy_into(dst, src)
        _same(p.to_numpy(dst), src_np, f"copy_into {name}{shape}: dst read back")
        _same(p.to_numpy(src), src_np, f"copy_into {name}{shape} changed src")
        p.copy_into(src, p.from_numpy(np.zeros(shape, name)))
        _same(p.to_numpy(dst), src_np, f"copy_into {name}{shape} made dst alias src")
    param = ctx.side.new_param(np.zeros(3, np.float32), "conf_copy_into")
    p.copy_into(param, _f32(ctx, [7, 8, 9]))
    _same(_values(ctx, param), np.array([7, 8, 9], np.float32), "copy_into a Parameter")


@local_check
def check_copy_into_from_view(ctx):
    """``src`` may be any read: a narrow (at offset 0 or not), a movedim, their contiguous()."""
    p = ctx.p
    base = _arange(10)
    src = p.from_numpy(base)
    failures = []
    for start in (4, 0):
        for how, make in (("narrow", lambda: p.narrow(src, 0, start, 4)),
                          ("contiguous(narrow)", lambda: p.contiguous(p.narrow(src, 0, start, 4)))):
            dst = p.zeros((4,), p.dtype("float32"))
            try:
                p.copy_into(dst, make())
                _same(_values(ctx, dst), base[start:start + 4], "")
            except Exception as error:  # noqa: BLE001 - collect every failing form
                failures.append(f"copy_into(dst, {how}(src of 10, dim 0, start {start}, "
                                f"length 4)): {type(error).__name__}: "
                                f"{str(error).strip().splitlines()[0]}")
    for how, make in (("movedim", lambda m: p.movedim(m, 0, 1)),
                      ("contiguous(movedim)", lambda m: p.contiguous(p.movedim(m, 0, 1)))):
        dst = p.zeros((3, 2), p.dtype("float32"))
        try:
            p.copy_into(dst, make(p.from_numpy(_arange(2, 3))))
            _same(_values(ctx, dst), _arange(2, 3).T, "")
        except Exception as error:  # noqa: BLE001
            failures.append(f"copy_into(dst, {how}): {type(error).__name__}: "
                            f"{str(error).strip().splitlines()[0]}")
    _check(not failures, "copy_into from a read of another tensor failed:\n  "
           + "\n  ".join(failures))


@local_check
def check_copy_into_slice(ctx):
    """Every dim, at the start, the middle and the end, from a contiguous or strided read;
    the rest of ``dst`` keeps its values and ``src`` is not aliased."""
    _writes_in_place(ctx)
    p = ctx.p
    base = _arange(4, 6)
    for dim, start, length in ((0, 0, 2), (0, 1, 2), (0, 3, 1), (1, 0, 6), (1, 2, 3), (1, 5, 1)):
        shape = list(base.shape)
        shape[dim] = length
        src_np = -1 - _arange(*shape)
        for how, src in (("dense", p.from_numpy(src_np)),
                         ("movedim", p.movedim(p.from_numpy(np.ascontiguousarray(
                             np.moveaxis(src_np, 1, 0))), 0, 1))):
            dst = p.from_numpy(base)
            p.copy_into_slice(dst, dim, start, src)
            expected = base.copy()
            index = [slice(None)] * 2
            index[dim] = slice(start, start + length)
            expected[tuple(index)] = src_np
            _same(_values(ctx, dst), expected,
                  f"copy_into_slice(dim {dim}, start {start}, length {length}, {how} src)")
            p.copy_into(src, p.from_numpy(np.zeros(shape, np.float32)))
            _same(_values(ctx, dst), expected,
                  f"copy_into_slice(dim {dim}, start {start}) made dst alias src")
    param = ctx.side.new_param(np.zeros((3, 2), np.float32), "conf_copy_into_slice")
    p.copy_into_slice(param, 0, 1, _f32(ctx, [[7, 8]]))
    _same(_values(ctx, param), np.array([[0, 0], [7, 8], [0, 0]], np.float32),
          "copy_into_slice of a Parameter")


@local_check
def check_storage_bytes(ctx):
    p = ctx.p
    for name in ("float32", "float16", "int64"):
        t = p.zeros((3, 5), p.dtype(name))
        expected = 15 * DTYPE_SIZES[name]
        _check(_storage_bytes(t) == expected,
               f"storage_bytes of zeros((3, 5), {name}) = {_storage_bytes(t)}, want {expected}")


@local_check
def check_release_restore_storage(ctx):
    p = ctx.p
    _releases(ctx)
    for how, t in (("zeros", p.zeros((3, 4), p.dtype("float32"))),
                   ("add", p.add(p.zeros((3, 4), p.dtype("float32")), p.zeros((3, 4), p.dtype("float32")))),
                   ("cat", p.cat([p.zeros((1, 4), p.dtype("float32")), p.zeros((2, 4), p.dtype("float32"))]))):
        p.release_storage(t)
        _check(_storage_bytes(t) == 0, f"{how}: after release_storage, storage_bytes "
               f"{_storage_bytes(t)}")
        _check(p.shape(t) == (3, 4), f"{how}: release_storage changed the shape to {p.shape(t)}")
        p.release_storage(t)  # releasing twice is harmless
        p.restore_storage(t)
        _check(_storage_bytes(t) == 48, f"{how}: after restore_storage, storage_bytes "
               f"{_storage_bytes(t)}")
        p.restore_storage(t)  # restoring twice is harmless
        _check(_storage_bytes(t) == 48, f"{how}: after a second restore, storage_bytes "
               f"{_storage_bytes(t)}")
        p.copy_into(t, p.from_numpy(_arange(3, 4, start=5)))
        _same(_values(ctx, t), _arange(3, 4, start=5), f"{how}: values after restore + copy_into")


@local_check
def check_release_restore_shared_buffer(ctx):
    """Full parameters may be reads of one gathered buffer at different offsets: releasing
    and restoring each, then refilling each, gives every one its values."""
    p = ctx.p
    _releases(ctx)
    buffer = p.zeros((10,), p.dtype("float32"))
    first = p.contiguous(p.narrow(buffer, 0, 0, 4))
    second = p.contiguous(p.reshape(p.narrow(buffer, 0, 4, 6), (2, 3)))
    for t in (first, second):
        p.release_storage(t)
    _check(_storage_bytes(first) == 0 and _storage_bytes(second) == 0,
           "release_storage of reads of one buffer did not free it")
    for t in (first, second):
        p.restore_storage(t)
    p.copy_into(first, p.from_numpy(_arange(4, start=1)))
    p.copy_into(second, p.from_numpy(_arange(2, 3, start=-6)))
    _same(_values(ctx, first), _arange(4, start=1), "first read after restore + copy_into")
    _same(_values(ctx, second), _arange(2, 3, start=-6), "second read (at offset 4) after "
          "restore + copy_into")


@local_check
def check_release_storage_of_from_numpy(ctx):
    """Every tensor the platform makes can be released, from_numpy's too."""
    p = ctx.p
    _releases(ctx)
    t = p.from_numpy(_arange(3, 4))
    p.release_storage(t)
    _check(_storage_bytes(t) == 0, f"after release_storage: storage_bytes {_storage_bytes(t)}")
    p.restore_storage(t)
    p.copy_into(t, p.from_numpy(_arange(3, 4, start=5)))
    _same(_values(ctx, t), _arange(3, 4, start=5), "values after restore + copy_into")


@local_check
def check_kept_released_memory_is_never_shared(ctx):
    """Memory ``keep_released_memory`` lets a platform keep goes to one tensor at a time:
    released tensors restored and new ``empty`` tensors of the same size (which a pool
    would serve from kept blocks) each hold their own values, and a view of a released
    tensor reads what the restored tensor is refilled with."""
    p = ctx.p
    _releases(ctx)
    f32 = p.dtype("float32")
    p.keep_released_memory(1 << 20)
    first, second = p.zeros((8, 16), f32), p.zeros((8, 16), f32)
    view = p.narrow(second, 0, 2, 3)
    p.release_storage(first)
    p.release_storage(second)
    fresh = [p.empty((8, 16), f32), p.empty((128,), f32)]  # same bytes as the released two
    p.restore_storage(second)
    p.restore_storage(first)
    later = p.empty((8, 16), f32)
    tensors = [first, second, *fresh, later]
    for k, t in enumerate(tensors):
        p.copy_into(t, p.from_numpy(_arange(*p.shape(t), start=1000.0 * k)))
    for k, t in enumerate(tensors):
        _same(_values(ctx, t), _arange(*p.shape(t), start=1000.0 * k),
              f"tensor {k} of {len(tensors)} (released+restored or new) lost its values: "
              "two tensors share memory")
    _same(_values(ctx, view), _arange(8, 16, start=1000.0)[2:5],
          "a view of a released tensor does not read it after restore + refill")


@local_check
def check_release_restore_under_autograd(ctx):
    """FSDP2's reshard-after-forward: a tensor autograd saved is released after forward,
    restored and refilled (in a grad hook) before backward uses it; the gradient sees the
    refilled values and autograd does not complain."""
    p = ctx.p
    _releases(ctx)
    weights = _arange(2, 3, start=1)
    refill = _arange(2, 3, start=-4) * 0.5
    coef = _arange(2, 3) * 0.1 + 1
    refilled = []

    def loss_fn(inputs):
        full = p.zeros((2, 3), p.dtype("float32"))
        with p.no_grad():
            p.copy_into(full, p.from_numpy(weights))
        product = inputs[0] * full  # autograd saves ``full`` for the gradient of inputs[0]

        def before_backward():
            p.restore_storage(full)
            p.copy_into(full, p.from_numpy(refill))
            refilled.append(True)
        p.register_grad_hook(product, before_backward)
        p.release_storage(full)
        _check(_storage_bytes(full) == 0, "release_storage under autograd did not free")
        return ctx.side.weighted_sum(product, coef)

    _, (grad,), _ = ctx.side.backward(loss_fn, [np.ones((2, 3), np.float32)])
    _check(refilled == [True], f"grad hook ran {len(refilled)} times, expected once")
    _same(grad, refill * coef, "gradient after release/restore/copy_into", tol=1e-6)


@local_check
def check_no_grad_and_is_grad_enabled(ctx):
    p = ctx.p
    enabled = p.is_grad_enabled()
    _check(isinstance(enabled, bool), f"is_grad_enabled returned {type(enabled).__name__}")
    with p.no_grad():
        inside = p.is_grad_enabled()
        out = p.scale(p.from_numpy(_arange(3)), 2.0)
    _check(isinstance(inside, bool), f"is_grad_enabled in no_grad returned {type(inside).__name__}")
    _same(_values(ctx, out), _arange(3) * 2, "computing inside no_grad")
    _check(p.is_grad_enabled() == enabled, "no_grad did not restore is_grad_enabled on exit")
    try:
        with p.no_grad():
            raise KeyError("inside")
    except KeyError:
        pass
    _check(p.is_grad_enabled() == enabled, "no_grad did not restore grad mode after an exception")


@local_check
def check_is_grad_enabled_reflects_no_grad(ctx):
    """Inside a computation a backward differentiates, operations are recorded (True); in
    no_grad within it they are not (False). Outside one the frameworks differ (torch records
    every operation, MindSpore only inside value_and_grad), so that is not checked."""
    p = ctx.p
    seen = {}

    def loss_fn(inputs):
        seen["recorded"] = p.is_grad_enabled()
        with p.no_grad():
            seen["in_no_grad"] = p.is_grad_enabled()
        return ctx.side.weighted_sum(p.scale(inputs[0], 2.0), np.ones(3, np.float32))

    ctx.side.backward(loss_fn, [np.ones(3, np.float32)])
    _check(seen["recorded"] is True,
           f"is_grad_enabled() is {seen['recorded']!r} inside a differentiated computation")
    _check(seen["in_no_grad"] is False,
           f"is_grad_enabled() is {seen['in_no_grad']!r} inside platform.no_grad()")


@local_check
def check_no_grad_stops_gradient(ctx):
    """An operation run inside ``no_grad`` is not recorded: no gradient flows through it."""
    p = ctx.p

    def loss_fn(inputs):
        x = inputs[0]
        with p.no_grad():
            frozen = p.scale(x, 3.0)
        return ctx.side.weighted_sum(p.add(p.scale(x, 2.0), frozen), np.ones(3, np.float32))

    _, (grad,), _ = ctx.side.backward(loss_fn, [np.ones(3, np.float32)])
    _same(grad, np.full(3, 2.0, np.float32),
          "gradient of sum(2x + no_grad(3x)) (3x must not contribute)", tol=1e-6)


@local_check
def check_restored_flat(ctx):
    """``restored_flat(full, numel, start)`` over a released ``full`` (a read of a bigger
    buffer, as a unit's full parameters are): a 1-D tensor of ``numel`` elements that begins
    ``start`` elements before ``full``'s first one, ``full`` reading its elements ``start``
    on; more elements than the buffer had (the padding rows of a gather) included."""
    _writes_in_place(ctx)
    p = ctx.p
    f32 = p.dtype("float32")
    for offset, start, numel in ((0, 0, 6), (0, 0, 9), (3, 3, 10), (3, 1, 12)):
        buffer = p.zeros((10,), f32)
        full = p.reshape(p.narrow(buffer, 0, offset, 6), (2, 3))
        p.release_storage(full)
        flat = p.restored_flat(full, numel, start)
        how = f"(full: 6 elements from {offset} of 10; numel {numel}, start {start})"
        _check(p.shape(flat) == (numel,), f"restored_flat {how}: shape {p.shape(flat)}")
        values = _arange(numel, start=1.0)
        p.copy_into(flat, p.from_numpy(values))
        _same(_values(ctx, full), values[start:start + 6].reshape(2, 3),
              f"restored_flat {how}: full does not read the flat tensor's elements from start")
        _same(_values(ctx, flat), values, f"restored_flat {how}: the flat tensor's values")


@collective_check()
def check_all_gather_into_restored_flat(ctx):
    """The re-gather before backward: a full tensor autograd saved is released, then
    gathered into in place with ``all_gather(out=restored_flat(...))`` (sync and async);
    backward sees the gathered values and autograd does not complain about the write.
    Padded: the full tensor is a prefix of the gathered rows (the last rank's row is
    padding). With ``start``: the full tensor begins one row into the gathered buffer
    (another tensor's row before it), and ``flat`` is the whole buffer."""
    _writes_in_place(ctx)
    p, w, r = ctx.p, ctx.world, ctx.rank
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
                out = p.restored_flat(full, 3 * w, 3 * first)
                result = p.all_gather(_f32(ctx, rows[r]), ctx.mesh1.get_group(0),
                                      async_op=async_op, out=out).wait()
                _check(isinstance(result, Gathered) and result.flat is out,
                       "all_gather(out=restored_flat(...)): flat is not the restored buffer")
                gathered.append((_values(ctx, full), _values(ctx, result.flat)))
            p.register_grad_hook(product, before_backward)
            p.release_storage(full)
            return ctx.side.weighted_sum(product, coef)

        _, (grad,), _ = ctx.side.backward(loss_fn, [np.ones((kept, 3), np.float32)])
        how = f"(async_op={async_op}, {kept} of {w} rows from row {first})"
        _check(len(gathered) == 1, f"grad hook ran {len(gathered)} times {how}")
        _same(gathered[0][0], rows[first:first + kept], f"full after the gather into it {how}")
        _same(gathered[0][1], rows.reshape(-1), f"the gathered flat buffer {how}")
        _same(grad, rows[first:first + kept] * coef,
              f"gradient through a tensor gathered in place {how}", tol=1e-6)
