"""Conformance checks of the platform contract: modules and parameters (gradient delivery:
checks_gradients.py).

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import numpy as np

from hyper_parallel.pipelining.split import module_shell
from hyper_parallel.platform.base import Platform
from tests.platform.conformance import (
    Skip, _arange, _check, _f32, _same, _storage_bytes, _values, collective_check, local_check)
from tests.platform.framework_sides import _model_values, model_reference


@local_check
def check_named_modules(ctx):
    p = ctx.p
    model = ctx.side.model()
    named = p.named_modules(model)
    names = [n for n, _ in named]
    _check(named and named[0][0] == "" and named[0][1] is model,
           f"named_modules must start with ('', root); got {names}")
    _check(sorted(names) == ["", "fc1", "inner", "inner.fc2"],
           f"named_modules names {names}, expected '', 'fc1', 'inner', 'inner.fc2'")
    by_name = dict(named)
    _check(by_name["fc1"] is model.fc1 and by_name["inner.fc2"] is model.inner.fc2,
           "named_modules returned other objects than the submodules")


@local_check
def check_children_and_module_shell(ctx):
    """What pipeline_module_split stands on: a module's registry of children, which a shell
    of it edits (pipelining/split.py: the original untouched, names kept), and the method a
    call runs."""
    p, side = ctx.p, ctx.side
    model = side.model()
    registry, container = p.children_of(model)
    _check(sorted(registry) == ["fc1", "inner"] and not container,
           f"children_of(model) gave {sorted(registry)}, container {container}; expected "
           f"fc1 and inner, not a container")
    shell = module_shell(p, model, {"fc1": model.fc1})
    _check(shell is not model and shell.fc1 is model.fc1 and shell.inner is None,
           "a shell must share the kept child and set a dropped attribute child to None")
    _check(model.inner is not None and [n for n, _ in p.named_modules(shell)] == ["", "fc1"],
           f"a shell changed the original or its names: "
           f"{[n for n, _ in p.named_modules(shell)]}")
    layers = [side.model().fc1 for _ in range(3)]
    stack = side.layer_list(layers)
    registry, container = p.children_of(stack)
    _check(list(registry) == ["0", "1", "2"] and container,
           f"children_of(list) gave {list(registry)}, container {container}")
    part = module_shell(p, stack, {"0": layers[0], "2": layers[2]})
    p.children_changed(part)  # again: refreshing twice changes nothing
    _check([n for n, _ in p.named_modules(part)] == ["", "0", "2"],
           f"a list's shell must keep its entries' names: {[n for n, _ in p.named_modules(part)]}")
    _check([id(m) for m in part] == [id(layers[0]), id(layers[2])] and len(list(stack)) == 3,
           "iterating a list's shell must give the kept entries, the original all three")
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
    _same(_values(ctx, p.forward_function(model)(_f32(ctx, x))), model_reference(x),
          "forward_function(model) called on an input", tol=1e-6)


@local_check
def check_direct_params(ctx):
    p = ctx.p
    model = ctx.side.model()
    _check(p.direct_params(model) == [], f"root has no direct params, got {p.direct_params(model)}")
    fc1 = dict(p.direct_params(model.fc1))
    _check(sorted(fc1) == ["bias", "weight"], f"direct_params(fc1) names {sorted(fc1)}")
    _check(fc1["weight"] is model.fc1.weight and fc1["bias"] is model.fc1.bias,
           "direct_params(fc1) did not return the registered parameter objects")
    _same(_values(ctx, fc1["weight"]), _model_values()["fc1.weight"], "fc1.weight values")
    _check(p.is_tensor(fc1["weight"]), "a direct param is not a tensor")


@local_check
def check_param_requires_grad(ctx):
    p = ctx.p
    model = ctx.side.model()
    _check(p.param_requires_grad(model.fc1.weight) is True, "param_requires_grad of a fresh param")
    ctx.side.set_requires_grad(model.fc1.bias, False)
    _check(p.param_requires_grad(model.fc1.bias) is False, "param_requires_grad of a frozen param")
    frozen = ctx.side.new_param(_arange(2), "conf_frozen", requires_grad=False)
    _check(p.param_requires_grad(frozen) is False, "param_requires_grad(requires_grad=False)")


@local_check
def check_register_param(ctx):
    p = ctx.p
    model = ctx.side.model()
    x = _arange(2, 4) * 0.1
    new_weight = np.full((3, 4), 0.5, np.float32)
    replacement = ctx.side.new_param(new_weight, "fc1.weight")
    p.register_param(model.fc1, "weight", replacement)
    params = dict(p.direct_params(model.fc1))
    _check(params["weight"] is replacement, "direct_params does not return the registered param")
    _check(sorted(params) == ["bias", "weight"], f"names after register_param: {sorted(params)}")
    _check(model.fc1.weight is replacement, "module.weight does not read the registered param")
    values = dict(_model_values(), **{"fc1.weight": new_weight})
    _same(_values(ctx, model(_f32(ctx, x))), model_reference(x, values),
          "forward after register_param", tol=1e-5)
    extra = ctx.side.new_param(_arange(3), "fc1.extra")
    p.register_param(model.fc1, "extra", extra)
    params = dict(p.direct_params(model.fc1))
    _check(params.get("extra") is extra, f"register_param did not add a new name: {sorted(params)}")


@local_check
def check_attach_detach_tensor(ctx):
    p = ctx.p
    model = ctx.side.model()
    param = model.fc1.weight
    x = _arange(2, 4) * 0.1
    full_np = np.full((3, 4), -0.25, np.float32)
    full = p.from_numpy(full_np)
    p.register_param(model.fc1, "weight", param)  # as fully_shard registers the sharded one
    p.attach_tensor(model.fc1, "weight", full)
    _check(model.fc1.weight is full, "after attach_tensor, module.weight is not the tensor")
    registered = dict(p.direct_params(model.fc1))["weight"]
    expected = full if p.capabilities.registers_full_tensors else param
    _check(registered is expected, f"after attach_tensor, direct_params returns {registered!r}; "
           f"registers_full_tensors={p.capabilities.registers_full_tensors}")
    values = dict(_model_values(), **{"fc1.weight": full_np})
    _same(_values(ctx, model(_f32(ctx, x))), model_reference(x, values),
          "forward with the attached tensor", tol=1e-5)
    p.detach_tensor(model.fc1, "weight")
    _check(model.fc1.weight is param, "after detach_tensor, module.weight is not the param")
    _check(dict(p.direct_params(model.fc1))["weight"] is param,
           "after detach_tensor, direct_params does not return the registered param")
    _same(_values(ctx, model(_f32(ctx, x))), model_reference(x), "forward after detach", tol=1e-5)
    p.detach_tensor(model.fc1, "weight")  # detaching twice is harmless
    _check(model.fc1.weight is param, "a second detach_tensor lost the param")


@local_check
def check_default_attach_detach_tensor(ctx):
    """The base class's attach_tensor (an instance attribute shadows the registered
    parameter) and detach_tensor work on every framework, also one that overrides them: the
    module computes with the full tensor while direct_params keeps the registered one."""
    p = ctx.p
    model = ctx.side.model()
    param, x = model.fc1.weight, _arange(2, 4) * 0.1
    full_np = np.full((3, 4), 0.75, np.float32)
    full = p.from_numpy(full_np)
    Platform.attach_tensor(p, model.fc1, "weight", full)
    _check(model.fc1.weight is full, "after Platform.attach_tensor, module.weight is not it")
    _check(dict(p.direct_params(model.fc1))["weight"] is param,
           "Platform.attach_tensor changed the registered parameter")
    _check(Platform.registered_param(p, model.fc1, "weight") is param,
           "Platform.registered_param is not the registered parameter")
    values = dict(_model_values(), **{"fc1.weight": full_np})
    _same(_values(ctx, model(_f32(ctx, x))), model_reference(x, values),
          "forward with the tensor Platform.attach_tensor attached", tol=1e-5)
    Platform.detach_tensor(p, model.fc1, "weight")
    Platform.detach_tensor(p, model.fc1, "weight")  # detaching twice is harmless
    _check(model.fc1.weight is param, "after Platform.detach_tensor, module.weight is not "
           "the registered parameter")
    _same(_values(ctx, model(_f32(ctx, x))), model_reference(x), "forward after detach", tol=1e-5)


@local_check
def check_forward_hooks(ctx):
    p = ctx.p
    model = ctx.side.model()
    x = _arange(2, 4) * 0.1
    seen = []

    def pre(module, args, kwargs):
        seen.append(("pre", module, tuple(_values(ctx, a) for a in args), dict(kwargs)))
        return (p.scale(args[0], 2.0), *args[1:]), kwargs

    def post(module, args, kwargs, output):
        seen.append(("post", module, tuple(_values(ctx, a) for a in args), _values(ctx, output)))
        return p.scale(output, 3.0)

    handles = p.register_forward_hooks(model, pre, post)
    _check(isinstance(handles, list), f"register_forward_hooks returned {type(handles).__name__}")
    out = _values(ctx, model(_f32(ctx, x)))
    _check([s[0] for s in seen] == ["pre", "post"], f"hook calls {[s[0] for s in seen]}")
    _check(seen[0][1] is model and seen[1][1] is model, "hooks did not receive the module")
    _check(len(seen[0][2]) == 1, f"pre-hook saw {len(seen[0][2])} args, expected 1")
    _same(seen[0][2][0], x, "pre-hook args", tol=1e-6)
    _check(seen[0][3] == {}, f"pre-hook kwargs {seen[0][3]}")
    _same(seen[1][3], model_reference(2 * x), "post-hook output (forward of the replaced args)",
          tol=1e-5)
    _same(out, 3 * model_reference(2 * x), "output replaced by the post-hook", tol=1e-5)
    for handle in handles:
        handle.remove()
    seen.clear()
    _same(_values(ctx, model(_f32(ctx, x))), model_reference(x), "forward after remove()",
          tol=1e-5)
    _check(seen == [], f"hooks still ran after remove(): {[s[0] for s in seen]}")

    def pre_none(module, args, kwargs):
        seen.append(("pre", module))

    def post_none(module, args, kwargs, output):
        seen.append(("post", module))
    handles = p.register_forward_hooks(model.inner, pre_none, post_none)
    _same(_values(ctx, model(_f32(ctx, x))), model_reference(x),
          "hooks returning None must leave args and output unchanged", tol=1e-5)
    _check([(s[0], s[1] is model.inner) for s in seen] == [("pre", True), ("post", True)],
           f"hooks on a submodule: {[(s[0], type(s[1]).__name__) for s in seen]}")
    for handle in handles:
        handle.remove()


@local_check
def check_forward_hooks_under_autograd(ctx):
    """A pre-hook's replaced args take part in the gradient (the core gathers in hooks)."""
    p = ctx.p
    model = ctx.side.model()
    x = _arange(2, 4) * 0.1 - 0.3
    weights = _arange(2, 2) + 1
    calls = []

    def pre(module, args, kwargs):
        calls.append("pre")
        return (p.scale(args[0], 2.0),), kwargs

    def post(module, args, kwargs, output):
        calls.append("post")
    handles = p.register_forward_hooks(model, pre, post)
    _, (hooked,), _ = ctx.side.backward(
        lambda xs: ctx.side.weighted_sum(model(xs[0]), weights), [x])
    for handle in handles:
        handle.remove()
    _, (plain,), _ = ctx.side.backward(
        lambda xs: ctx.side.weighted_sum(model(p.scale(xs[0], 2.0)), weights), [x])
    _check(calls == ["pre", "post"], f"hooks under autograd ran {calls}")
    _same(hooked, plain, "gradient through the pre-hook's replaced input", tol=1e-5)


