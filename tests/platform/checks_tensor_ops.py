"""Conformance checks of the platform contract: the functional tensor ops (cast, reshape,
narrow, cat, clone, scale, norms...) and the defaults base.py and tensors.py write once.

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import numpy as np

from hyper_parallel.platform.base import Platform
from tests.platform.conformance import (
    DTYPE_SIZES, Skip, _arange, _check, _same, _values, local_check)


@local_check
def check_cast(ctx):
    p = ctx.p
    f32 = p.dtype("float32")
    values = np.array([0.5, -1.25, 3.0, 1024.0, -0.0625], np.float32)  # exact in f16 and bf16
    t = p.from_numpy(values)
    for name in ("float64", "float16", "bfloat16"):
        out = p.cast(t, p.dtype(name))
        _check(p.dtype_of(out) == p.dtype(name), f"cast to {name} gave {p.dtype_of(out)}")
        _same(_values(ctx, p.cast(out, f32)), values, f"cast f32 -> {name} -> f32 values")
    _check(p.cast(t, f32) is t, "cast to the tensor's own dtype must return the same tensor")
    ints = p.cast(p.from_numpy(np.array([1, -2, 3], np.int64)), f32)
    _same(_values(ctx, ints), np.array([1, -2, 3], np.float32), "cast int64 -> f32")
    _same(_values(ctx, t), values, "cast changed its input")


@local_check
def check_reshape(ctx):
    p = ctx.p
    base = _arange(2, 3, 4)
    t = p.from_numpy(base)
    for shape in ((24,), (4, 6), [3, 8], (2, 12, 1)):
        out = p.reshape(t, shape)
        _check(p.shape(out) == tuple(shape), f"reshape to {shape}: shape {p.shape(out)}")
        _same(_values(ctx, out), base.reshape(shape), f"reshape to {shape} values")
    _same(_values(ctx, t), base, "reshape changed its input")


@local_check
def check_movedim(ctx):
    p = ctx.p
    base = _arange(2, 3, 4)
    t = p.from_numpy(base)
    for source, destination in ((0, 2), (2, 0), (1, 0), (0, 1), (1, 1)):
        out = p.movedim(t, source, destination)
        _same(_values(ctx, out), np.moveaxis(base, source, destination),
              f"movedim({source}, {destination}) values")
    flat = p.reshape(p.contiguous(p.movedim(t, 1, 0)), (24,))
    _same(_values(ctx, flat), np.moveaxis(base, 1, 0).reshape(24), "movedim+contiguous+reshape")
    flat = p.reshape(p.movedim(t, 1, 0), (24,))
    _same(_values(ctx, flat), np.moveaxis(base, 1, 0).reshape(24),
          "reshape of a movedim result (no contiguous in between)")


@local_check
def check_narrow(ctx):
    p = ctx.p
    base = _arange(5, 4)
    t = p.from_numpy(base)
    _same(_values(ctx, p.narrow(t, 0, 1, 3)), base[1:4], "narrow(dim 0, 1, 3)")
    _same(_values(ctx, p.narrow(t, 0, 0, 2)), base[0:2], "narrow(dim 0, 0, 2)")
    _same(_values(ctx, p.narrow(t, 1, 2, 2)), base[:, 2:4], "narrow(dim 1, 2, 2)")
    _same(_values(ctx, p.narrow(p.narrow(t, 0, 1, 3), 1, 1, 2)), base[1:4, 1:3],
          "narrow of a narrow")
    flat = p.reshape(t, (20,))
    _same(_values(ctx, p.narrow(flat, 0, 7, 6)), base.reshape(20)[7:13], "narrow of a reshape")
    _same(_values(ctx, p.reshape(p.narrow(flat, 0, 8, 8), (2, 4))), base.reshape(20)[8:16]
          .reshape(2, 4), "reshape of a narrow at an offset")
    _same(_values(ctx, t), base, "narrow changed its input")


@local_check
def check_narrow_empty(ctx):
    """Uneven sharding leaves some ranks an empty shard: narrow(.., start=rows, length=0)."""
    p = ctx.p
    base = _arange(3, 4)
    t = p.from_numpy(base)
    empty = p.narrow(t, 0, 3, 0)
    _check(p.shape(empty) == (0, 4), f"narrow(dim 0, 3, 0) shape {p.shape(empty)}")
    _same(_values(ctx, p.contiguous(empty)), np.zeros((0, 4), np.float32), "contiguous(empty)")
    _same(_values(ctx, p.cat([empty, p.zeros((2, 4), p.dtype("float32"))], 0)),
          np.zeros((2, 4), np.float32), "cat of an empty tensor and a (2, 4) one")
    _check(p.shape(p.movedim(p.narrow(p.movedim(t, 1, 0), 0, 4, 0), 0, 1)) == (3, 0),
           "narrow to 0 along a moved dim")


@local_check
def check_core_shard_pattern(ctx):
    """The core's sharding read: narrow(movedim(t, d, 0), 0, start, rows) moved back, made
    contiguous, flattened, padded with cat, and the full tensor rebuilt from that."""
    p = ctx.p
    base = _arange(5, 6, 3)
    t = p.from_numpy(base)
    for dim in (0, 1):
        moved = np.moveaxis(base, dim, 0)
        local = p.narrow(p.movedim(t, dim, 0), 0, 2, 2)
        local = p.contiguous(p.movedim(local, 0, dim))
        expected = np.moveaxis(moved[2:4], 0, dim)
        _same(_values(ctx, local), expected, f"shard rows 2:4 along dim {dim}")
        flat = p.reshape(p.movedim(local, dim, 0), (expected.size,))
        padded = p.cat([flat, p.zeros((5,), p.dtype("float32"))], 0)
        _same(_values(ctx, padded), np.concatenate([moved[2:4].reshape(-1), np.zeros(5)]),
              f"flat padded shard along dim {dim}")


@local_check
def check_cat(ctx):
    p = ctx.p
    a, b, c = _arange(2, 3), _arange(1, 3, start=100), _arange(2, 2, start=50)
    ta, tb, tc = p.from_numpy(a), p.from_numpy(b), p.from_numpy(c)
    _same(_values(ctx, p.cat([ta, tb], 0)), np.concatenate([a, b], 0), "cat dim 0")
    _same(_values(ctx, p.cat((ta, tc), 1)), np.concatenate([a, c], 1), "cat dim 1 (tuple)")
    _same(_values(ctx, p.cat([ta, tb, ta])), np.concatenate([a, b, a], 0), "cat of three, default dim")
    out = p.cat([ta, tb], 0)
    p.copy_into(out, p.from_numpy(np.full((3, 3), -1, np.float32)))
    _same(_values(ctx, ta), a, "writing the result of cat changed an input")
    single = p.cat([ta], 0)
    _check(p.is_tensor(single), "cat of a single-tensor list did not return a tensor")
    _same(_values(ctx, single), a, "cat of one tensor")
    p.copy_into(single, p.from_numpy(np.full((2, 3), -1, np.float32)))
    _same(_values(ctx, single), np.full((2, 3), -1, np.float32), "copy_into the cat result")
    _same(_values(ctx, ta), a, "cat([t]) must be a new tensor: writing it changed t")
    _same(_values(ctx, p.cat([p.narrow(ta, 1, 1, 2), p.narrow(tc, 1, 0, 2)], 1)),
          np.concatenate([a[:, 1:3], c[:, 0:2]], 1), "cat of narrowed inputs")


@local_check
def check_contiguous(ctx):
    p = ctx.p
    base = _arange(3, 4)
    t = p.from_numpy(base)
    strided = p.contiguous(p.movedim(t, 0, 1))
    _same(_values(ctx, strided), base.T, "contiguous(movedim) values")
    p.copy_into(strided, p.from_numpy(np.zeros((4, 3), np.float32)))
    _same(_values(ctx, t), base, "contiguous of a strided read must own its memory: writing it "
          "changed the base")
    _same(_values(ctx, p.contiguous(p.narrow(t, 0, 1, 2))), base[1:3],
          "contiguous(narrow along dim 0 at an offset) values")
    part = p.contiguous(p.narrow(t, 1, 1, 2))  # a strided read
    _same(_values(ctx, part), base[:, 1:3], "contiguous(narrow along dim 1) values")
    p.copy_into(part, p.from_numpy(np.zeros((3, 2), np.float32)))
    _same(_values(ctx, t), base, "contiguous(narrow along dim 1) must own its memory: writing "
          "it changed the base")
    _same(_values(ctx, p.contiguous(t)), base, "contiguous of a dense tensor")


@local_check
def check_clone(ctx):
    p = ctx.p
    base = _arange(3, 4)
    t = p.from_numpy(base)
    for how, source, expected in (("a dense tensor", t, base),
                                  ("narrow at offset 0", p.narrow(t, 0, 0, 2), base[0:2]),
                                  ("narrow at an offset", p.narrow(t, 0, 1, 2), base[1:3]),
                                  ("movedim", p.movedim(t, 0, 1), base.T)):
        copy = p.clone(source)
        _check(p.dtype_of(copy) == p.dtype_of(source), f"clone of {how}: dtype {p.dtype_of(copy)}")
        _same(_values(ctx, copy), expected, f"clone of {how}: values")
        p.copy_into(copy, p.from_numpy(np.full(expected.shape, -1, np.float32)))
        _same(_values(ctx, t), base, f"clone of {how} must own its memory: writing the clone "
              "changed the original")
    copy = p.clone(t)
    p.copy_into(t, p.from_numpy(np.zeros((3, 4), np.float32)))
    _same(_values(ctx, copy), base, "writing the original changed its clone")
    half = p.cast(p.from_numpy(base), p.dtype("float16"))
    _check(p.dtype_of(p.clone(half)) == p.dtype("float16"), "clone of float16 changed the dtype")


@local_check
def check_join_from_launcher_env(ctx):
    """Outside the framework's own launcher (hp-run set RANK etc.) it must not join."""
    p = ctx.p
    world = p.world_size()
    _check(p.join_from_launcher_env() is False, "join_from_launcher_env joined without its launcher")
    _check(p.is_initialized() and p.world_size() == world, "join_from_launcher_env changed the group")


