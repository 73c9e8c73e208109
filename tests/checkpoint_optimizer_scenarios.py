"""Rank side of the checkpoint suite, continued: every optimizer with per-parameter state
saved and loaded back on the same framework (run by tests/checkpoint_launches.py)."""

from __future__ import annotations

import os

import numpy as np

import hyper_parallel as hp
from tests.checkpoint_scenarios import LR, SGD_LR, STEPS, _sharded, _side, _train
from tests.kit import get_kit


def _optimizers() -> dict:
    """Optimizer factories of this framework: name -> function of the model."""
    if get_kit().name == "torch":
        import torch

        def torch_opt(cls, **kwargs):
            return lambda model: cls(model.parameters(), **kwargs)

        return {"SGD": torch_opt(torch.optim.SGD, lr=SGD_LR),
                "Adam": torch_opt(torch.optim.Adam, lr=LR, amsgrad=True),
                "Adagrad": torch_opt(torch.optim.Adagrad, lr=LR),
                "RMSprop": torch_opt(torch.optim.RMSprop, lr=LR, momentum=0.9, centered=True)}
    from mindspore import nn
    from mindspore.experimental import optim

    def ms_opt(cls, *args, **kwargs):
        return lambda model: cls(model.trainable_params(), *args, **kwargs)

    return {"experimental.Adam": ms_opt(optim.Adam, lr=LR),
            "experimental.Adagrad": ms_opt(optim.Adagrad, lr=LR),
            "nn.SGD": ms_opt(nn.SGD, learning_rate=SGD_LR, momentum=0.9),
            "nn.Momentum": ms_opt(nn.Momentum, SGD_LR, 0.9),
            "nn.Adam": ms_opt(nn.Adam, learning_rate=LR)}


def optimizer_round_trips(work: str) -> dict:
    """Per optimizer of this framework: (the uninterrupted curve, the one resumed from a
    checkpoint into a fresh model and optimizer of the same class), ``STEPS`` steps each."""
    side = _side()
    mesh = (hp.get_platform().world_size(),)
    out = {}
    for name, make in _optimizers().items():
        model, _ = _sharded(side, mesh)
        opt = make(model)
        _train(side, model, opt, 0, STEPS)
        path = os.path.join(work, name)
        hp.save_checkpoint(path, model, opt)
        uninterrupted = _train(side, model, opt, STEPS, STEPS)
        model, _ = _sharded(side, mesh)
        opt = make(model)
        hp.load_checkpoint(path, model, opt)
        out[name] = (uninterrupted, _train(side, model, opt, STEPS, STEPS))
    return out


def _corresponding() -> dict:
    """The optimizers that move between the frameworks (docs/checkpoints.md, "Optimizers"),
    by the same name on both, with the options whose state differs (amsgrad, momentum)."""
    if get_kit().name == "torch":
        import torch

        def torch_opt(cls, **kwargs):
            return lambda model: cls(model.parameters(), **kwargs)

        return {"Adam": torch_opt(torch.optim.Adam, lr=LR),
                "AdamW": torch_opt(torch.optim.AdamW, lr=LR),
                "AdamW-amsgrad": torch_opt(torch.optim.AdamW, lr=LR, amsgrad=True),
                "SGD-momentum": torch_opt(torch.optim.SGD, lr=SGD_LR, momentum=0.9),
                "SGD": torch_opt(torch.optim.SGD, lr=SGD_LR)}
    from mindspore.experimental import optim

    def ms_opt(cls, **kwargs):
        return lambda model: cls(model.trainable_params(), **kwargs)

    return {"Adam": ms_opt(optim.Adam, lr=LR),
            "AdamW": ms_opt(optim.AdamW, lr=LR),
            "AdamW-amsgrad": ms_opt(optim.AdamW, lr=LR, amsgrad=True),
            "SGD-momentum": ms_opt(optim.SGD, lr=SGD_LR, momentum=0.9),
            "SGD": ms_opt(optim.SGD, lr=SGD_LR)}


def _describe(opt) -> dict:
    """What an optimizer's state is made of, values aside: per parameter (in order) each
    state's name and kind (a tensor, zero or not, its dtype; a number, its dtype, shape and
    value), its own numbers, and its param_groups' options."""
    platform = hp.get_platform()
    position = {id(p): i for i, p in enumerate(platform.optimizer_params(opt))}
    per_param, own = [[] for _ in position], []
    for name, owner, tensor in platform.optimizer_state(opt):
        array = np.asarray(platform.to_numpy(tensor))
        if owner is None:
            own.append((name, str(array.dtype), array.reshape(-1).tolist()))
        elif array.ndim == 0:
            per_param[position[id(owner)]].append((name, str(array.dtype), array.item()))
        else:
            per_param[position[id(owner)]].append((name, str(array.dtype), bool(array.any())))
    groups = [{k: v if isinstance(v, (bool, int, float, str, tuple, type(None))) else
               float(platform.to_numpy(v).reshape(-1)[0]) for k, v in g.items() if k != "params"}
              for g in getattr(opt, "param_groups", [])]
    return {"per_param": [sorted(s) for s in per_param], "own": sorted(own), "groups": groups}


def state_across_frameworks(work: str, peer: str) -> dict:
    """Per corresponding optimizer: the state of this framework's own after ``STEPS`` steps
    (saved to ``work``), and, where the other framework saved to ``peer``, the state of a
    fresh one loaded from it, to be equal (``_describe``)."""
    side = _side()
    mesh = (hp.get_platform().world_size(),)
    out = {}
    for name, make in _corresponding().items():
        model, _ = _sharded(side, mesh)
        opt = make(model)
        _train(side, model, opt, 0, STEPS)
        hp.save_checkpoint(os.path.join(work, name), model, opt)
        out[name] = {"own": _describe(opt)}
        if os.path.isdir(os.path.join(peer, name)):
            model, _ = _sharded(side, mesh)
            opt = make(model)
            hp.load_checkpoint(os.path.join(peer, name), model, opt)
            out[name]["loaded"] = _describe(opt)
    return out
