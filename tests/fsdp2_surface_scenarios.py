"""Rank side of tests/test_fsdp2_surface.py: what code written for torch FSDP2 relies on,
once for both frameworks: parameters no backward reached, and (fsdp2_method_scenarios.py) the
FSDPModule methods; on torch also fsdp2_torch_scenarios.py.

Training scenarios run hyper_parallel on this rank's slice of each global batch and a
single-process reference (same initial values, no fully_shard) on the whole batch, in the
same process; on torch also torch's FSDP2 where it can run the same steps. ``run_all``
runs everything in one launch and returns plain Python values.
"""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from tests.kit import get_kit, make_batches
from tests.scenarios import _named

STEPS = 5
GLOBAL_BATCH = 8
D_IN, D_HID, D_OUT = 37, 29, 5
EXPERTS = 3
# the expert of each row of the global batch, per step (rows 0-3: rank 0, rows 4-7: rank
# 1): expert 1 is used on rank 1 only, expert 2 by no rank except at step 3 (rank 0)
ROUTES = [[0, 0, 0, 0, 1, 0, 1, 0],
          [0, 0, 0, 0, 0, 1, 0, 0],
          [0, 0, 0, 0, 1, 1, 0, 0],
          [0, 2, 0, 0, 1, 0, 0, 0],
          [0, 0, 0, 0, 0, 0, 0, 1]]


def _local() -> slice:
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    return slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)


def _param_diff(kit, model, ref) -> float:
    full = hp.gather_full_state_dict(model)
    return max(float(np.abs(full[k] - kit.to_numpy(v)).max()) for k, v in _named(kit, ref).items())


# ---------------------------------------------------------------------------- unused parameters
def _build_spare(kit):
    """The suite's Stack whose block 1 holds a layer its forward never calls."""
    model = kit.Stack([kit.Block(D_IN, 53, D_HID), kit.Block(D_HID, 41, 23)], kit.linear(23, D_OUT))
    model.blocks[1].spare = kit.linear(D_HID, 7)
    return model


def _wrap(model, shard=hp.fully_shard, **options):
    for block in model.blocks:
        shard(block, **options)
    shard(model, **options)
    return model


def _accumulation(mode: str, model):
    """(micro-batches, sync_fn) of an accumulation mode for kit.train_step."""
    if mode == "no_sync":
        return 2, lambda i, last: model.set_requires_gradient_sync(last)
    if mode == "defer_all_reduce":
        return 2, lambda i, last: model.set_requires_all_reduce(last)
    return 1, None


def _mesh(kit, mode: str):
    if mode == "defer_all_reduce":  # replicate over both ranks: the all-reduce is deferred
        return hp.init_device_mesh(hp.get_platform().device_type(), (2, 1),
                                   mesh_dim_names=("replicate", "shard"))
    return None


def run_spare(kit, mode: str) -> dict:
    """A layer no rank's forward calls, AdamW with weight decay: on torch it gets no
    gradient (so AdamW leaves it as it was), like the reference and FSDP2; on MindSpore
    ``value_and_grad`` returns zeros for it, as for the reference."""
    model, ref = _build_spare(kit), _build_spare(kit)
    kit.load(model, 0)
    kit.load(ref, 0)
    spare_before = kit.to_numpy(ref.blocks[1].spare.weight)
    _wrap(model, mesh=_mesh(kit, mode))
    opt = kit.optimizer(kit.params(model), kind="adamw")
    ref_opt = kit.optimizer(kit.params(ref), kind="adamw")
    micro, sync_fn = _accumulation(mode, model)
    out = {"losses": [], "ref_losses": []}
    for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=31):
        out["losses"].append(kit.train_step(model, opt, x[_local()], y[_local()],
                                            micro_batches=micro, sync_fn=sync_fn))
        out["ref_losses"].append(kit.train_step(ref, ref_opt, x, y))
    out["param_diff"] = _param_diff(kit, model, ref)
    full = hp.gather_full_state_dict(model)
    out["spare_moved"] = float(np.abs(full["blocks.1.spare.weight"] - spare_before).max())
    out["ref_spare_moved"] = float(np.abs(kit.to_numpy(ref.blocks[1].spare.weight)
                                          - spare_before).max())
    if kit.name == "torch":
        out["grads"] = _torch_grads_after_backward(kit, mode)
        if mode != "defer_all_reduce":  # FSDP2 has no replicate-only deferral to compare
            out["their_losses"], out["their_spare_moved"] = _fsdp2_spare(kit, mode, spare_before)
    return out