@collective_check()
def check_deferred_and_replaced_params(ctx):
    """A deferred parameter's part is made without the whole (MindSpore: materialised by its
    initializer); a replacement is told from the sharded parameter it replaces."""
    p, w = ctx.p, ctx.world
    deferred = ctx.side.deferred_param((3, 2 * w), "conf.deferred")
    _check(p.is_deferred(deferred), "is_deferred(a parameter without values) is False")
    _check(not p.is_deferred(p.from_numpy(_arange(2, 2))), "is_deferred(a tensor) is True")
    part = p.deferred_part(deferred, 1, 2, 2)
    _check(tuple(p.shape(part)) == (3, 2), f"deferred_part shape {p.shape(part)}, expected (3, 2)")
    if not p.is_deferred(part):  # materialised: the One initializer's values
        _same(p.to_numpy(part), np.ones((3, 2), np.float32), "deferred_part values")
    module = next(m for _, m in p.named_modules(ctx.side.model()) if p.direct_params(m))
    attr, param = p.direct_params(module)[0]
    _check(p.registered_param(module, attr) is param, "registered_param is not the registered one")
    _check(p.registered_param(module, "conf_missing") is None, "registered_param of no parameter")
    full = _arange(2 * w, 3)
    orig = ctx.side.new_param(full, "conf.replaced")
    sharded = p.make_sharded_param(orig, p.from_numpy(full[:2]), ctx.mesh1.native, 0, 0,
                                   (2 * w, 3))
    _check(p.is_shard_like(sharded, sharded), "is_shard_like(a sharded parameter, itself) is False")
    _check(not p.is_shard_like(orig, sharded), "is_shard_like(the full parameter, its shard) is True")
    _check(p.replace_local(orig, p.from_numpy(full[:2])) is False,
           "replace_local turned a plain full parameter into a shard")
    if p.replace_local(sharded, p.from_numpy(full[2:4] if w > 1 else full[:2])):
        _same(p.to_numpy(sharded), full[2:4] if w > 1 else full[:2], "replace_local values")


