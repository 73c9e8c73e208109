"""Conformance checks of the platform contract: autograd and hooks.

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import numpy as np

from tests.platform.conformance import _arange, _check, _same, _values, local_check


def _differentiable_pair(ctx, log):
    """forward: [2x, x + y]; backward: the exact chain rule, logging every call."""
    p = ctx.p

    def forward_fn(inputs):
        log.append(("forward", len(inputs)))
        x, y = inputs
        return [p.scale(x, 2.0), p.add(x, y)]

    def backward_fn(grads):
        log.append(("backward", [None if g is None else _values(ctx, g) for g in grads]))
        g0, g1 = grads
        return [p.add(p.scale(g0, 2.0), g1), p.scale(g1, 1.0)]
    return forward_fn, backward_fn


@local_check
def check_differentiable_call(ctx):
    p = ctx.p
    x, y = _arange(3) + 1, _arange(3) * -0.5
    a, b, c = _arange(3) + 0.5, np.array([1, -1, 2], np.float32), np.array([3, 0, -2], np.float32)
    log, outputs = [], []
    forward_fn, backward_fn = _differentiable_pair(ctx, log)

    def loss_fn(inputs):
        out = p.differentiable_call(inputs, forward_fn, backward_fn)
        outputs.append([_values(ctx, o) for o in out])
        _check(isinstance(out, list) and len(out) == 2, f"differentiable_call returned {out!r}")
        # the first output is used twice: its two gradients must arrive summed, in one call
        return (ctx.side.weighted_sum(out[0], a) + ctx.side.weighted_sum(out[0], b)
                + ctx.side.weighted_sum(out[1], c))

    loss, (gx, gy), _ = ctx.side.backward(loss_fn, [x, y])
    _same(outputs[0][0], 2 * x, "forward output 0")
    _same(outputs[0][1], x + y, "forward output 1")
    _same(loss, float(np.sum(2 * x * (a + b)) + np.sum((x + y) * c)), "loss", tol=1e-5)
    kinds = [entry[0] for entry in log]
    _check(kinds == ["forward", "backward"],
           f"forward_fn/backward_fn calls: {kinds} (backward must run exactly once)")
    grads = log[1][1]
    _check(len(grads) == 2 and all(g is not None for g in grads),
           f"backward_fn got {grads!r}, expected two gradients")
    _same(grads[0], a + b, "backward_fn's gradient of the output used twice (summed)", tol=1e-6)
    _same(grads[1], c, "backward_fn's gradient of output 1", tol=1e-6)
    _same(gx, 2 * (a + b) + c, "input gradient x", tol=1e-6)
    _same(gy, c, "input gradient y", tol=1e-6)


@local_check
def check_differentiable_call_detached(ctx):
    """grads_to_inputs=False: backward_fn still runs once with the summed gradients, but
    the inputs receive nothing from it (None or zeros)."""
    p = ctx.p
    x, y = _arange(3) + 1, _arange(3) * -0.5
    a, c = _arange(3) + 0.5, np.array([3, 0, -2], np.float32)
    log = []
    forward_fn, backward_fn = _differentiable_pair(ctx, log)

    def loss_fn(inputs):
        out = p.differentiable_call(inputs, forward_fn, backward_fn, grads_to_inputs=False)
        return ctx.side.weighted_sum(out[0], a) + ctx.side.weighted_sum(out[1], c)

    loss, grads, _ = ctx.side.backward(loss_fn, [x, y])
    _same(loss, float(np.sum(2 * x * a) + np.sum((x + y) * c)), "loss", tol=1e-5)
    kinds = [entry[0] for entry in log]
    _check(kinds == ["forward", "backward"], f"forward_fn/backward_fn calls: {kinds}")
    _same(log[1][1][0], a, "backward_fn's gradient of output 0", tol=1e-6)
    for name, grad in zip("xy", grads):
        _check(grad is None or not np.any(grad), f"input {name} received {grad!r}")


@local_check
def check_differentiable_call_single(ctx):
    """One input, one output, the output used three times."""
    p = ctx.p
    calls = []

    def forward_fn(inputs):
        return [p.scale(inputs[0], -1.0)]

    def backward_fn(grads):
        calls.append(_values(ctx, grads[0]))
        return [p.scale(grads[0], -1.0)]

    w = np.array([1, 2, 3], np.float32)

    def loss_fn(inputs):
        (out,) = p.differentiable_call(inputs, forward_fn, backward_fn)
        return ctx.side.weighted_sum(out, w) + ctx.side.weighted_sum(out, w) + \
            ctx.side.weighted_sum(out, w)

    _, (grad,), _ = ctx.side.backward(loss_fn, [np.ones(3, np.float32)])
    _check(len(calls) == 1, f"backward_fn ran {len(calls)} times, expected once")
    _same(calls[0], 3 * w, "summed output gradient", tol=1e-6)
    _same(grad, -3 * w, "input gradient", tol=1e-6)


@local_check
def check_differentiable_call_params(ctx):
    """Parameters as inputs (the core passes the local shards): their gradients are what
    backward_fn returned for them."""
    p = ctx.p
    a = ctx.side.new_param(_arange(2, 2), "conf.dc.a")
    b = ctx.side.new_param(_arange(3, start=1), "conf.dc.b")
    seen = []

    def forward_fn(inputs):
        return [p.scale(inputs[0], 1.0), p.scale(inputs[1], 1.0)]

    def backward_fn(grads):
        seen.append([_values(ctx, g) for g in grads])
        return [p.scale(grads[0], 10.0), p.scale(grads[1], -1.0)]

    wa, wb = _arange(2, 2, start=1), np.array([2, 0, -1], np.float32)

    def loss_fn(_):
        out_a, out_b = p.differentiable_call([a, b], forward_fn, backward_fn)
        return ctx.side.weighted_sum(out_a, wa) + ctx.side.weighted_sum(out_b, wb)

    _, _, (ga, gb) = ctx.side.backward(loss_fn, [], [a, b])
    _check(len(seen) == 1, f"backward_fn ran {len(seen)} times")
    _same(ga, 10 * wa, "gradient of parameter input a", tol=1e-6)
    _same(gb, -wb, "gradient of parameter input b", tol=1e-6)


@local_check
def check_differentiable_call_none_grad(ctx):
    """backward_fn may return None for an input (the core's no-sync micro-batches): that
    input then gets no gradient (None or zeros), the others theirs."""
    p = ctx.p

    def forward_fn(inputs):
        return [p.add(inputs[0], inputs[1])]

    def backward_fn(grads):
        return [None, p.scale(grads[0], 1.0)]

    w = np.array([2, 3], np.float32)
    _, (gx, gy), _ = ctx.side.backward(
        lambda xs: ctx.side.weighted_sum(p.differentiable_call(xs, forward_fn, backward_fn)[0], w),
        [np.ones(2, np.float32), np.ones(2, np.float32)])
    _check(gx is None or not np.any(gx), f"input whose gradient backward_fn gave as None got {gx}")
    _same(gy, w, "the other input's gradient", tol=1e-6)


@local_check
def check_queue_backward_final_callback(ctx):
    p = ctx.p
    events = []

    def forward_fn(inputs):
        return [p.scale(inputs[0], 1.0)]

    def backward_fn(grads):
        events.append("backward")
        p.queue_backward_final_callback(lambda: events.append("final"))
        return [p.scale(grads[0], 1.0)]

    def loss_fn(inputs):
        out = p.differentiable_call(inputs, forward_fn, backward_fn)[0]
        return ctx.side.weighted_sum(out, np.ones(2, np.float32))

    ctx.side.backward(loss_fn, [np.ones(2, np.float32)])
    _check(events == ["backward", "final"],
           f"events after the first backward: {events}, expected ['backward', 'final']")
    ctx.side.backward(loss_fn, [np.ones(2, np.float32)])
    _check(events == ["backward", "final"] * 2,
           f"events after a second backward: {events} (queued again, it runs again, once)")


@local_check
def check_register_grad_hook(ctx):
    p = ctx.p
    fired = []

    def loss_fn(inputs):
        hidden = p.scale(inputs[0], 3.0)
        p.register_grad_hook(hidden, lambda: fired.append("hidden"))
        return ctx.side.weighted_sum(hidden, np.ones(2, np.float32))

    _, (grad,), _ = ctx.side.backward(loss_fn, [np.ones(2, np.float32)])
    _check(fired == ["hidden"], f"grad hook on an activation fired {fired}")
    _same(grad, np.full(2, 3.0, np.float32), "gradient with a grad hook", tol=1e-6)

    model = ctx.side.model()
    fired.clear()
    p.register_grad_hook(model.fc1.weight, lambda: fired.append("param"))
    params = [model.fc1.weight]
    _, _, (gw,) = ctx.side.backward(
        lambda xs: ctx.side.weighted_sum(model(xs[0]), np.ones((2, 2), np.float32)),
        [_arange(2, 4) * 0.1], params)
    _check(fired == ["param"], f"grad hook on a parameter fired {fired}")
    _check(gw is not None and gw.shape == (3, 4), f"parameter gradient {gw!r}")


@local_check
def check_in_backward(ctx):
    """False outside backward, True in a hook that backward runs: fully_shard tells a
    recomputed forward (activation checkpointing) from a new iteration's by it."""
    p = ctx.p
    _check(p.in_backward() is False, f"in_backward() outside backward is {p.in_backward()!r}")
    seen = []

    def loss_fn(inputs):
        hidden = p.scale(inputs[0], 3.0)
        p.register_grad_hook(hidden, lambda: seen.append(p.in_backward()))
        return ctx.side.weighted_sum(hidden, np.ones(2, np.float32))

    ctx.side.backward(loss_fn, [np.ones(2, np.float32)])
    _check(seen == [True], f"in_backward() in a grad hook during backward gave {seen}")
    _check(p.in_backward() is False, "in_backward() is still True after backward returned")


class _InjectedAbort(Exception):
    """Raised by check_discard_aborted_autograd's forward on purpose."""


@local_check
def check_discard_aborted_autograd(ctx):
    """A backward whose forward raised midway, then discard_aborted_autograd: the next
    backward gives the right gradients (on MindSpore under launch_blocking, the aborted
    recording left open broke the next backward through a LayerNorm; tests/test_module_api.py
    trains one after reset_iter_state)."""
    p = ctx.p
    param = ctx.side.new_param(_arange(2, 3), "conf.aborted")
    weights = _arange(2, 3) + 1.0

    def aborted(_):
        ctx.side.weighted_sum(param, weights)
        raise _InjectedAbort("the forward fails midway")
    try:
        ctx.side.backward(aborted, [], [param])
        raised = False
    except _InjectedAbort:
        raised = True
    _check(raised, "the framework side's backward swallowed the forward's exception")
    p.discard_aborted_autograd()
    _, _, (grad,) = ctx.side.backward(lambda _: ctx.side.weighted_sum(param, weights), [], [param])
    _same(grad, weights, "gradient of the first backward after discard_aborted_autograd")


@local_check
def check_forward_for_later_backward(ctx):
    """Two forwards pending, the older one's backward first (1F1B's order): each backward
    gives its own input gradient, and the parameter gradients (returned, or accumulated on
    the parameters) are the two backwards' sum. Where only the latest pending backward can
    run, the older forward keeps no graph (recomputed at its backward, over the pending
    one)."""
    p = ctx.p
    model = ctx.side.model()
    params = [q for _, m in p.named_modules(model) for _, q in p.direct_params(m)]
    xs = [_arange(2, 4) * 0.1, _arange(2, 4) * -0.2 + 1]
    weights = [np.ones((2, 2), np.float32), _arange(2, 2) - 1]
    expected = [ctx.side.backward(lambda t, w=w: ctx.side.weighted_sum(model(t[0]), w), [x],
                                  params) for x, w in zip(xs, weights)]
    if not p.capabilities.returns_grads_from_backward:
        for q in params:
            q.grad = None  # torch: accumulate from nothing, as expected[...] did
    stack = p.capabilities.backward_of_latest_forward_only
    pending = [p.forward_for_later_backward(model, model, [p.from_numpy(x)], keep_graph=keep)
               for x, keep in zip(xs, (not stack, True))]
    returned = []
    for (output, backward), w in zip(pending, weights):
        input_grads, param_grads = backward(p.from_numpy(w))
        _check(len(input_grads) == 1, f"input gradients {input_grads!r}")
        returned.append(param_grads)
        _same(p.to_numpy(input_grads[0]), expected[len(returned) - 1][1][0],
              f"input gradient of forward {len(returned) - 1}", tol=1e-6)
    for i, q in enumerate(params):
        want = expected[0][2][i] + expected[1][2][i]
        got = (p.to_numpy(returned[0][i]) + p.to_numpy(returned[1][i])
               if p.capabilities.returns_grads_from_backward else p.to_numpy(p.param_grad(q)))
        _same(got, want, f"parameter {i}'s gradient summed over the two backwards", tol=1e-6)