def _torch_grads_after_backward(kit, mode: str) -> dict:
    """{name: whether .grad is None} after one step's backward, hyper_parallel and the
    reference."""
    model, ref = _build_spare(kit), _build_spare(kit)
    kit.load(model, 0)
    kit.load(ref, 0)
    _wrap(model, mesh=_mesh(kit, mode))
    micro, sync_fn = _accumulation(mode, model)
    x, y = make_batches(1, GLOBAL_BATCH, D_IN, D_OUT, seed=32)[0]
    xs, ys = np.array_split(x[_local()], micro), np.array_split(y[_local()], micro)
    for i, (mx, my) in enumerate(zip(xs, ys)):
        if sync_fn is not None:
            sync_fn(i, i == micro - 1)
        ((model(kit.tensor(mx)) - kit.tensor(my)) ** 2).mean().backward()
    ((ref(kit.tensor(x)) - kit.tensor(y)) ** 2).mean().backward()
    return {"ours": {n: p.grad is None for n, p in model.named_parameters()},
            "ref": {n: p.grad is None for n, p in ref.named_parameters()}}


def _fsdp2_spare(kit, mode: str, spare_before):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    theirs = _build_spare(kit)
    kit.load(theirs, 0)
    _wrap(theirs, torch_fully_shard)
    opt = kit.optimizer(kit.params(theirs), kind="adamw")
    micro, sync_fn = _accumulation(mode, theirs)
    losses = [kit.train_step(theirs, opt, x[_local()], y[_local()], micro_batches=micro,
                             sync_fn=sync_fn)
              for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=31)]
    moved = float(np.abs(theirs.blocks[1].spare.weight.full_tensor().detach().numpy()
                         - spare_before).max())
    return losses, moved


def _build_routed(kit):
    """torch: experts picked per row by the row's first input (a mixture of experts with
    one unit over all experts), then a block and a head."""
    torch, nn = kit.torch, kit.nn

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(D_IN, D_HID) for _ in range(EXPERTS)])

        def forward(self, x):
            route = x[:, 0].long()
            h = torch.zeros(x.shape[0], D_HID, dtype=x.dtype)
            for i, expert in enumerate(self.experts):
                rows = (route == i).nonzero().flatten()
                if rows.numel():
                    h = h.index_add(0, rows, expert(x[rows]))
            return h

    class Routed(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe, self.block, self.head = Experts(), kit.Block(D_HID, 41, 23), nn.Linear(23, D_OUT)

        def forward(self, x):
            return self.head(self.block(self.moe(x)))

    return Routed()


def run_routed(kit, mode: str) -> dict:
    """torch: ranks use different experts, and some experts no rank uses, AdamW with weight
    decay: the experts some rank used get their gradient on every rank, the others none,
    as in the reference on the global batch; no collective is mismatched."""
    model, ref = _build_routed(kit), _build_routed(kit)
    kit.load(model, 0)
    kit.load(ref, 0)
    options = {"mesh": _mesh(kit, mode)}
    if mode == "bf16":  # the usage counts travel in the reduce dtype
        options["mp_policy"] = hp.MixedPrecisionPolicy(param_dtype="bfloat16",
                                                       reduce_dtype="bfloat16")
    hp.fully_shard(model.moe, **options)
    hp.fully_shard(model.block, **options)
    hp.fully_shard(model, **options)
    opt = kit.optimizer(kit.params(model), kind="adamw")
    ref_opt = kit.optimizer(kit.params(ref), kind="adamw")
    micro, sync_fn = _accumulation(mode, model)
    out = {"losses": [], "ref_losses": [], "grads": [], "ref_grads": []}
    for route, (x, y) in zip(ROUTES, make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=33)):
        x[:, 0] = route
        model.set_requires_gradient_sync(True)
        model.set_requires_all_reduce(True)
        xs, ys = np.array_split(x[_local()], micro), np.array_split(y[_local()], micro)
        loss = 0.0
        for i, (mx, my) in enumerate(zip(xs, ys)):
            if sync_fn is not None:
                sync_fn(i, i == micro - 1)
            step_loss = ((model(kit.tensor(mx)).float() - kit.tensor(my)) ** 2).mean() / micro
            step_loss.backward()
            loss += step_loss.item()
        ref_loss = ((ref(kit.tensor(x)) - kit.tensor(y)) ** 2).mean()
        ref_loss.backward()
        out["grads"].append([n for n, p in model.named_parameters() if p.grad is None])
        out["ref_grads"].append([n for n, p in ref.named_parameters() if p.grad is None])
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        out["losses"].append(loss)
        out["ref_losses"].append(ref_loss.item())
    out["param_diff"] = _param_diff(kit, model, ref)
    return out