@collective_check()
def check_make_sharded_param(ctx):
    p, w, r = ctx.p, ctx.world, ctx.rank
    mesh = ctx.mesh1
    full = _arange(2 * w, 3)
    for shard_dim, local_np in ((0, full[2 * r:2 * r + 2]),
                                (1, full.T.copy()[:, 2 * r:2 * r + 2])):
        full_shape = (2 * w, 3) if shard_dim == 0 else (3, 2 * w)
        for requires_grad in (True, False):
            orig = ctx.side.new_param(np.zeros(full_shape, np.float32), f"conf.sharded{shard_dim}",
                                      requires_grad=requires_grad)
            param = p.make_sharded_param(orig, p.from_numpy(local_np), mesh.native, 0,
                                         shard_dim, full_shape)
            _check(p.is_tensor(param), "make_sharded_param did not return a tensor")
            _check(p.param_requires_grad(param) is requires_grad,
                   f"sharded param requires_grad {p.param_requires_grad(param)}, "
                   f"orig {requires_grad}")
            local = p.local_tensor(param)
            _check(p.shape(local) == local_np.shape,
                   f"local_tensor shape {p.shape(local)}, expected {local_np.shape}")
            _same(_values(ctx, local), local_np, f"local_tensor values (shard_dim {shard_dim})")
            _same(p.to_numpy(param), local_np, f"to_numpy(sharded param) is the local shard "
                  f"(shard_dim {shard_dim})")
    big = p.from_numpy(_arange(4, 3))
    owned = p.make_sharded_param(ctx.side.new_param(np.zeros((4, 3), np.float32), "conf.own"),
                                 p.narrow(big, 0, 0, 2), mesh.native, 0, 0, (4, 3))
    _check(_storage_bytes(p.local_tensor(owned)) == 2 * 3 * 4,
           f"a shard made from a narrow keeps {_storage_bytes(p.local_tensor(owned))} bytes: it "
           "must own only its 24 bytes, not the whole parameter's memory")
    p.copy_into(big, p.from_numpy(np.zeros((4, 3), np.float32)))
    _same(p.to_numpy(owned), _arange(4, 3)[:2], "a sharded param must not alias its source")
    replicated = p.make_sharded_param(ctx.side.new_param(np.zeros((2, 3), np.float32), "conf.rep"),
                                      p.from_numpy(_arange(2, 3)), mesh.native, 0, None, (2, 3))
    _check(p.shape(p.local_tensor(replicated)) == (2, 3),
           f"shard_dim=None: local_tensor shape {p.shape(p.local_tensor(replicated))}")
    _same(p.to_numpy(replicated), _arange(2, 3), "shard_dim=None (replicated): to_numpy")
    # backing: the shard (2 rows) at the start of a padded piece of 3 rows the caller owns
    backing = p.cat([p.from_numpy(full[2 * r:2 * r + 2]), p.zeros((1, 3), p.dtype("float32"))], 0)
    backed = p.make_sharded_param(ctx.side.new_param(np.zeros((2 * w, 3), np.float32), "conf.b"),
                                  p.narrow(backing, 0, 0, 2), mesh.native, 0, 0, (2 * w, 3),
                                  backing=backing)
    local = p.local_tensor(backed)
    _check(p.shape(local) == (2, 3), f"backed shard shape {p.shape(local)}")
    _same(_values(ctx, local), full[2 * r:2 * r + 2], "backed shard values")
    # backing is an offer: a platform may keep the shard as a view of it only where views
    # write through (torch does; MindSpore's Parameters own their memory)
    _check(not p.starts_with(backing, local) or _views_write_through(ctx),
           "make_sharded_param(backing=...) kept the shard as a view of its backing where "
           "views do not write through")
    _check(p.starts_with(backing, local) or p.name != "torch",
           "torch's make_sharded_param(backing=...) must keep the shard as a view of its backing")
    if p.starts_with(backing, local):  # kept as a view: updates reach the padded piece
        with p.no_grad():
            p.copy_into(local, p.from_numpy(-full[2 * r:2 * r + 2]))
        _same(_values(ctx, backing), np.concatenate([-full[2 * r:2 * r + 2], np.zeros((1, 3))]),
              "an update of a backed shard must reach its backing, padding untouched")
    param = p.make_sharded_param(ctx.side.new_param(np.zeros((2 * w, 3), np.float32), "conf.g"),
                                 p.from_numpy(full[2 * r:2 * r + 2]), mesh.native, 0, 0,
                                 (2 * w, 3))
    weights = _arange(2, 3, start=r)
    _, _, (grad,) = ctx.side.backward(
        lambda _: ctx.side.weighted_sum(p.local_tensor(param), weights), [], [param])
    _same(grad, weights, "gradient of the sharded param through local_tensor", tol=1e-6)


