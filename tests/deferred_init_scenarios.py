"""Rank side of the deferred-initialisation suite: models built without values, sharded,
then given values and trained; parameters replaced after fully_shard; peak host memory.

The model is the kit's small language model with a 3-row head and embedding (uneven over
2 ranks: 2 and 1 rows), the MLP's up-projection sharded on dim 1 (``shard_placement_fn``)
and, in one flow, the head tied to the embedding. Values never come from RNG equality:
every flow gives the sharded model the reference model's values through a supported path,
then trains it ``STEPS`` SGD steps on this rank's slice of each batch, against the
single-process reference on the whole batch and (torch) FSDP2 through the same flow.

torch flows (``TORCH_FLOWS``), each starting from a build under ``torch.device("meta")``
and ``fully_shard`` on meta:
- ``init_then_copy``: ``to_empty(device="cpu")``, ``reset_parameters()`` of every module,
  then the reference's values copied in (``set_model_state_dict(full_state_dict=True)``);
- ``broadcast_assign``: still on meta, ``set_model_state_dict(..., full_state_dict=True,
  broadcast_from_rank0=True)`` (it assigns new sharded parameters), tied head;
- ``load_assign``: still on meta, ``load_state_dict(sd, assign=True)`` with a state dict of
  DTensors laid out as ``model.state_dict()``.
MindSpore: the net is built under ``no_init_parameters()``; ``fully_shard`` materialises only
each rank's shard (LayerNorm's ones/zeros are checked on the shards), then every shard's
values are set from the reference's (``set_data``).

Errors (``run_errors``): a forward still on meta, a parameter replaced by a plain full
tensor (torch) or by one of a wrong shape, MindSpore's ``load_param_into_net`` of full
tensors into a sharded net.
"""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.kit import get_kit
from tests.scenarios import _named

VOCAB, DIM, HIDDEN, BLOCKS = 3, 16, 24, 2
SEQ, LOCAL_BATCH = 8, 2
STEPS = {"torch": 3, "mindspore": 2}
TORCH_FLOWS = {"init_then_copy": {}, "broadcast_assign": {"tie": True}, "load_assign": {}}
# the memory check: LAYERS square layers of WIDTH (fp32), P = 1 GiB
LAYERS, WIDTH = 64, 2048


def _dim1(param):
    """The MLP up-projection ([HIDDEN, DIM]) is sharded on dim 1, everything else on dim 0."""
    from torch.distributed.tensor import Shard

    return Shard(1) if tuple(param.shape) == (HIDDEN, DIM) else None


def _wrap(kit, model, fully_shard, tie):
    placement = _dim1 if kit.name == "torch" else (
        lambda p: 1 if tuple(p.shape) == (HIDDEN, DIM) else None)
    for block in model.blocks:
        fully_shard(block, shard_placement_fn=placement)
    head_unit = [model.embed, model.norm, model.head] if tie else [model.norm, model.head]
    fully_shard(head_unit)
    fully_shard(model)


def _loss(kit, model, ids, targets):
    return kit.lm_loss(model.head(model(kit.ids(ids))), kit.ids(targets))


def _train(kit, model, slice_) -> list:
    opt = kit.optimizer([p for p in kit.params(model) if p.requires_grad], lr=0.1)
    rng = np.random.default_rng(11)
    losses = []
    for _ in range(STEPS[kit.name]):
        world_batch = LOCAL_BATCH * hp.get_platform().world_size()
        ids = rng.integers(0, VOCAB, (world_batch, SEQ))[slice_]
        targets = rng.integers(0, VOCAB, (world_batch, SEQ))[slice_]
        losses.append(kit.grad_step(model, opt, lambda: _loss(kit, model, ids, targets)))
    return losses


def _reference_model(kit, tie):
    ref = kit.LM(VOCAB, DIM, HIDDEN, BLOCKS, tie=tie)
    kit.load(ref, seed=3)
    return ref, {k: kit.to_numpy(v) for k, v in _named(kit, ref).items()}


def _reference(kit, tie) -> tuple:
    """(initial values, losses, trained values) of the single-process reference."""
    ref, values = _reference_model(kit, tie)
    losses = _train(kit, ref, slice(None))
    return values, losses, {k: kit.to_numpy(v) for k, v in _named(kit, ref).items()}


