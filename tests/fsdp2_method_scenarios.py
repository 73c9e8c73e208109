"""Rank side of tests/test_fsdp2_surface.py, continued: every FSDPModule method, trained
against the single-process reference and, on torch, against FSDP2 (run by
``fsdp2_surface_scenarios.run_all``)."""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.fsdp2_surface_scenarios import (
    D_IN, D_OUT, GLOBAL_BATCH, STEPS, _attempt, _build_spare, _local, _param_diff, _wrap)
from tests.kit import make_batches


def _units(model) -> list:
    return [m for _, m in hp.get_platform().named_modules(model) if isinstance(m, hp.FSDPModule)]


def _train(kit, model, ref, seed: int, grad_scale: float = 1.0, kind: str = "sgd",
           before_step=None) -> dict:
    """STEPS steps of hyper_parallel and of the reference (its gradients scaled by
    ``grad_scale``); ``before_step(step)`` runs before each of hyper_parallel's steps."""
    opt = kit.optimizer(kit.params(model), kind=kind)
    ref_opt = kit.optimizer(kit.params(ref), kind=kind)
    out = {"losses": [], "ref_losses": []}
    for step, (x, y) in enumerate(make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=seed)):
        if before_step is not None:
            before_step(step)
        out["losses"].append(kit.train_step(model, opt, x[_local()], y[_local()]))
        out["ref_losses"].append(kit.train_step(ref, ref_opt, x, y, grad_scale=grad_scale))
    out["param_diff"] = _param_diff(kit, model, ref)
    return out