@collective_check(min_world=4, even=True)
def check_mesh2d_tensor_parallel_param(ctx):
    """param_local_values, make_sharded_param and attach_tensor for a parameter that
    tensor parallelism split over the "shard" dim of the 2-D mesh, sharded further over its
    "replicate" dim (standing in for data parallel)."""
    p = ctx.p
    plain = ctx.side.new_param(_arange(3, 4), "conf.plain")
    _check(p.param_local_values(plain) is plain,
           "param_local_values of a parameter no parallelism split must be the parameter")
    _check(p.full_over_tensor_parallel(plain, plain) is plain,
           "full_over_tensor_parallel of a parameter no parallelism split must return it")
    make = getattr(ctx.side, "tensor_parallel_param", None)
    if make is None:
        raise Skip(f"{p.name} has no tensor-parallel parameters")
    mesh = ctx.mesh2.native
    dp, tp = mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")
    tp_size = mesh.size(1)
    full = _arange(3, 2 * tp_size * 2)  # split on dim 1: tp_size parts, each over 2 dp ranks
    param = make(full, mesh, "shard", 1)
    local = p.param_local_values(param)
    part = full[:, 4 * tp:4 * tp + 4]
    _check(p.shape(local) == (3, 4), f"param_local_values shape {p.shape(local)}, expected (3, 4)")
    _same(_values(ctx, local), part, "param_local_values: this rank's tensor-parallel part")
    sharded = p.make_sharded_param(param, p.narrow(local, 1, 2 * dp, 2), mesh["replicate"], 0, 1,
                                   (3, 4))
    _check(p.shape(sharded) == (3, 4 * tp_size), f"the sharded parameter's shape "
           f"{p.shape(sharded)} must be the tensor-parallel parameter's, (3, {4 * tp_size})")
    _same(_values(ctx, p.local_tensor(sharded)), part[:, 2 * dp:2 * dp + 2],
          "local_tensor of a tensor-parallel sharded parameter")
    block = p.tensor_parallel_block(sharded)
    _check(block == ((3, 4 * tp_size), (0, 4 * tp)), f"tensor_parallel_block {block}, expected "
           f"whole shape (3, {4 * tp_size}) and this rank's part at offset (0, {4 * tp})")
    _same(_values(ctx, p.full_over_tensor_parallel(sharded, p.from_numpy(part))), full,
          "full_over_tensor_parallel: every rank's tensor-parallel part, whole")
    model = ctx.side.model()
    p.register_param(model.fc1, "weight", sharded)
    p.attach_tensor(model.fc1, "weight", p.from_numpy(part))
    attached = model.fc1.weight
    _check(p.shape(attached) == (3, 4 * tp_size), f"attach_tensor of a tensor-parallel part "
           f"must present the tensor-parallel parameter (shape (3, {4 * tp_size})), got "
           f"{p.shape(attached)}")
    _same(_values(ctx, attached), part, "attached tensor-parallel parameter's local values")
    p.detach_tensor(model.fc1, "weight")
    _check(model.fc1.weight is sharded, "after detach_tensor, module.weight is not the param")


