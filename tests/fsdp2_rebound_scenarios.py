"""Rank side of tests/test_fsdp2_rebound.py (torch, 2 ranks, HP_TEST_NO_DIST=1 so that the
rank joins its group here, after the rebinding): code written for FSDP2, which calls
``torch.distributed.fsdp.fully_shard`` by attribute, trains on hyper_parallel with that
one public name rebound to ``hp.fully_shard`` before hyper_parallel's torch platform is
first loaded, then on FSDP2 itself with the name restored, from the same start and data."""

from __future__ import annotations

STEPS = 3


def _fsdp2_library_model():
    """What a library written for FSDP2 does: builds a model and shards each block, then
    the root, through the name it looks up at call time."""
    import torch
    import torch.distributed.fsdp
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Tanh()),
                          nn.Sequential(nn.Linear(16, 8), nn.Tanh()), nn.Linear(8, 1))
    for block in list(model)[:2]:
        torch.distributed.fsdp.fully_shard(block)
    torch.distributed.fsdp.fully_shard(model)
    return model


def _train(rank: int) -> dict:
    """Losses of STEPS SGD steps on this rank's batches, the whole parameters after, and
    which of the modules are hyper_parallel's units."""
    import torch

    import hyper_parallel as hp

    model = _fsdp2_library_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy()
              for name, p in model.named_parameters()}
    return {"losses": losses, "params": params,
            "ours": [isinstance(m, hp.FSDPModule) for m in model.modules()]}


def run() -> dict:
    import torch.distributed.fsdp as fsdp

    import hyper_parallel as hp

    torch_fully_shard = fsdp.fully_shard
    fsdp.fully_shard = hp.fully_shard
    try:
        hp.init_distributed()  # loads hyper_parallel's torch platform with the name rebound
        ours = _train(hp.get_platform().rank())
    finally:
        fsdp.fully_shard = torch_fully_shard
    theirs = _train(hp.get_platform().rank())
    hp.destroy_distributed()
    return {"hyper_parallel": ours, "fsdp2": theirs}