@local_check
def check_alias(ctx):
    """alias: same values and memory under a new object, usable as a new node's output."""
    p = ctx.p
    base = _arange(3, 4)
    t = p.from_numpy(base)
    alias = p.alias(t)
    _same(_values(ctx, alias), base, "alias: values")
    _check(p.shape(alias) == (3, 4), f"alias: shape {p.shape(alias)}")
    p.copy_into(t, p.from_numpy(np.zeros((3, 4), np.float32)))
    _same(_values(ctx, alias), np.zeros((3, 4), np.float32), "alias must share the original's memory")


@local_check
def check_scale(ctx):
    p = ctx.p
    base = np.array([1.0, -2.0, 0.5, 4.0], np.float32)
    for name in ("float32", "float16"):
        t = p.cast(p.from_numpy(base), p.dtype(name))
        for factor in (0.25, 3.0, 1.0):
            out = p.scale(t, factor)
            _check(p.dtype_of(out) == p.dtype(name), f"scale of {name} by {factor} gave "
                   f"{p.dtype_of(out)}")
            _same(_values(ctx, p.cast(out, p.dtype("float32"))), base * factor,
                  f"scale({name}, {factor}) values")
            p.copy_into(out, p.cast(p.from_numpy(np.zeros(4, np.float32)), p.dtype(name)))
            _same(_values(ctx, p.cast(t, p.dtype("float32"))), base,
                  f"scale({name}, {factor}) must return a new tensor: writing it changed the input")
    view = p.narrow(p.from_numpy(_arange(8)), 0, 3, 4)
    _same(_values(ctx, p.scale(view, 2.0)), _arange(8)[3:7] * 2, "scale of a narrow")
    # may_overwrite: the value is the same whether or not the platform scales in place
    for name in ("float32", "float16"):
        own = p.cast(p.from_numpy(base), p.dtype(name))
        out = p.scale(own, 0.5, may_overwrite=True)
        _check(p.dtype_of(out) == p.dtype(name), f"scale(may_overwrite) of {name} gave "
               f"{p.dtype_of(out)}")
        _same(_values(ctx, p.cast(out, p.dtype("float32"))), base * 0.5,
              f"scale({name}, 0.5, may_overwrite=True) values")


