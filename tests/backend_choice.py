"""Run by test_bad_input.py as ``python -m tests.backend_choice SCENARIO`` in a fresh process
(which frameworks a process imported is the point): how hyper_parallel picks the framework
where HP_BACKEND is unset, and the error where it and the model disagree. Prints one JSON
line of results.

- ``both_imported``: the script imported torch and MindSpore. HP_BACKEND=torch with a
  MindSpore model is refused; unset, ``init_distributed()`` cannot tell and is refused
  (nothing joined), the first model (a Cell) decides, and a torch model after it is refused.
- ``torch_only``: the script imported torch. HP_BACKEND=mindspore with a torch model is
  refused; unset, ``init_distributed()`` picks torch (MindSpore is not imported by it), the
  model trains a step, and a Cell made after importing MindSpore is refused.
- ``leave_twice_<backend>``: a single process shards a model before joining any group
  (MindSpore: a world of one; torch: refused, its meshes need a group), joins, leaves, leaves again (nothing to do),
  is then not joined, and joins again: torch can; MindSpore 2.10 cannot (its collectives
  fail after a rejoin), so the join is refused with an error saying so.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import hyper_parallel as hp


def _state(platform_name: str, module) -> tuple:
    """What fully_shard would change: the class, the parameters, the unit state."""
    if platform_name == "torch":
        params = [id(p) for p in module.parameters()]
    else:
        params = [id(p) for p in module.get_parameters()]
    return type(module).__name__, params, "_hp_state" in module.__dict__


def _refused(framework: str, module, call) -> dict:
    before = _state(framework, module)
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is what is checked
        return {"type": type(error).__name__, "message": str(error),
                "untouched": _state(framework, module) == before}
    return {"type": None, "message": "", "untouched": _state(framework, module) == before}


def _cell():
    import mindspore.nn as nn

    return nn.SequentialCell([nn.Dense(4, 3)])


def _torch_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(4, 3))


def _with_backend(value: str, call):
    os.environ["HP_BACKEND"] = value
    try:
        return call()
    finally:
        del os.environ["HP_BACKEND"]


def both_imported() -> dict:
    import mindspore
    import torch

    mindspore.set_device("CPU")
    cell, model = _cell(), _torch_model()
    out = {"torch_set_cell_given": _with_backend("torch", lambda: _refused(
        "mindspore", cell, lambda: hp.fully_shard(cell)))}
    out["init_unset"] = _refused("mindspore", cell, hp.init_distributed)
    out["joined_after_init"] = [torch.distributed.is_initialized(),
                                bool(mindspore.communication.GlobalComm.INITED)]
    hp.fully_shard(cell)
    out["chosen"] = hp.get_platform().name
    out["output_shape"] = list(cell(mindspore.Tensor(np.ones((2, 4), np.float32))).shape)
    out["torch_model_after"] = _refused("torch", model, lambda: hp.fully_shard(model))
    return out


def torch_only() -> dict:
    import torch

    model = _torch_model()
    out = {"mindspore_set_torch_given": _with_backend("mindspore", lambda: _refused(
        "torch", model, lambda: hp.fully_shard(model)))}
    hp.init_distributed()
    hp.fully_shard(model)
    out["chosen"] = hp.get_platform().name
    loss = model(torch.ones(2, 4)).square().sum()
    loss.backward()
    out["grads"] = [p.grad is not None for p in model.parameters()]
    out["mindspore_imported"] = "mindspore" in sys.modules
    cell = _cell()
    out["cell_after"] = _refused("mindspore", cell, lambda: hp.fully_shard(cell))
    hp.destroy_distributed()
    return out


def leave_twice(backend: str) -> dict:
    os.environ["HP_BACKEND"] = backend
    platform = hp.get_platform()
    model = _torch_model() if backend == "torch" else _cell()
    result = {"before_join": _refused(backend, model, lambda: hp.fully_shard(model))}
    hp.init_distributed()
    hp.destroy_distributed()
    hp.destroy_distributed()
    result["joined_after_leaving"] = platform.is_initialized()
    try:
        hp.init_distributed()
        result["rejoin"] = {"type": None, "world_size": platform.world_size()}
        hp.destroy_distributed()
    except RuntimeError as error:
        result["rejoin"] = {"type": "RuntimeError", "message": str(error),
                            "joined": platform.is_initialized()}
    return result


if __name__ == "__main__":
    scenarios = {"both_imported": both_imported, "torch_only": torch_only,
                 "leave_twice_torch": lambda: leave_twice("torch"),
                 "leave_twice_mindspore": lambda: leave_twice("mindspore")}
    print(json.dumps(scenarios[sys.argv[1]]()))