# ---------------------------------------------------------------------------- unshard first
def _unshard_blocks(model, how: str) -> None:
    """Before the root's first forward: unshard every block, waited ("async_wait") or not
    ("async") or blocking ("sync")."""
    handles = [block.unshard(async_op=how != "sync") for block in model.blocks]
    if how == "async_wait":
        for handle in handles:
            handle.wait()


def run_unshard_before_first_forward(kit, how: str) -> dict:
    """The blocks are unsharded explicitly before the root's first forward (overlapping the
    first all-gathers with data loading), and again between steps 2 and 3: training is at
    parity, and on torch equals FSDP2's with the same calls."""
    model, ref = _build_spare(kit), _build_spare(kit)
    kit.load(model, 0)
    kit.load(ref, 0)
    _wrap(model)
    opt, ref_opt = kit.optimizer(kit.params(model)), kit.optimizer(kit.params(ref))
    _unshard_blocks(model, how)
    out = {"losses": [], "ref_losses": []}
    for step, (x, y) in enumerate(make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=41)):
        if step == 2:
            _unshard_blocks(model, how)
        out["losses"].append(kit.train_step(model, opt, x[_local()], y[_local()]))
        out["ref_losses"].append(kit.train_step(ref, ref_opt, x, y))
    out["param_diff"] = _param_diff(kit, model, ref)
    if kit.name == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        theirs = _build_spare(kit)
        kit.load(theirs, 0)
        _wrap(theirs, torch_fully_shard)
        their_opt = kit.optimizer(kit.params(theirs))
        _unshard_blocks(theirs, how)
        out["their_losses"] = []
        for step, (x, y) in enumerate(make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=41)):
            if step == 2:
                _unshard_blocks(theirs, how)
            out["their_losses"].append(kit.train_step(theirs, their_opt, x[_local()], y[_local()]))
    return out


# ---------------------------------------------------------------------------- shared by the scenario files
def _attempt(action) -> tuple:
    """(error type name or None, message) of ``action()``."""
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the error itself is what is checked
        return type(error).__name__, str(error)
    return None, ""


# ---------------------------------------------------------------------------- entry point
def run_all() -> dict:
    # the scenario files import this file's helpers, so they are imported here
    from tests.fsdp2_method_scenarios import (
        run_all_reduce_hook, run_divide_factor, run_method_checks, run_post_optim_event,
        run_reduce_scatter_unused_params, run_separate_reduce_scatter_group,
        run_unshard_in_backward)
    from tests.fsdp2_torch_scenarios import run_checkpointed_chunked_loss, run_torch_policies

    kit = get_kit()
    out = {}
    for mode in ("plain", "no_sync", "defer_all_reduce"):
        out[f"spare_{mode}"] = run_spare(kit, mode)
        if kit.name == "torch":
            out[f"routed_{mode}"] = run_routed(kit, mode)
    if kit.name == "torch":
        out["routed_bf16"] = run_routed(kit, "bf16")
    for how in ("async_wait", "async", "sync"):
        out[f"unshard_first_{how}"] = run_unshard_before_first_forward(kit, how)
    out["divide_factor"] = run_divide_factor(kit)
    out["unshard_in_backward"] = run_unshard_in_backward(kit)
    out["all_reduce_hook"] = run_all_reduce_hook(kit)
    out["post_optim_event"] = run_post_optim_event(kit)
    out["separate_reduce_scatter_group"] = run_separate_reduce_scatter_group(kit)
    out["reduce_scatter_unused_params"] = run_reduce_scatter_unused_params(kit)
    out["method_checks"] = run_method_checks(kit)
    if kit.name == "torch":
        out["checkpointed_chunked_loss"] = run_checkpointed_chunked_loss(kit)
        out["torch_policies"] = run_torch_policies(kit)
    return out