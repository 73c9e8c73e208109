"""Conformance checks of the optional part ``ContextParallelSupport``
(platform/cp_support.py): the batched matrix product, a tensor's values and shape replaced
in place, and the framework's attention routed while a context is open.

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import numpy as np

from tests.platform.conformance import _arange, _check, _f32, _same, _values, local_check


@local_check
def check_matmul(ctx):
    a, b = _arange(2, 3, 4), _arange(2, 4, 5, start=1.0)
    _same(_values(ctx, ctx.p.matmul(_f32(ctx, a), _f32(ctx, b))), a @ b, "matmul", tol=1e-6)


@local_check
def check_replace_values(ctx):
    p = ctx.p
    tensor = _f32(ctx, _arange(4, 6))
    same = tensor
    p.replace_values(tensor, _f32(ctx, _arange(4, 3, start=100.0)))
    _check(same is tensor, "replace_values made a new tensor object")
    _same(_values(ctx, tensor), _arange(4, 3, start=100.0), "replace_values: the new values")
    ids = p.from_numpy(np.arange(8, dtype=np.int64).reshape(2, 4))
    p.replace_values(ids, p.narrow(ids, 1, 2, 2))
    _same(_values(ctx, ids), np.array([[2, 3], [6, 7]]), "replace_values from its own slice")
    tokens = p.from_numpy(np.arange(10, dtype=np.int64).reshape(1, 10))
    inputs, targets = p.narrow(tokens, 1, 0, 9), p.narrow(tokens, 1, 1, 9)  # one memory
    p.replace_values(inputs, p.narrow(inputs, 1, 0, 2) + 100)
    _same(_values(ctx, inputs), np.array([[100, 101]]), "replace_values of a view")
    _same(_values(ctx, targets), np.arange(1, 10).reshape(1, 9),
          "replace_values wrote into memory another tensor shares")


@local_check
def check_route_framework_attention(ctx):
    p, attention = ctx.p, ctx.side.framework_attention()
    calls = []

    def routed(*args, **kwargs):
        calls.append(kwargs.get("is_causal"))
        return args[0]

    q = _f32(ctx, _arange(1, 1, 4, 2))
    with p.route_framework_attention(routed):
        if attention is not None:
            _same(_values(ctx, attention(q, q, q, is_causal=True)), _values(ctx, q),
                  "the routed attention's result")
    _check(calls == ([] if attention is None else [True]),
           f"route_framework_attention: the routed function saw {calls}")
    if attention is not None:  # the framework's own again after the context
        out = attention(q, q, q)
        _check(len(calls) == 1 and p.shape(out) == (1, 1, 4, 2),
               "the framework's attention was not restored after the context")
