"""The core's differentiable exchanges (hyper_parallel/autograd_collectives.py) over each
platform: forward values, and gradients sent back to the rank each row came from.

They are the core's, not the contract's, but they stand on three parts of it at once
(``all_to_all``, ``send``/``recv`` and ``differentiable_call``, whose MindSpore form runs
the collectives inside a custom bprop), so they run in the conformance launches.
The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import numpy as np

from hyper_parallel import autograd_collectives as ac
from tests.platform.checks_collectives import _routed
from tests.platform.conformance import _f32, _same, _values, collective_check


def _rows(src: int, dst: int, width: int = 2) -> np.ndarray:
    """The rows rank ``src`` sends rank ``dst``: as many as ``_routed`` has elements, each
    row ``width`` distinct values."""
    base = _routed(src, dst)
    return (base[:, None] + 0.25 * np.arange(width, dtype=np.float32)).astype(np.float32)


@collective_check()
def check_autograd_all_to_all(ctx):
    """Rows arrive in rank order (uneven, some pairs none); with the loss sum(out * out) / 2
    each received row's gradient is its own value, so the input's gradient equals the input
    exactly when every gradient row went back to the row it came from."""
    w, r = ctx.world, ctx.rank
    sent = np.concatenate([_rows(r, d) for d in range(w)])
    expected = np.concatenate([_rows(s, r) for s in range(w)])
    outputs = []

    def loss_fn(inputs):
        out = ac.all_to_all(inputs[0], [(r + d) % 3 for d in range(w)],
                            [(s + r) % 3 for s in range(w)], ctx.mesh1)
        outputs.append(_values(ctx, out))
        return ctx.side.weighted_sum(out, expected * 0.5) * 2.0

    _, (grad,), _ = ctx.side.backward(loss_fn, [sent])
    _same(outputs[0], expected, f"all_to_all rows on rank {r}")
    _same(grad, sent, f"all_to_all's gradient on rank {r} (each row's own value)")


@collective_check()
def check_exchange_counts(ctx):
    """Two counts per destination: every source's two for this rank, in source order."""
    p, w, r = ctx.p, ctx.world, ctx.rank
    counts = np.array([[10 * r + d, 100 * r + d] for d in range(w)], np.int64).reshape(-1)
    received = _values(ctx, ac.exchange_counts(p.from_numpy(counts), ctx.mesh1))
    _same(received, np.array([[10 * s + r, 100 * s + r] for s in range(w)]).reshape(-1),
          f"exchange_counts on rank {r}")


@collective_check()
def check_ring_shift(ctx):
    """Forward: the previous rank's tensor (shift 1), the one two places back (shift 2,
    which over two ranks is the rank itself); backward: each rank's loss weights go to the
    rank whose tensor it received."""
    w, r = ctx.world, ctx.rank
    mine = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r
    weights = [np.full((2, 3), 1.0 + r, np.float32), np.full((2, 3), -3.0 * r, np.float32)]
    outputs = []

    def loss_fn(inputs):
        one, two = ac.ring_shift(inputs[0], ctx.mesh1), ac.ring_shift(inputs[0], ctx.mesh1, 2)
        outputs.extend([_values(ctx, one), _values(ctx, two)])
        return ctx.side.weighted_sum(one, weights[0]) + ctx.side.weighted_sum(two, weights[1])

    _, (grad,), _ = ctx.side.backward(loss_fn, [mine])
    _same(outputs[0], mine - 10 * r + 10 * ((r - 1) % w), "ring_shift by one")
    _same(outputs[1], mine - 10 * r + 10 * ((r - 2) % w), "ring_shift by two")
    expected = np.full((2, 3), 1.0 + (r + 1) % w, np.float32) + \
        np.full((2, 3), -3.0 * ((r + 2) % w), np.float32)
    _same(grad, expected, f"ring_shift's gradient on rank {r}")
    _same(_values(ctx, ac.ring_shift(_f32(ctx, mine), ctx.mesh1, w)), mine,
          "ring_shift by the ring's size (the rank's own tensor)")
