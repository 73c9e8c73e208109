"""Rank side of tests/test_pipeline.py's Lightning cases (torch only, 2 ranks; needs
lightning-fabric 2.6.6, the ``lightning`` extra): Lightning Fabric's
``ModelParallelStrategy`` with ``hp.fully_shard`` in its ``parallelize_fn``, against the
same run with torch's ``fully_shard``.

Each run trains the same model for a few steps, each step two microbatches with the first
under ``fabric.no_backward_sync(model, enabled=True)``: losses, parameters, how often
Lightning's ``no_backward_sync`` reached a unit's ``set_requires_gradient_sync`` (counted
on the class whose method a unit runs: hyper_parallel's ``FSDPModule`` or FSDP2's; the
method still runs), and the collectives of each step, counted by the same c10d dispatch
counter for both (tests/pipeline_scenarios.py) and, for hyper_parallel, ``hp.track_comms``.
"""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.pipeline_scenarios import _c10d_counter, _hp_counts
from tests.scenarios import _counting

DIM = 16
BLOCKS = 3
STEPS = 3
MICROBATCHES = 2
LOCAL_BATCH = 4


def _model():
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
                           for _ in range(BLOCKS)], nn.Linear(DIM, 1))


def _train(fully_shard) -> dict:
    import torch
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import ModelParallelStrategy

    def parallelize(model, device_mesh):
        mesh = device_mesh["data_parallel"]
        for block in list(model)[:BLOCKS]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    world = hp.get_platform().world_size()
    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=world,
                                     tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()  # the ranks are started already (LOCAL_RANK set): joins this job
    model = fabric.setup_module(_model())
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.3))
    rng = np.random.default_rng(11 + hp.get_platform().rank())
    out = {"losses": [], "collectives": [], "hp_collectives": [], "sync_calls": []}
    method_owner = hp.FSDPModule if fully_shard is hp.fully_shard else _torch_unit_class()
    for _ in range(STEPS):
        counter = _c10d_counter()
        with _counting(method_owner, "set_requires_gradient_sync") as calls, \
                hp.track_comms() as window, counter:
            for micro in range(MICROBATCHES):
                x = torch.from_numpy(rng.standard_normal((LOCAL_BATCH, DIM)).astype(np.float32))
                with fabric.no_backward_sync(model, enabled=micro < MICROBATCHES - 1):
                    loss = model(x).pow(2).mean() / MICROBATCHES
                    fabric.backward(loss)
                out["losses"].append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
        out["collectives"].append(counter.counts)
        out["hp_collectives"].append(_hp_counts(window))
        out["sync_calls"].append(calls[0])
    out["units"] = sum(isinstance(m, method_owner) for m in model.modules())
    out["params"] = {name: p.full_tensor().detach().numpy()
                     for name, p in model.named_parameters()}
    return out


def _torch_unit_class():
    from torch.distributed.fsdp import FSDPModule
    return FSDPModule


def run_no_backward_sync() -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return {"hp": _train(hp.fully_shard), "fsdp2": _train(torch_fully_shard)}
