"""Conformance checks of the optional part ``TensorParallelSupport``
(platform/tp_support.py): layer recognition, local parameters, reads during a forward,
and the tensor math of the vocabulary mask and the parallel loss.

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import numpy as np

from tests.platform.conformance import (
    _arange, _check, _f32, _same, _values, collective_check, local_check)


def _ints(ctx, array):
    return ctx.p.from_numpy(np.asarray(array, dtype=np.int64))


@local_check
def check_parallel_layer(ctx):
    p, side = ctx.p, ctx.side
    model = side.model()
    layer = p.parallel_layer(model.fc1)
    _check(layer is not None and (layer.kind, layer.weight, layer.bias) == ("linear", "weight",
                                                                            "bias"),
           f"parallel_layer(fc1) = {layer}")
    _check(p.shape(p.registered_param(model.fc1, layer.weight)) == (3, 4),
           "the linear layer's weight is not (out, in)")
    embedding = side.embedding(6, 4)
    layer = p.parallel_layer(embedding)
    _check(layer is not None and layer.kind == "embedding" and layer.bias is None,
           f"parallel_layer(embedding) = {layer}")
    _check(p.shape(p.registered_param(embedding, layer.weight)) == (6, 4),
           f"the embedding's weight {layer.weight!r} is not (vocabulary, dim)")
    _check(set(p.parallel_layer(model.fc1).split_dims) == {0, 1} and 0 in layer.split_dims,
           "a linear layer must compute with either weight dim split, an embedding with its "
           "rows split")
    ids = p.from_numpy(np.array([[1, 5], [0, 2]], np.int64))
    weight = p.registered_param(embedding, layer.weight)
    for dim in layer.split_dims:  # the forward computes over a block split on ``dim``
        block = p.new_local_param(weight, p.narrow(weight, dim, 0, p.shape(weight)[dim] // 2))
        p.set_local_param(embedding, layer.weight, block)
        out = embedding(p.where(p.in_range(ids, 0, p.shape(block)[0]), ids, 0))
        _check(p.shape(out) == (2, 2, p.shape(block)[1]),
               f"embedding over its weight split on dim {dim}: output {p.shape(out)}")
    for other in (model, side.batchnorm(), side.conv()):
        _check(p.parallel_layer(other) is None,
               f"parallel_layer({type(other).__name__}) is not None")


@local_check
def check_new_local_param_set_local_param(ctx):
    p = ctx.p
    model = ctx.side.model()
    orig = p.registered_param(model.fc1, "weight")
    block = p.narrow(orig, 1, 1, 2)  # input features 1 and 2, as a row-wise split
    local = p.new_local_param(orig, block)
    _same(_values(ctx, local), _values(ctx, orig)[:, 1:3], "new_local_param's values")
    _check(p.param_requires_grad(local), "new_local_param lost requires_grad")
    p.set_local_param(model.fc1, "weight", local)
    _check(p.registered_param(model.fc1, "weight") is local, "set_local_param did not register")
    _check(model.fc1.weight is local, "module.weight does not read the local parameter")
    out = model.fc1(_f32(ctx, _arange(5, 2)))
    _check(p.shape(out) == (5, 3), f"the layer over its local weight gives {p.shape(out)}")


@local_check
def check_read_in_forward_end_read_in_forward(ctx):
    p = ctx.p
    model = ctx.side.model()
    param = p.registered_param(model.fc1, "bias")
    shadow = _f32(ctx, np.zeros(3))
    p.read_in_forward(model.fc1, "bias", shadow)
    _check(model.fc1.bias is shadow, "module.bias does not read the tensor")
    _check(p.registered_param(model.fc1, "bias") is param, "the registered parameter changed")
    _same(_values(ctx, model.fc1(_f32(ctx, np.zeros((1, 4))))), np.zeros((1, 3)),
          "forward while reading a zero bias")
    p.end_read_in_forward(model.fc1, "bias")
    p.end_read_in_forward(model.fc1, "bias")
    _check(model.fc1.bias is param, "module.bias does not read the parameter again")
    # under fully_shard the module reads an attached full tensor: read again after
    full = _f32(ctx, np.ones(3))
    p.attach_tensor(model.fc1, "bias", full)
    p.read_in_forward(model.fc1, "bias", shadow)
    _check(model.fc1.bias is shadow, "module.bias does not read the tensor over an attached one")
    p.end_read_in_forward(model.fc1, "bias")
    p.end_read_in_forward(model.fc1, "bias")
    _check(model.fc1.bias is full, "module.bias does not read the attached full tensor again")
    # a forward cut short (a recomputation stopped early) leaves its read: the next read
    # replaces it and ends where the module read before it
    p.read_in_forward(model.fc1, "bias", shadow)
    p.read_in_forward(model.fc1, "bias", _f32(ctx, np.zeros(3)))
    p.end_read_in_forward(model.fc1, "bias")
    _check(model.fc1.bias is full, "a read left behind is not ended by the next one")
    # ... and what replaced the read since (fully_shard resharding) stays
    p.read_in_forward(model.fc1, "bias", shadow)
    p.attach_tensor(model.fc1, "bias", full)
    p.end_read_in_forward(model.fc1, "bias")
    _check(model.fc1.bias is full, "ending a read replaced since undid the replacement")


@local_check
def check_tensor_math(ctx):
    p = ctx.p
    x = np.array([[0.5, -1.0, 2.0], [3.0, 0.25, -2.0]], np.float32)
    t = _f32(ctx, x)
    _same(_values(ctx, p.amax(t, 1)), x.max(1, keepdims=True), "amax")
    _same(_values(ctx, p.sum_dim(t, 1)), x.sum(1, keepdims=True), "sum_dim")
    _same(_values(ctx, p.exp(t)), np.exp(x), "exp", tol=1e-6)
    _same(_values(ctx, p.log(_f32(ctx, np.abs(x)))), np.log(np.abs(x)), "log", tol=1e-6)
    _same(_values(ctx, p.total(t)), x.sum(), "total")
    _same(_values(ctx, p.subtract(t, 1.0)), x - 1.0, "subtract")
    _same(_values(ctx, p.multiply(t, t)), x * x, "multiply")
    _same(_values(ctx, p.divide(t, 3)), x / np.float32(3), "divide")
    index = _ints(ctx, [[2], [0]])
    _same(_values(ctx, p.take_along_dim(t, index, 1)), [[2.0], [3.0]], "take_along_dim")
    ids = np.array([0, 3, 4, 7, -100], np.int64)
    inside = p.in_range(_ints(ctx, ids), 3, 7)
    _same(_values(ctx, inside), (ids >= 3) & (ids < 7), "in_range")
    _same(_values(ctx, p.not_equal(_ints(ctx, ids), -100)), ids != -100, "not_equal")
    _same(_values(ctx, p.equal(_ints(ctx, ids), 4)), ids == 4, "equal")
    _same(_values(ctx, p.where(inside, _ints(ctx, ids), 0)), np.where(
        (ids >= 3) & (ids < 7), ids, 0), "where over ids")
    keep = p.from_numpy(np.array([[True], [False]]))
    _same(_values(ctx, p.where(keep, t, 0.0)), np.where([[True], [False]], x, 0.0),
          "where, broadcast")


@local_check
def check_framework_cross_entropy(ctx):
    """The framework's own cross entropy of (N, C) logits: mean over the counted rows, sum,
    or per row; ``ignore_index`` rows count zero and leave the mean."""
    p = ctx.p
    logits = np.array([[0.5, -1.0, 2.0, 0.0, 1.5], [1.0, 1.0, -2.0, 0.5, 0.0],
                       [0.0, 3.0, 1.0, -1.0, 2.0], [-0.5, 0.5, 0.0, 1.0, -1.0]], np.float32)
    target = np.array([2, 4, -100, 0])
    shifted = logits - logits.max(1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    counted = target != -100
    per_row = np.where(counted, -logp[np.arange(4), np.where(counted, target, 0)], 0.0)
    expected = {"none": per_row, "sum": per_row.sum(), "mean": per_row.sum() / counted.sum()}
    for reduction, want in expected.items():
        got = p.framework_cross_entropy(_f32(ctx, logits), _ints(ctx, target), -100, reduction)
        np.testing.assert_allclose(_values(ctx, got), want, rtol=1e-6, atol=1e-6,
                                   err_msg=f"framework_cross_entropy, reduction={reduction!r}")


@local_check
def check_framework_tensor_parallel_hooks(ctx):
    """What the framework's own tensor parallelism answers: its style objects are told
    apart from anything else, its loss context can be entered, and a layer it would not
    have split says why."""
    p, side = ctx.p, ctx.side
    _check(p.is_framework_style(object()) is False, "is_framework_style(object()) is not False")
    style = side.framework_style()
    if style is not None:
        _check(p.is_framework_style(style) is True,
               f"is_framework_style({type(style).__name__}()) is not True")
    with p.framework_loss_parallel():
        pass
    _check(p.unsplittable_reason(side.model().fc1) is None,
           "unsplittable_reason of a splittable linear layer is not None")
    layer = side.unsplittable_layer()
    if layer is not None:
        reason = p.unsplittable_reason(layer)
        _check(p.parallel_layer(layer) is None and isinstance(reason, str) and reason,
               f"{type(layer).__name__}: parallel_layer {p.parallel_layer(layer)}, "
               f"unsplittable_reason {reason!r}")


@collective_check()
def check_framework_parallelize(ctx):
    """The framework's own styles applied by its own parallelize_module over the native
    mesh: the layer's weight becomes the framework's distributed tensor; a framework
    without styles refuses."""
    p, side = ctx.p, ctx.side
    model = side.model()
    style = side.framework_style()
    if style is None:
        try:
            p.framework_parallelize(model, ctx.mesh1.native, {}, 0)
        except NotImplementedError:
            return
        _check(False, "framework_parallelize did not raise NotImplementedError on a framework "
                      "without styles of its own")
    returned = p.framework_parallelize(model, ctx.mesh1.native, {"fc1": style}, 0)
    weight = p.registered_param(model.fc1, "weight")
    _check(returned is model, "framework_parallelize did not return the module")
    _check(p.param_local_values(weight) is not weight,
           "the weight a framework style split is not the framework's distributed tensor")