@local_check
def check_vector_norm(ctx):
    p = ctx.p
    base = np.array([[3.0, -4.0, 0.5], [0.0, 2.0, -1.5]], np.float32)
    for name in ("float32", "float16", "bfloat16"):
        t = p.cast(p.from_numpy(base), p.dtype(name))
        for norm_type in (2.0, 1.0, 3.0, float("inf")):
            out = p.vector_norm(t, norm_type)
            _check(p.dtype_of(out) == p.dtype("float32") and p.shape(out) == (),
                   f"vector_norm of {name} gave {p.dtype_of(out)} {p.shape(out)}: want a 0-d float32")
            expected = np.linalg.norm(base.reshape(-1).astype(np.float64), norm_type)
            _same(_values(ctx, out), np.float32(expected), f"vector_norm({name}, {norm_type})",
                  tol=1e-6)
    _same(_values(ctx, p.vector_norm(p.narrow(p.from_numpy(base), 1, 1, 1), 2.0)),
          np.float32(np.sqrt(20.0)), "vector_norm of a narrow", tol=1e-6)


@local_check
def check_param_grad(ctx):
    p = ctx.p
    if p.capabilities.returns_grads_from_backward:
        raise Skip("gradients are returned by backward, not attached to the parameters")
    param = ctx.side.new_param(np.ones(3, np.float32), "w")
    _check(p.param_grad(param) is None, "param_grad of a parameter without a gradient: want None")
    weights = np.array([1.0, -2.0, 3.0], np.float32)
    ctx.side.backward(lambda _: ctx.side.weighted_sum(param, weights), [], [param])
    grad = p.param_grad(param)
    _same(_values(ctx, grad), weights, "param_grad after backward")
    p.copy_into(grad, p.scale(grad, 0.5))  # the clipping's in-place write reaches the gradient
    _same(_values(ctx, p.param_grad(param)), weights * 0.5, "copy_into the gradient param_grad gave")


