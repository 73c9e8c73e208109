"""Conformance checks of the platform contract: gradient delivery (``write_grad``,
low-precision collectives, parameters updated in forward).

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import numpy as np

from tests.platform.conformance import (
    _arange, _check, _f32, _same, _values, collective_check, local_check)


def _sharded(ctx, name, requires_grad=True):
    """A (2W, 3) parameter sharded on dim 0 over the 1-D mesh; this rank holds 2 rows."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    orig = ctx.side.new_param(np.zeros((2 * w, 3), np.float32), name, requires_grad=requires_grad)
    return p.make_sharded_param(orig, p.from_numpy(_arange(2 * w, 3)[2 * r:2 * r + 2]),
                                ctx.mesh1.native, 0, 0, (2 * w, 3))


def _delivered(ctx, param, placeholder):
    """The gradient the user sees after write_grad: the placeholder where the platform
    returns one (MindSpore value_and_grad), else the parameter's accumulated ``.grad``."""
    if placeholder is not None:
        return _values(ctx, placeholder)
    return None if param.grad is None else ctx.p.to_numpy(param.grad)


def _placeholder(ctx, param):
    """What backward returns for a sharded parameter while its gradient is on the wire
    (the core's ``FSDPParam.grad_placeholder``): zeros shaped like the local shard where
    backward's return value is the user's gradient, else None."""
    p = ctx.p
    if not p.capabilities.returns_grads_from_backward:
        return None
    local = p.local_tensor(param)
    return p.zeros(p.shape(local), p.dtype_of(local))


@collective_check()
def check_write_grad(ctx):
    """write_grad fills the placeholder where backward returns the user's gradients, else
    accumulates into ``param.grad``; ``to_main_grad`` accumulates float32 ``main_grad``
    and leaves the gradient alone."""
    p = ctx.p
    g1, g2 = _arange(2, 3, start=1), _arange(2, 3, start=-3) * 0.5
    param = _sharded(ctx, "conf.wg")
    placeholder = _placeholder(ctx, param)
    p.write_grad(param, placeholder, p.from_numpy(g1), False)
    _same(_delivered(ctx, param, placeholder), g1, "gradient after one write_grad")
    if placeholder is None:
        p.write_grad(param, placeholder, p.from_numpy(g2), False)
        _same(_delivered(ctx, param, placeholder), g1 + g2, "a second write_grad accumulates "
              "into .grad", tol=1e-6)
        expected_grad = g1 + g2
    else:
        expected_grad = g1
    main = _sharded(ctx, "conf.main")
    main_placeholder = _placeholder(ctx, main)
    low = p.cast(p.from_numpy(g1), p.dtype("float16"))
    p.write_grad(main, main_placeholder, low, True)
    p.write_grad(main, main_placeholder, p.cast(p.from_numpy(g2), p.dtype("float16")), True)
    main_grad = getattr(main, "main_grad", None)
    _check(main_grad is not None, "write_grad(to_main_grad=True) set no param.main_grad")
    _check(p.to_numpy(main_grad).dtype == np.float32,
           f"main_grad holds {p.to_numpy(main_grad).dtype}, expected float32")
    _same(p.to_numpy(main_grad), g1 + g2, "main_grad accumulates both writes in float32",
          tol=1e-6)
    untouched = _delivered(ctx, main, main_placeholder)
    _check(untouched is None or not np.any(untouched),
           f"write_grad(to_main_grad=True) touched the gradient: {untouched}")
    _same(_delivered(ctx, param, placeholder), expected_grad, "the first param is unaffected",
          tol=1e-6)


@collective_check()
def check_write_grad_after_backward(ctx):
    """The core's late fill: backward returns the placeholder for the shard and a final
    callback write_grad()s the reduced gradient; the user then sees that gradient."""
    p = ctx.p
    param = _sharded(ctx, "conf.late")
    reduced = _arange(2, 3, start=10 * ctx.rank) * 0.25

    def forward_fn(inputs):
        return [p.scale(inputs[0], 2.0)]

    def backward_fn(grads):
        placeholder = _placeholder(ctx, param)
        p.queue_backward_final_callback(
            lambda: p.write_grad(param, placeholder, p.from_numpy(reduced), False))
        return [placeholder]

    def loss_fn(_):
        out = p.differentiable_call([p.local_tensor(param)], forward_fn, backward_fn)[0]
        return ctx.side.weighted_sum(out, np.ones((2, 3), np.float32))

    _, _, (grad,) = ctx.side.backward(loss_fn, [], [param])
    _same(grad, reduced, "gradient the framework reports after the late write_grad")


@collective_check()
def check_low_precision_collectives(ctx):
    """Mixed precision gathers in float16/bfloat16 (into ``out`` and into new memory: on
    MindSpore CPU bfloat16 takes the list all-gather, whose pieces are its own outputs) and
    may reduce in them."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    group = ctx.mesh1.get_group(0)
    f32 = p.dtype("float32")
    results = {}
    for name in ("float16", "bfloat16"):
        dtype = p.dtype(name)
        out = p.zeros((2 * w,), dtype)
        p.all_gather(p.cast(_f32(ctx, [r, 0.5 * r]), dtype), group, out=out)
        pieces = p.all_gather(p.cast(_f32(ctx, [-r, 2.0 * r]), dtype), group).wait().pieces
        mine = p.cast(_f32(ctx, np.arange(2 * w) + r), dtype)
        chunk = p.reduce_scatter([[p.narrow(mine, 0, 2 * q, 2)] for q in range(w)], group).wait()
        t = p.cast(_f32(ctx, [r, 1.0]), dtype)
        p.all_reduce(t, group)
        results[name] = [_values(ctx, p.cast(x, f32)) for x in (out, p.cat(pieces), chunk, t)]
    s = w * (w - 1) / 2
    for name, (gathered, new, chunk, reduced) in results.items():
        _same(gathered, np.array([v for k in range(w) for v in (k, 0.5 * k)], np.float32),
              f"all_gather(out=...) {name}")
        _same(new, np.array([v for k in range(w) for v in (-k, 2.0 * k)], np.float32),
              f"all_gather {name}: its pieces, rank-major")
        _same(chunk, (np.arange(2 * w) * w + s)[2 * r:2 * r + 2].astype(np.float32),
              f"reduce_scatter {name}")
        _same(reduced, np.array([s, w], np.float32), f"all_reduce {name}")


@local_check
def check_updated_in_forward(ctx):
    """The parameters a BatchNorm's training forward writes are exactly those
    updated_in_forward names (fully_shard leaves them whole so the write reaches them)."""
    p = ctx.p
    bn = ctx.side.batchnorm()
    before = [(name, param, p.to_numpy(param).copy()) for name, param in p.direct_params(bn)]
    bn(_f32(ctx, _arange(4, 3) * 0.1))
    written = sorted(name for name, param, value in before
                     if not np.array_equal(p.to_numpy(param), value))
    listed = {id(t) for t in p.updated_in_forward(bn)}
    named = sorted(name for name, param, _ in before if id(param) in listed)
    _check(written == named, f"a BatchNorm's forward wrote the parameters {written}; "
                             f"updated_in_forward names {named}")
    _check(p.updated_in_forward(ctx.side.model()) == [], "updated_in_forward of a model of "
                                                         "Linear layers is not empty")