def _diff(full: dict, reference: dict) -> float:
    missing = sorted(set(reference) - set(full))
    assert not missing, f"parameters missing after training: {missing}"
    return max(float(np.abs(full[k] - reference[k]).max()) for k in reference)


# ---------------------------------------------------------------------------- torch
def _torch_meta_model(kit, fully_shard, tie):
    import torch

    with torch.device("meta"):
        model = kit.LM(VOCAB, DIM, HIDDEN, BLOCKS, tie=tie)
    _wrap(kit, model, fully_shard, tie)
    return model


def _torch_give_values(kit, model, flow, values):
    """Give the meta-built, sharded ``model`` the reference ``values`` the flow's way."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import distribute_tensor

    full = {k: torch.from_numpy(v.copy()) for k, v in values.items()}
    if flow == "init_then_copy":
        model.to_empty(device="cpu")
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        assert not any(p.is_meta for p in model.parameters()), "a parameter stayed on meta"
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    elif flow == "broadcast_assign":
        mine = full if hp.get_platform().rank() == 0 else {}
        set_model_state_dict(model, mine, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
    else:
        layout = model.state_dict()
        sharded = {k: distribute_tensor(full[k], v.device_mesh, v.placements)
                   for k, v in layout.items()}
        model.load_state_dict(sharded, assign=True)


def _full_of(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().numpy()
            for n, p in model.named_parameters(remove_duplicate=False)}


def run_torch_flow(flow: str, mine: slice) -> dict:
    from torch.distributed.fsdp import fully_shard

    kit = get_kit()
    tie = TORCH_FLOWS[flow].get("tie", False)
    values, ref_losses, ref_full = _reference(kit, tie)
    result = {"ref_losses": ref_losses}
    for name, shard in (("hp", hp.fully_shard), ("fsdp2", fully_shard)):
        model = _torch_meta_model(kit, shard, tie)
        _torch_give_values(kit, model, flow, values)
        result[f"{name}_losses"] = _train(kit, model, mine)
        full = hp.gather_full_state_dict(model) if name == "hp" else _full_of(model)
        result[f"{name}_ref_diff"] = _diff(full, ref_full)
        result[f"{name}_full"] = full
    result["fsdp2_diff"] = _diff(result.pop("hp_full"), result.pop("fsdp2_full"))
    return result


def _torch_errors(kit) -> dict:
    import torch

    ids = np.zeros((LOCAL_BATCH, SEQ), np.int64)
    messages = {}
    model = _torch_meta_model(kit, hp.fully_shard, False)
    messages["meta_forward"] = _error_of(lambda: _loss(kit, model, ids, ids))
    model = _torch_meta_model(kit, hp.fully_shard, False)
    model.to_empty(device="cpu")
    model.head.weight = torch.nn.Parameter(torch.zeros(VOCAB, DIM))
    messages["plain_full"] = _error_of(lambda: _loss(kit, model, ids, ids))
    model = _torch_meta_model(kit, hp.fully_shard, False)
    model.to_empty(device="cpu")
    model.head.weight = torch.nn.Parameter(torch.zeros(VOCAB + 1, DIM))
    messages["wrong_shape"] = _error_of(lambda: _loss(kit, model, ids, ids))
    return messages


# ---------------------------------------------------------------------------- MindSpore
def _ms_lazy_model(kit):
    from mindspore.nn.utils import no_init_parameters

    with no_init_parameters():
        model = kit.LM(VOCAB, DIM, HIDDEN, BLOCKS)
    lazy = all(p.has_init for p in model.get_parameters())
    _wrap(kit, model, hp.fully_shard, False)
    return model, lazy


def _shard_of(fsdp_param, full: np.ndarray) -> np.ndarray:
    """This rank's stored shard of ``full`` (torch.chunk rows of the shard dim, zero-padded
    to the chunk on MindSpore), as the user computes it to load a shard."""
    moved = np.moveaxis(full, fsdp_param.shard_dim, 0)
    rows = moved[fsdp_param.start:fsdp_param.start + fsdp_param.local_rows]
    pad = np.zeros((fsdp_param.stored_rows - len(rows), *moved.shape[1:]), full.dtype)
    return np.moveaxis(np.concatenate([rows, pad]), 0, fsdp_param.shard_dim)


def _ms_units(model):
    from hyper_parallel.fully_shard.state import STATE_ATTR

    states = []
    for _, cell in hp.get_platform().named_modules(model):
        state = cell.__dict__.get(STATE_ATTR)
        if state is not None and state.groups and all(state is not s for s in states):
            states.append(state)
    return [fp for state in states for fp in state.params]


def run_ms_flow(mine: slice) -> dict:
    kit = get_kit()
    values, ref_losses, ref_full = _reference(kit, False)
    model, lazy = _ms_lazy_model(kit)
    params = _ms_units(model)
    norm_gamma = next(fp for fp in params if fp.fqn.endswith("norm.gamma"))
    initialised = {"all_lazy_before": lazy,
                   "no_lazy_after": not any(fp.sharded_param.has_init for fp in params),
                   "shard_shapes": all(tuple(fp.sharded_param.shape)[fp.shard_dim] == fp.stored_rows
                                       for fp in params),
                   "gamma_ones": bool((kit.to_numpy(norm_gamma.sharded_param)
                                       [:norm_gamma.local_rows] == 1).all())}
    names = {id(cell): name for name, cell in hp.get_platform().named_modules(model)}
    for fp in params:  # the user loads each shard of the reference's values
        cell, attr = fp.slots[0]
        key = f"{names[id(cell)]}.{attr}" if names[id(cell)] else attr
        fp.sharded_param.set_data(kit.tensor(_shard_of(fp, values[key])))
    losses = _train(kit, model, mine)
    return {"ref_losses": ref_losses, "hp_losses": losses, "initialised": initialised,
            "hp_ref_diff": _diff(hp.gather_full_state_dict(model), ref_full)}


def _ms_errors(kit) -> dict:
    import mindspore as ms

    ids = np.zeros((LOCAL_BATCH, SEQ), np.int64)
    _, values = _reference_model(kit, False)
    model, _ = _ms_lazy_model(kit)
    full = {k: ms.Parameter(kit.tensor(v), name=k) for k, v in values.items()}
    messages = {"load_full": _error_of(lambda: ms.load_param_into_net(model, full))}
    model, _ = _ms_lazy_model(kit)
    model.head.weight = ms.Parameter(kit.tensor(values["head.weight"]), name="head.weight")
    messages["plain_full"] = _error_of(lambda: _loss(kit, model, ids, ids))
    model, _ = _ms_lazy_model(kit)
    model.head.weight = ms.Parameter(kit.tensor(np.zeros((VOCAB + 1, DIM), np.float32)),
                                     name="head.weight")
    messages["wrong_shape"] = _error_of(lambda: _loss(kit, model, ids, ids))
    return messages


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return f"{type(error).__name__}: {error}"
    return ""


# ---------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_memory() -> dict:
    """Peak RSS growth while building LAYERS x WIDTH^2 fp32 parameters without values,
    sharding them and giving each rank's shard values (torch: meta, to_empty and a fill;
    MindSpore: no_init_parameters, whose shards fully_shard materialises)."""
    kit = get_kit()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    if kit.name == "torch":
        import torch

        with torch.device("meta"):
            model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                          for _ in range(LAYERS)])
        for layer in model:
            hp.fully_shard(layer)
        hp.fully_shard(model)
        model.to_empty(device="cpu")
        for p in model.parameters():
            torch.nn.init.constant_(p, 0.01)  # touches this rank's shard only
    else:
        from mindspore.nn.utils import no_init_parameters

        with no_init_parameters():
            model = kit.nn.SequentialCell([kit.nn.Dense(WIDTH, WIDTH, has_bias=False)
                                           for _ in range(LAYERS)])
        for layer in model:
            hp.fully_shard(layer)
        hp.fully_shard(model)
    peak = _status_kib("VmHWM")
    total = LAYERS * WIDTH * WIDTH * 4
    return {"peak_growth": (peak - before) * 1024, "total": total, "largest": WIDTH * WIDTH * 4}


def run_all() -> dict:
    kit = get_kit()
    platform = hp.get_platform()
    rank = platform.rank()
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    out = {"memory": run_memory(), "world": platform.world_size()}
    if kit.name == "torch":
        out.update({flow: run_torch_flow(flow, mine) for flow in TORCH_FLOWS})
        out["errors"] = _torch_errors(kit)
    else:
        out["lazy_init"] = run_ms_flow(mine)
        out["errors"] = _ms_errors(kit)
    return out