@local_check
def check_add(ctx):
    p = ctx.p
    a, b = _arange(2, 3), _arange(2, 3, start=10) * -1
    ta, tb = p.from_numpy(a), p.from_numpy(b)
    out = p.add(ta, tb)
    _same(_values(ctx, out), a + b, "add values")
    _same(_values(ctx, ta), a, "add changed a")
    _same(_values(ctx, tb), b, "add changed b")
    _check(p.dtype_of(out) == p.dtype("float32"), f"add of f32 gave {p.dtype_of(out)}")
    p.copy_into(out, p.from_numpy(np.zeros((2, 3), np.float32)))
    _same(_values(ctx, ta), a, "add's result aliases a")
    _same(_values(ctx, tb), b, "add's result aliases b")
    zero = p.zeros((2, 3), p.dtype("float32"))
    out = p.add(zero, ta)
    p.copy_into(out, p.from_numpy(np.ones((2, 3), np.float32)))
    _same(_values(ctx, zero), np.zeros((2, 3)), "add(zeros, t) aliases its first input")
    _same(_values(ctx, ta), a, "add(zeros, t) aliases its second input")
    halves = p.add(p.narrow(ta, 1, 0, 1), p.narrow(tb, 1, 2, 1))
    _same(_values(ctx, halves), a[:, 0:1] + b[:, 2:3], "add of narrowed inputs")


@local_check
def check_base_defaults(ctx):
    """The defaults of ``Platform`` (base.py) are correct on every framework whose tensors
    have the method they use, also where this platform overrides them: called as
    ``Platform.<name>(platform, ...)``, each gives what numpy gives."""
    p = ctx.p
    base = _arange(2, 3, 4, start=-5.0)
    t = p.from_numpy(base)
    for name, size in DTYPE_SIZES.items():
        _check(Platform.element_size(p, p.dtype(name)) == size,
               f"Platform.element_size({name}) = {Platform.element_size(p, p.dtype(name))}")
    _check(Platform.shape(p, t) == (2, 3, 4), f"Platform.shape: {Platform.shape(p, t)}")
    _check(Platform.dtype_of(p, t) == p.dtype("float32"), "Platform.dtype_of")
    empty = Platform.empty(p, (2, 3), p.dtype("bfloat16"))
    _check(p.shape(empty) == (2, 3) and p.dtype_of(empty) == p.dtype("bfloat16"),
           f"Platform.empty: {p.shape(empty)} {p.dtype_of(empty)}")
    half = Platform.cast(p, t, p.dtype("float16"))
    _check(p.dtype_of(half) == p.dtype("float16"), f"Platform.cast gave {p.dtype_of(half)}")
    _same(_values(ctx, p.cast(half, p.dtype("float32"))), base, "Platform.cast values")
    _check(Platform.cast(p, t, p.dtype("float32")) is t, "Platform.cast to its own dtype")
    reads = {"reshape": (Platform.reshape(p, t, (6, 4)), base.reshape(6, 4)),
             "movedim": (Platform.movedim(p, t, 0, 2), np.moveaxis(base, 0, 2)),
             "narrow": (Platform.narrow(p, t, 1, 1, 2), base[:, 1:3]),
             "contiguous": (Platform.contiguous(p, p.movedim(t, 2, 0)), np.moveaxis(base, 2, 0)),
             "alias": (Platform.alias(p, t), base),
             "add": (Platform.add(p, t, t), 2 * base),
             "scale": (Platform.scale(p, t, 0.5, may_overwrite=True), base * 0.5)}
    for name, (out, expected) in reads.items():
        _same(_values(ctx, out), expected, f"Platform.{name} values")
    copy = Platform.clone(p, t)
    p.copy_into(copy, p.from_numpy(np.zeros_like(base)))
    _same(_values(ctx, t), base, "Platform.clone must own its memory: writing it changed t")
    for dtype in ("float32", "bfloat16"):
        values = p.cast(t, p.dtype(dtype))
        for norm_type in (2.0, 1.0, 3.0, float("inf")):
            out = Platform.vector_norm(p, values, norm_type)
            _check(p.dtype_of(out) == p.dtype("float32") and p.shape(out) == (),
                   f"Platform.vector_norm gave {p.dtype_of(out)} {p.shape(out)}")
            _same(_values(ctx, out), np.float32(np.linalg.norm(base.reshape(-1), norm_type)),
                  f"Platform.vector_norm({dtype}, {norm_type})", tol=1e-6)
    _check(Platform.join_from_launcher_env(p) is False, "Platform.join_from_launcher_env")
    _check(Platform.mesh_from_native(p, object()) is None, "Platform.mesh_from_native")
    _check(Platform.is_deferred(p, t) is False and Platform.starts_with(p, t, t) is False,
           "Platform.is_deferred / Platform.starts_with of a plain tensor")


