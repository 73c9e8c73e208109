"""Rank side of tests/test_pipeline.py's cases of torch code that finds hyper_parallel's
units as FSDP2 units (torch only, 2 ranks): what each of them does with one, and what
``hp.fully_shard`` does with FSDP2's units. Every attempt records ``(error type or None,
message)`` and whether the model was left as it was."""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.fsdp2_surface_scenarios import _attempt


def _model():
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                         nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1))


def _hp_model():
    model = _model()
    for block in list(model)[:2]:
        hp.fully_shard(block)
    hp.fully_shard(model)
    return model


def _snapshot(model) -> list:
    """What a refused call must leave as it was: the class and parameters of every module."""
    return [(type(m), [(n, id(p)) for n, p in m.named_parameters(recurse=False)])
            for m in model.modules()]


def run_all() -> dict:
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, set_model_state_dict)
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    model = _hp_model()
    out["units are FSDP2's FSDPModule"] = [isinstance(m, TorchFSDPModule) for m in model.modules()]
    out["units are ours"] = [isinstance(m, hp.FSDPModule) for m in model.modules()]
    out["state for torch's pipeline stage"] = torch_fully_shard.state(model) is not None

    before = _snapshot(model)
    out["torch fully_shard on a unit"] = _attempt(lambda: torch_fully_shard(model[0]))
    out["torch fully_shard on a unit: unchanged"] = _snapshot(model) == before

    def memory_tracker():
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        with FSDPMemTracker(model, torch.optim.SGD(model.parameters(), lr=0.1)):
            model(torch.ones(2, 8)).sum().backward()
    out["FSDPMemTracker"] = _attempt(memory_tracker)
    out["_set_unshard_async_op"] = _attempt(lambda: model._set_unshard_async_op(True))
    out["_set_unshard_async_op not a bool"] = _attempt(lambda: model._set_unshard_async_op(1))
    out["slice of a unit"] = type(model[0:2]).__name__  # torch's FSDPModule.__new__

    # torch's distributed state-dict helpers: sharded and full, and loading back
    model(torch.ones(2, 8)).sum().backward()  # a trained step: parameters a fresh model lacks
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    sharded = get_model_state_dict(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    ours = hp.gather_full_state_dict(model)
    out["dcp full equals gather_full_state_dict"] = sorted(full) == sorted(ours) and all(
        np.array_equal(full[k].numpy(), ours[k]) for k in ours)
    out["dcp sharded are DTensors"] = all(type(v).__name__ == "DTensor" for v in sharded.values())
    fresh = _hp_model()
    out["fresh differs"] = not all(
        np.array_equal(a.full_tensor().numpy(), b.full_tensor().detach().numpy())
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    set_model_state_dict(fresh, sharded)
    out["dcp loaded equals saved"] = all(
        np.array_equal(a.full_tensor().numpy(), b.full_tensor().detach().numpy())
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))

    # the end of a pipeline step whose backwards never ran through the units (torch's
    # zero-bubble schedules): refused before any collective
    skipped = _hp_model()
    skipped.set_requires_gradient_sync(False)
    skipped(torch.ones(2, 8))
    out["step end, no backward reached the units"] = _attempt(
        lambda: torch_fully_shard.state(skipped)._root_post_backward_final_callback())

    out.update(_torch_fully_shard_over_units())

    theirs = _model()
    for block in list(theirs)[:2]:
        torch_fully_shard(block)
    before = _snapshot(theirs)
    out["hp fully_shard on an FSDP2 unit"] = _attempt(lambda: hp.fully_shard(theirs[0]))
    out["hp fully_shard over FSDP2 units"] = _attempt(lambda: hp.fully_shard(theirs))
    out["hp fully_shard on FSDP2 units: unchanged"] = _snapshot(theirs) == before
    return out


def _torch_fully_shard_over_units() -> dict:
    """torch's fully_shard on a model whose blocks are hyper_parallel's units, against the
    same model all FSDP2: three SGD steps on each rank's own data."""
    import torch
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mixed, theirs = _model(), _model()
    for block in list(mixed)[:2]:
        hp.fully_shard(block)
    for block in list(theirs)[:2]:
        torch_fully_shard(block)
    torch_fully_shard(mixed)
    torch_fully_shard(theirs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (mixed, theirs)]
    rng = np.random.default_rng(5 + hp.get_platform().rank())
    losses = {"mixed": [], "fsdp2": []}
    for _ in range(3):
        x = torch.from_numpy(rng.standard_normal((4, 8)).astype(np.float32))
        for name, model, opt in zip(losses, (mixed, theirs), opts):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(float(loss.detach()))
    return {"torch fully_shard over units: losses": losses,
            "torch fully_shard over units: params equal": all(
                np.array_equal(a.full_tensor().detach().numpy(), b.full_tensor().detach().numpy())
                for a, b in zip(mixed.parameters(), theirs.parameters())),
            "torch fully_shard over units: blocks stay ours": [
                isinstance(block, hp.FSDPModule) for block in list(mixed)[:2]]}
