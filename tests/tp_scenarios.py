"""Rank-side scenarios of the tensor-parallel suite (test_tensor_parallel.py): torch, 4 ranks.

The mesh is (dp=2, tp=2), rank = 2 * dp + tp. A small attention + MLP model is
parallelized over "tp" (``ColwiseParallel`` / ``RowwiseParallel``; its head stays a plain
parameter, replicated over tp) and then sharded over "dp" three ways, all from the same
initial values, trained the same SGD steps on this rank's dp slice of each global batch
(ranks of one tp group get the same slice):

- ``hp``: ``hp.fully_shard(..., mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))``;
- ``hp_dp_mesh``: ``hp.fully_shard(..., mesh=mesh["dp"])`` (the 1-D data-parallel slice);
- ``fsdp2``: torch's ``fully_shard(..., mesh=mesh["dp"])`` (FSDP2 + TP; FSDP2's
  ``dp_mesh_dims`` form wants parameters that are DTensors over the whole 2-D mesh, which
  ``parallelize_module`` over ``mesh["tp"]`` does not make);

next to a single-process reference on the whole global batch. Then a DCP checkpoint of the
hp model is loaded into a fresh hp model and into a fresh FSDP2 model.
"""

from __future__ import annotations

import math

import numpy as np

DIM, HEAD_DIM, HIDDEN, D_OUT = 8, 2, 16, 4
GLOBAL_BATCH, SEQ, STEPS, LR = 4, 3, 3, 0.1


def layer_classes() -> tuple:
    """``(Attention, MLP)``: the blocks of the suite's tensor-parallel models, each with its
    residual; their linear layers are what the tensor-parallel plans split."""
    import torch
    import torch.nn as nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
            self.o = nn.Linear(DIM, DIM)

        def forward(self, x):
            b, t, _ = x.shape

            def heads(y):  # this rank's heads under tensor parallelism, all of them without
                return y.view(b, t, y.shape[-1] // HEAD_DIM, HEAD_DIM).transpose(1, 2)

            q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM), dim=-1)
            y = (att @ v).transpose(1, 2).reshape(b, t, -1)
            return x + self.o(y)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    return Attention, MLP


def _model_class():
    import torch.nn as nn

    Attention, MLP = layer_classes()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp, self.head = Attention(), MLP(), nn.Linear(DIM, D_OUT)

        def forward(self, x):
            return self.head(self.mlp(self.attn(x)))

    return Model


def _new_model(seed: int):
    import torch

    torch.manual_seed(seed)
    return _model_class()()