@local_check
def check_bytes_round_trip(ctx):
    """as_bytes / from_bytes: any dtype's memory as uint8 and back, also from an offset of a
    larger byte buffer (how a gather codec's tensors share one collective)."""
    p = ctx.p
    values = np.array([[0.5, -1.25, 3.0], [1024.0, -0.0625, 7.0]], np.float32)  # exact in bf16
    for name, size in (("float32", 4), ("bfloat16", 2), ("int32", 4), ("int8", 1)):
        t = p.cast(p.from_numpy(values), p.dtype(name))
        raw = p.as_bytes(t)
        _check(p.dtype_of(raw) == p.dtype("uint8") and p.shape(raw) == (6 * size,),
               f"as_bytes of a (2, 3) {name} tensor: {p.dtype_of(raw)} {p.shape(raw)}")
        buffer = p.cat([p.zeros((8,), p.dtype("uint8")), raw], 0)
        back = p.from_bytes(p.narrow(buffer, 0, 8, 6 * size), p.dtype(name), (2, 3))
        _check(p.dtype_of(back) == p.dtype(name) and p.shape(back) == (2, 3),
               f"from_bytes to {name}: {p.dtype_of(back)} {p.shape(back)}")
        _same(_values(ctx, p.cast(back, p.dtype("float32"))),
              _values(ctx, p.cast(t, p.dtype("float32"))), f"{name} through bytes")


@local_check
def check_gather_codec_of(ctx):
    """A plain tensor asks for no gather codec; on torch, a type with FSDP2's all-gather
    hooks gets one (the hooks are called only at a gather, fully_shard/codec_leg.py)."""
    from hyper_parallel.fully_shard.gather_codec import GatherCodec

    p = ctx.p
    _check(p.gather_codec_of(p.zeros((2, 2), p.dtype("float32"))) is None,
           "gather_codec_of(a plain tensor) must be None")

    class Hooked:
        fsdp_pre_all_gather = fsdp_post_all_gather = None

    codec = p.gather_codec_of(Hooked())
    if p.name == "torch":
        _check(isinstance(codec, GatherCodec), f"torch: a type with FSDP2's hooks gave {codec!r}")
    else:
        _check(codec is None, f"{p.name} has no tensor-subclass hooks, gave {codec!r}")


@local_check
def check_int8_rows(ctx):
    """int8_rows / from_int8_rows: int8 values and one float32 scale per dim-0 row, back to
    within half a step (max |row| / 254) of each row; a row of zeros stays zeros."""
    p = ctx.p
    values = np.array([[[0.5, -1.25], [3.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]],
                       [[-100.0, 7.0], [0.25, 1.0]]], np.float32)
    t = p.from_numpy(values)
    q, scales = p.int8_rows(t)
    _check(p.dtype_of(q) == p.dtype("int8") and p.shape(q) == (3, 2, 2),
           f"int8_rows values: {p.dtype_of(q)} {p.shape(q)}")
    _check(p.dtype_of(scales) == p.dtype("float32") and p.shape(scales) == (3,),
           f"int8_rows scales: {p.dtype_of(scales)} {p.shape(scales)}")
    back = _values(ctx, p.from_int8_rows(q, scales, p.dtype("float32")))
    bound = np.abs(values).reshape(3, -1).max(1) / 254 + 1e-6
    error = np.abs(back - values).reshape(3, -1).max(1)
    _check(bool(np.all(error <= bound)), f"int8 round trip errors {error} above {bound}")
    _check(bool(np.all(back[1] == 0.0)), "a row of zeros did not come back as zeros")
    _check(p.dtype_of(p.from_int8_rows(q, scales, p.dtype("bfloat16"))) == p.dtype("bfloat16"),
           "from_int8_rows ignores its dtype")