def _their_units(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _fsdp2_losses(kit, seed: int, setup, kind: str = "sgd", wrap_first_layer: bool = False,
                  before_step=None) -> list:
    """torch FSDP2 on the same model and steps, ``setup(model)`` after wrapping."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    theirs = _build_spare(kit)
    kit.load(theirs, 0)
    if wrap_first_layer:
        torch_fully_shard(theirs.blocks[0].fc1)
    _wrap(theirs, torch_fully_shard)
    setup(theirs)
    opt = kit.optimizer(kit.params(theirs), kind=kind)
    losses = []
    for step, (x, y) in enumerate(make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=seed)):
        if before_step is not None:
            before_step(step)
        losses.append(kit.train_step(theirs, opt, x[_local()], y[_local()]))
    return losses


def _pair(kit, wrap_first_layer: bool = False):
    model, ref = _build_spare(kit), _build_spare(kit)
    kit.load(model, 0)
    kit.load(ref, 0)
    if wrap_first_layer:  # a unit whose backward reads none of its parameters
        hp.fully_shard(model.blocks[0].fc1)
    return _wrap(model), ref


def run_divide_factor(kit) -> dict:
    """set_reduce_scatter_divide_factor(4) on 2 ranks: a FutureWarning, and gradients half
    the reference's, as set_gradient_divide_factor(4) gives."""
    import warnings

    model, ref = _pair(kit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_reduce_scatter_divide_factor(4.0)
    out = _train(kit, model, ref, seed=51, grad_scale=0.5)
    out["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
    out["factors"] = [u._hp_state.divide_factor for u in _units(model)]
    if kit.name == "torch":
        def setup(m):
            for unit in _their_units(m):  # FSDP2's applies to one unit
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    unit.set_reduce_scatter_divide_factor(4.0)
                unit.set_force_sum_reduction_for_comms(True)  # gloo has no PreMulSum
        out["their_losses"] = _fsdp2_losses(kit, 51, setup)
    return out


def run_unshard_in_backward(kit) -> dict:
    """The first layer (whose input is the data) as a unit with
    set_unshard_in_backward(False): its backward reads none of its parameters, so no
    all-gather is spent on it before backward, at parity."""
    counts = {}
    for setting in (True, False):
        model, ref = _pair(kit, wrap_first_layer=True)
        model.blocks[0].fc1.set_unshard_in_backward(setting)
        start = hp.comm_stats().calls("all_gather")
        counts[setting] = None
        out = _train(kit, model, ref, seed=52)
        counts[setting] = hp.comm_stats().calls("all_gather") - start
    out["gathers"] = {str(k): v for k, v in counts.items()}
    if kit.name == "torch":
        out["their_losses"] = _fsdp2_losses(
            kit, 52, lambda m: m.blocks[0].fc1.set_unshard_in_backward(False), wrap_first_layer=True)
    return out


def run_all_reduce_hook(kit) -> dict:
    """A hook on every unit halving its reduced gradients (in place on torch, returned on
    MindSpore): training equals the reference with gradients halved, and FSDP2 with the
    same hook; a hook of another shape and a stream are refused."""
    model, ref = _pair(kit)
    calls = []

    def halve(t):
        calls.append(tuple(t.shape))
        if kit.name == "torch":
            t.mul_(0.5)
            return None
        return t * 0.5

    for unit in _units(model):
        unit.set_all_reduce_hook(halve)
    out = _train(kit, model, ref, seed=53, grad_scale=0.5)
    out["calls"] = len(calls)
    out["not_callable"] = _attempt(lambda: model.set_all_reduce_hook(3))
    out["stream"] = _attempt(lambda: model.set_all_reduce_hook(halve, stream=object()))
    bad, bad_ref = _pair(kit)
    bad.set_all_reduce_hook(lambda t: t[:1])
    out["bad_shape"] = _attempt(lambda: _train(kit, bad, bad_ref, seed=53))
    if kit.name == "torch":
        out["their_losses"] = _fsdp2_losses(
            kit, 53, lambda m: [u.set_all_reduce_hook(lambda t: t.mul_(0.5)) for u in _their_units(m)])
    return out


class _Event:
    """Stands for an event recorded after the optimizer step (CPU has no torch.Event)."""

    def __init__(self):
        self.waited = 0

    def wait(self):
        self.waited += 1


def run_post_optim_event(kit) -> dict:
    model, ref = _pair(kit)
    events = []

    def before_step(step):
        if step >= 1:
            events.append(_Event())
            model.set_post_optim_event(events[-1])

    out = _train(kit, model, ref, seed=54, before_step=before_step)
    out["waited"] = [e.waited for e in events]
    out["nested"] = _attempt(lambda: model.blocks[0].set_post_optim_event(_Event()))
    out["no_event"] = _attempt(lambda: model.set_post_optim_event(None))
    return out


def run_separate_reduce_scatter_group(kit) -> dict:
    model, ref = _pair(kit)
    model.set_separate_reduce_scatter_group()
    infos = [g.mesh_info for u in _units(model) for g in u._hp_state.groups]
    separate = all(i.reduce_scatter_group is not i.shard_group for i in infos)
    start = hp.comm_stats().calls("reduce_scatter")
    out = _train(kit, model, ref, seed=55)
    out["reduce_scatters"] = hp.comm_stats().calls("reduce_scatter") - start
    out["separate"] = separate
    model.set_separate_reduce_scatter_group(False)
    out["reset"] = all(i.reduce_scatter_group is i.shard_group for i in infos)
    if kit.name == "torch":
        out["their_losses"] = _fsdp2_losses(kit, 55, lambda m: m.set_separate_reduce_scatter_group())
    return out


def run_reduce_scatter_unused_params(kit) -> dict:
    """set_reduce_scatter_unused_params(True): the layer nobody calls gets zero gradients
    (AdamW's weight decay moves it), as FSDP2 with the same setting."""
    model, ref = _pair(kit)
    before = kit.to_numpy(ref.blocks[1].spare.weight)
    model.set_reduce_scatter_unused_params(True)
    out = _train(kit, model, ref, seed=56, kind="adamw")
    full = hp.gather_full_state_dict(model)
    out["spare_moved"] = float(np.abs(full["blocks.1.spare.weight"] - before).max())
    if kit.name == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        theirs = _build_spare(kit)
        kit.load(theirs, 0)
        _wrap(theirs, torch_fully_shard)
        theirs.set_reduce_scatter_unused_params(True)
        opt = kit.optimizer(kit.params(theirs), kind="adamw")
        out["their_losses"] = [kit.train_step(theirs, opt, x[_local()], y[_local()])
                               for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=56)]
        out["their_spare_moved"] = float(np.abs(
            theirs.blocks[1].spare.weight.full_tensor().detach().numpy() - before).max())
    return out


def run_method_checks(kit) -> dict:
    """Validation and the methods that cannot do anything here."""
    model = _wrap(_build_spare(kit))
    plain = _build_spare(kit)
    out = {}
    for value in (2, 0, -1, True, 1.5, "2"):
        out[f"max_input_buffers {value!r}"] = _attempt(
            lambda v=value: model.set_reduce_scatter_max_input_buffers(v))
    out["max_input_buffers stored"] = [u._hp_state.reduce_scatter_max_input_buffers
                                       for u in _units(model)]
    model.set_reduce_scatter_max_input_buffers(3, recurse=False)
    out["max_input_buffers not recursed"] = [u._hp_state.reduce_scatter_max_input_buffers
                                             for u in _units(model)]
    out["allocate False"] = _attempt(
        lambda: model.set_allocate_memory_from_process_group_for_comm(False))
    out["allocate True"] = _attempt(
        lambda: model.set_allocate_memory_from_process_group_for_comm(True))
    out["symm_mem"] = _attempt(model.set_symm_mem_for_comm)
    out["custom_all_gather"] = _attempt(lambda: model.set_custom_all_gather(object()))
    out["custom_reduce_scatter"] = _attempt(lambda: model.set_custom_reduce_scatter(object()))
    out["share_comm_ctx"] = _attempt(lambda: hp.share_comm_ctx([model, model.blocks[0]]))
    out["share_comm_ctx empty"] = _attempt(lambda: hp.share_comm_ctx([]))
    out["share_comm_ctx plain"] = _attempt(lambda: hp.share_comm_ctx([model, plain]))
    if kit.name == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        theirs = _wrap(_build_spare(kit), torch_fully_shard)
        for value in (2, 0, -1, True, 1.5, "2"):
            out[f"fsdp2 max_input_buffers {value!r}"] = _attempt(
                lambda v=value: theirs.set_reduce_scatter_max_input_buffers(v))[0]
    return out