def layer_plan(prefix: str = "") -> dict:
    """The tensor-parallel plan of an ``Attention`` at ``{prefix}attn`` and an ``MLP`` at
    ``{prefix}mlp``: column-parallel in, row-parallel out."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {f"{prefix}attn.q": ColwiseParallel(), f"{prefix}attn.k": ColwiseParallel(),
            f"{prefix}attn.v": ColwiseParallel(), f"{prefix}attn.o": RowwiseParallel(),
            f"{prefix}mlp.up": ColwiseParallel(), f"{prefix}mlp.down": RowwiseParallel()}


def _tp_model(seed: int, tp_mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(_new_model(seed), tp_mesh, layer_plan())


def _batches():
    rng = np.random.default_rng(11)
    return [(rng.standard_normal((GLOBAL_BATCH, SEQ, DIM)).astype(np.float32),
             rng.standard_normal((GLOBAL_BATCH, SEQ, D_OUT)).astype(np.float32))
            for _ in range(STEPS)]


def _train(model, batches, rows: slice) -> list:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(torch.tensor(x[rows])), torch.tensor(y[rows]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _full(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().copy()
            for n, p in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float(np.abs(a[n] - b[n]).max()) if a[n].shape == b[n].shape else math.inf
               for n in a)


def _layout(model) -> dict:
    """Per parameter: (placements, mesh ranks, global shape, local values)."""
    return {n: (str(tuple(p.placements)), p.device_mesh.mesh.tolist(), tuple(p.shape),
                p.to_local().detach().numpy().copy())
            for n, p in model.named_parameters()}


def _meta_built_checkpointed(mesh, initial: dict, batches, rows: slice) -> tuple:
    """The hp model built on the meta device, its blocks under activation checkpointing
    (torchtitan's order: tensor parallelism, checkpoint wrapper, fully_shard), materialised
    by ``to_empty`` after fully_shard and given ``initial`` as torchtitan's trainer does:
    ``(losses, full parameters)`` after training."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    import hyper_parallel as hp

    with torch.device("meta"):
        model = _model_class()()
    parallelize_module(model, mesh["tp"], layer_plan())
    model.attn, model.mlp = checkpoint_wrapper(model.attn), checkpoint_wrapper(model.mlp)
    for unit in (model.attn, model.mlp, model):
        hp.fully_shard(unit, mesh=mesh["dp"])
    model.to_empty(device="cpu")

    def canonical(name):
        return name.replace("._checkpoint_wrapped_module", "")

    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(distribute_tensor(torch.tensor(initial[canonical(name)]),
                                          param.device_mesh, param.placements))
    losses = _train(model, batches, rows)
    return losses, {canonical(name): value for name, value in _full(model).items()}


def run_all(checkpoint_dir: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import hyper_parallel as hp

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    batches = _batches()
    per_dp = GLOBAL_BATCH // 2
    rows = slice(rank // 2 * per_dp, (rank // 2 + 1) * per_dp)
    dims = hp.DataParallelMeshDims(shard="dp")

    def hp_model(seed, **where):
        model = _tp_model(seed, mesh["tp"])
        for unit in (model.attn, model.mlp, model):
            hp.fully_shard(unit, **where)
        return model

    def fsdp2_model(seed):
        model = _tp_model(seed, mesh["tp"])
        for unit in (model.attn, model.mlp, model):
            torch_fully_shard(unit, mesh=mesh["dp"])
        return model

    result = {}
    # a Partial DTensor is refused before anything changes
    from torch.distributed.tensor import DTensor, Partial

    linear = torch.nn.Linear(4, 4)
    linear.weight = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh["tp"],
                                                          [Partial()], run_check=False))
    before = linear.weight
    try:
        hp.fully_shard(linear, mesh=mesh, dp_mesh_dims=dims)
        result["partial_error"] = None
    except ValueError as error:
        result["partial_error"] = str(error)
    result["partial_untouched"] = type(linear) is torch.nn.Linear and linear.weight is before

    ref = _new_model(0)
    initial = _full(ref)
    result["ref_losses"] = _train(ref, batches, slice(0, GLOBAL_BATCH))
    ref_full = _full(ref)

    model = hp_model(0, mesh=mesh, dp_mesh_dims=dims)
    result["initial_diff"] = _max_diff(_full(model), initial)
    result["losses"] = _train(model, batches, rows)
    full = _full(model)
    result["ref_diff"] = _max_diff(full, ref_full)
    result["moved"] = _max_diff(full, initial)  # training changed the parameters at all
    # the whole tensors, gathered over dp and tp, on every rank
    result["gathered_full_diff"] = _max_diff(hp.gather_full_state_dict(model), ref_full)

    on_dp_mesh = hp_model(0, mesh=mesh["dp"])
    result["dp_mesh_losses"] = _train(on_dp_mesh, batches, rows)
    result["dp_mesh_diff"] = _max_diff(_full(on_dp_mesh), ref_full)
    result["dp_mesh_gathered_full_diff"] = _max_diff(hp.gather_full_state_dict(on_dp_mesh), ref_full)
    # the shard's mesh: made from groups (a data-parallel mesh derived from ``mesh``), or
    # ``mesh["dp"]`` and ``mesh["tp"]`` concatenated (slices of one torch mesh). Compared
    # by value: DTensor's sharding cache hands back the equal mesh of an earlier DTensor of
    # the same layout, made by a job before this one in the shared launch
    result["mesh_from_slices"] = [m.attn.q.weight.device_mesh._get_root_mesh() == mesh
                                  for m in (model, on_dp_mesh)]

    fsdp2 = fsdp2_model(0)
    result["fsdp2_losses"] = _train(fsdp2, batches, rows)
    result["fsdp2_diff"] = _max_diff(_full(fsdp2), full)
    ours, theirs = _layout(model), _layout(fsdp2)
    result["layout_mismatch"] = [
        f"{n}: {ours[n][:3]} vs {theirs[n][:3]}" for n in ours
        if ours[n][:3] != theirs[n][:3] or not np.array_equal(ours[n][3], theirs[n][3])]
    result["placements"] = {n: ours[n][0] for n in ours}
    # a meta-device build (to_empty after fully_shard) with activation checkpointing
    result["meta_checkpointed_losses"], meta_full = _meta_built_checkpointed(
        mesh, initial, batches, rows)
    result["meta_checkpointed_diff"] = _max_diff(meta_full, full)

    # DCP: save the hp model, load it into fresh hp and FSDP2 models (other initial values)
    dcp.save(model.state_dict(), checkpoint_id=checkpoint_dir)
    fresh = hp_model(1, mesh=mesh, dp_mesh_dims=dims)
    result["fresh_differs"] = _max_diff(_full(fresh), full)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dir)
    fresh.load_state_dict(state)
    result["dcp_hp_diff"] = _max_diff(_full(fresh), full)
    fresh_fsdp2 = fsdp2_model(1)
    state = fresh_fsdp2.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dir)
    fresh_fsdp2.load_state_dict(state)
    result["dcp_fsdp2_diff"] = _max_diff(_full(fresh_fsdp2), full)
    # the loaded models train on as the saved one does
    extra = batches[:1]
    result["after_load"] = [_train(m, extra, rows)[0] for m in (model, fresh, fresh_fsdp2)]
    return result