def _views_write_through(ctx) -> bool:
    """Whether a write into a leading narrow of a tensor reaches the tensor (torch: yes;
    MindSpore CPU: no, docs/platforms.md: its copy into a narrow even fails)."""
    p = ctx.p
    whole = p.from_numpy(_arange(4, 3))
    try:
        p.copy_into(p.narrow(whole, 0, 0, 2), p.from_numpy(np.full((2, 3), -1.0, np.float32)))
        return bool((_values(ctx, whole)[:2] == -1.0).all())
    except RuntimeError:
        return False


@local_check
def check_starts_with(ctx):
    """True exactly for a leading view whose writes reach the whole; never for a copy or a
    view that starts later."""
    p = ctx.p
    whole = p.from_numpy(_arange(4, 3))
    prefix = p.narrow(whole, 0, 0, 2)
    writes_through = _views_write_through(ctx)
    _check(p.starts_with(whole, prefix) is writes_through,
           f"starts_with(whole, leading narrow) = {p.starts_with(whole, prefix)} but writes to "
           f"the narrow {'do' if writes_through else 'do not'} reach the whole")
    _check(p.starts_with(whole, p.narrow(whole, 0, 1, 2)) is False,
           "starts_with(whole, a narrow from row 1) must be False")
    _check(p.starts_with(whole, p.clone(prefix)) is False, "starts_with(whole, a clone) must be False")
