"""Conformance checks of the optional ``StateIO`` part of the contract (platform/state_io.py):
optimizer state read and written, buffers.

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import numpy as np

from hyper_parallel.platform.state_io import StateIO
from tests.platform.conformance import Skip, _arange, _check, _same, _values, local_check


def _state_io(ctx) -> None:
    """Skip unless the platform implements StateIO (a new platform may train first)."""
    if not isinstance(ctx.p, StateIO):
        raise Skip(f"{ctx.p.name} does not implement StateIO")


def _adamw_on_two_params(ctx) -> tuple:
    """(platform, two new parameters, an AdamW over them); skipped without StateIO."""
    _state_io(ctx)
    params = [ctx.side.new_param(_arange(3, 2), "a"), ctx.side.new_param(_arange(4), "b")]
    return ctx.p, params, ctx.side.optimizer("adamw", params)


@local_check
def check_optimizer_state(ctx):
    p, params, opt = _adamw_on_two_params(ctx)
    undo = p.create_optimizer_state(opt)
    state = p.optimizer_state(opt)
    for param in params:
        moments = [t for name, owner, t in state if name == "exp_avg" and owner is param]
        _check(len(moments) == 1, f"optimizer_state lists {len(moments)} exp_avg of a parameter")
        _same(p.to_numpy(moments[0]), np.zeros(p.shape(param), np.float32),
              "a created exp_avg (zeros, shaped like its parameter)")
    if undo is not None:  # the optimizer had no state: undoing leaves it with none again
        undo()
        _check(not [s for s in p.optimizer_state(opt) if s[1] is not None],
               "create_optimizer_state's undo left per-parameter state behind")


@local_check
def check_set_optimizer_state(ctx):
    """optimizer_params in order; what set_optimizer_state writes, optimizer_state reads back
    (tensors shaped like the parameter, per-parameter numbers, the optimizer's own numbers)."""
    p, params, opt = _adamw_on_two_params(ctx)
    _check([id(x) for x in p.optimizer_params(opt)] == [id(x) for x in params],
           "optimizer_params order")
    p.create_optimizer_state(opt)
    listed = p.optimizer_state(opt)
    for param in params:
        values = {}
        for name, owner, tensor in listed:
            if owner is param:
                values[name] = (p.from_numpy(_arange(*p.shape(param), start=1.0))
                                if p.shape(tensor) == p.shape(param) else 3)
        _check("exp_avg" in values, f"optimizer_state lists {sorted(values)} for a parameter")
        p.set_optimizer_state(opt, param, values)
    own = {name: 3 for name, owner, tensor in listed if owner is None
           and int(np.prod(p.shape(tensor))) == 1 and name != "learning_rate"}
    p.set_optimizer_state(opt, None, own)
    for name, owner, tensor in p.optimizer_state(opt):
        if owner is not None and p.shape(tensor) == p.shape(owner):
            _same(_values(ctx, tensor), _arange(*p.shape(owner), start=1.0), f"{name} read back")
        elif owner is not None or name in own:
            _check(float(np.asarray(_values(ctx, tensor)).reshape(-1)[0]) == 3.0,
                   f"{name} read back as {_values(ctx, tensor)}")
    try:
        p.optimizer_params(ctx.side.model())
    except TypeError:
        return
    raise AssertionError("optimizer_params accepted a model")


@local_check
def check_optimizer_options(ctx):
    """A parameter's options are its group's, without the parameters (an AdamW's default
    amsgrad=False, which decides whether a moved checkpoint gives it max_exp_avg_sq)."""
    p, params, opt = _adamw_on_two_params(ctx)
    options = p.optimizer_options(opt, params[1])
    _check(options.get("amsgrad") is False and "lr" in options and "params" not in options,
           f"optimizer_options gave {sorted(options)}, amsgrad {options.get('amsgrad')!r}")


@local_check
def check_buffers(ctx):
    """What a BatchNorm's training forward writes is a parameter (updated_in_forward) or a
    listed buffer, so a checkpoint stores all of it; a non-persistent buffer is not listed."""
    _state_io(ctx)
    p = ctx.p
    bn = ctx.side.batchnorm()
    buffers = p.buffers(bn)
    _check(all(p.is_tensor(t) for _, t in buffers), "buffers lists something not a tensor")
    before = [(name, t, p.to_numpy(t).copy()) for name, t in buffers + p.direct_params(bn)]
    bn(p.from_numpy(_arange(4, 3) * 0.1))
    written = {name for name, t, value in before if not np.array_equal(p.to_numpy(t), value)}
    kept = {name for name, _ in buffers}
    listed = kept | {name for name, t in p.direct_params(bn)
                     if any(t is u for u in p.updated_in_forward(bn))}
    _check(written and written <= listed, f"a BatchNorm's forward wrote {sorted(written)}; "
                                          f"buffers and updated_in_forward list {sorted(listed)}")
    _check("scratch" not in kept, "buffers lists a non-persistent buffer")
