"""Rank side of the checkpoint suite, continued: every optimizer with per-parameter state
saved and loaded back on the same framework (run by tests/checkpoint_launches.py)."""

from __future__ import annotations

import os

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
