"""Rank side of tests/test_module_api.py, continued: ``reset_iter_state`` after an exception
that aborts a forward, a backward or the time between them, against an uninterrupted
reference and (torch) FSDP2 (run by ``module_api_scenarios.run_all``)."""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.kit import make_batches
from tests.module_api_scenarios import (
    D_IN, D_OUT, FAIL_STEP, GLOBAL_BATCH, STEPS, InjectedFailure, _attempt, _build,
    _build_normed, _local, _pair, _param_diff, _sees_sharded_params, _torch_mesh, _wrap)


def _arm(kit, model, mode: str) -> list:
    """Make the next step fail once: inside block 0's forward, after its second layer's
    input was computed ("forward"), or when the gradient reaches block 0's output, after
    block 1 and the root issued their reductions ("backward"). Returns hook handles to
    remove after the step."""
    platform = hp.get_platform()
    if mode == "forward":
        layer = model.blocks[0].fc2
        attr = "forward" if kit.name == "torch" else "construct"

        def fail_forward(*args, **kwargs):
            del layer.__dict__[attr]
            raise InjectedFailure("inside forward")

        object.__setattr__(layer, attr, fail_forward)
        return []
    fired = []

    def fail_backward():
        if not fired:
            fired.append(True)
            raise InjectedFailure("inside backward")

    def hook(module, args, kwargs, output):
        if not fired:
            platform.register_grad_hook(output, fail_backward)

    return platform.register_forward_hooks(model.blocks[0], lambda m, a, k: None, hook)


def _failing_step(kit, model, opt, x, y, mode: str) -> str:
    """Run the aborted step; return the exception's type name."""
    handles = []
    if mode == "between":  # the loss computation fails after the forward completed
        y = np.zeros((y.shape[0], y.shape[1] + 1), np.float32)
    else:
        handles = _arm(kit, model, mode)
    try:
        kit.train_step(model, opt, x, y)
    except Exception as error:  # noqa: BLE001 - any exception aborts the step
        return type(error).__name__
    finally:
        for handle in handles:
            handle.remove()
    return "no exception"


def _recover(kit, model, opt) -> None:
    model.reset_iter_state()
    if kit.name == "torch":
        opt.zero_grad()  # the aborted step's gradients, if any reached .grad, are dropped


def run_reset(kit, mode: str) -> dict:
    """A step aborted by an exception, reset_iter_state on the root, then training goes
    on: every later step equals a reference that skipped the aborted step."""
    model, ref = _pair(kit, _build_normed)
    _wrap(model)
    opt, ref_opt = kit.optimizer(kit.params(model)), kit.optimizer(kit.params(ref))
    out = {"losses": [], "ref_losses": []}
    for step, (x, y) in enumerate(make_batches(STEPS + 1, GLOBAL_BATCH, D_IN, D_OUT, seed=21)):
        if step == FAIL_STEP:
            out["raised"] = _failing_step(kit, model, opt, x[_local()], y[_local()], mode)
            out["nested_unit"] = _attempt(model.blocks[0].reset_iter_state)[:2]
            _recover(kit, model, opt)
            out["sharded_after_reset"] = _sees_sharded_params(model)
            continue
        out["losses"].append(kit.train_step(model, opt, x[_local()], y[_local()]))
        out["ref_losses"].append(kit.train_step(ref, ref_opt, x, y))
    out["param_diff"] = _param_diff(kit, model, ref)
    if kit.name == "torch":
        out["their_losses"] = _fsdp2_reset(kit, mode)
    return out


def _fsdp2_reset(kit, mode: str):
    """The same steps with torch's FSDP2 (its losses), or the error FSDP2 raised."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    try:
        theirs = _build_normed(kit)
        kit.load(theirs, 0)
        _wrap(theirs, torch_fully_shard, mesh=_torch_mesh())
        opt = kit.optimizer(kit.params(theirs))
        losses = []
        for step, (x, y) in enumerate(make_batches(STEPS + 1, GLOBAL_BATCH, D_IN, D_OUT, seed=21)):
            if step == FAIL_STEP:
                _failing_step(kit, theirs, opt, x[_local()], y[_local()], mode)
                _recover(kit, theirs, opt)
                continue
            losses.append(kit.train_step(theirs, opt, x[_local()], y[_local()]))
        return losses
    except Exception as error:  # noqa: BLE001 - reported, the test decides
        return f"{type(error).__name__}: {error}"


def run_reset_before_first_forward(kit) -> dict:
    model = _wrap(_build(kit))
    return {"root": _attempt(model.reset_iter_state)[:2],
            "nested": _attempt(model.blocks[0].reset_iter_state)[:2]}
