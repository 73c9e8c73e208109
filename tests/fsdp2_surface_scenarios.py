"""Rank side of tests/test_fsdp2_surface.py: what code written for torch FSDP2 relies on,
once for both frameworks: parameters no backward reached, and the FSDPModule methods.

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


# ---------------------------------------------------------------------------- FSDPModule methods
def _attempt(action) -> tuple:
    """(error type name or None, message) of ``action()``."""
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the error itself is what is checked
        return type(error).__name__, str(error)
    return None, ""


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


# ---------------------------------------------------------------------------- AC + chunked loss
def _build_checkpointed(kit, shard=None):
    """torch: torchtitan's pattern. Pre-norm residual blocks (an RMSNorm-like scale, so
    the recomputation multiplies by a parameter), each wrapped by checkpoint_wrapper and
    then (``shard``) fully_shard applied to the wrapper; the head a unit of its own; the
    model's forward stops before the head."""
    torch, nn = kit.torch, kit.nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class Block(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(dim))
            self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

        def forward(self, x):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
            return x + self.down(torch.relu(self.up(h)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(D_IN, D_HID)
            self.blocks = nn.ModuleList([Block(D_HID, 41) for _ in range(3)])
            self.head = nn.Linear(D_HID, D_OUT)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return x

    model = Model()
    kit.load(model, 0)
    if shard is not None:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
            shard(model.blocks[i])
        shard(model.head)
        shard(model)
    return model


def _chunked_step(kit, model, opt, x, y) -> float:
    """torchtitan's chunked loss: the head's backward alone (which ends a backward, so
    every unit reshards), then the trunk's with the gradient it produced."""
    h = model(kit.tensor(x))
    hd = h.detach().requires_grad_()
    loss = ((model.head(hd) - kit.tensor(y)) ** 2).mean()
    loss.backward()
    h.backward(hd.grad)
    opt.step()
    opt.zero_grad()
    return loss.item()


def run_checkpointed_chunked_loss(kit) -> dict:
    """torch: blocks under checkpoint_wrapper with fully_shard on the wrapper, and the loss
    through a head-only backward first: the recomputation in the trunk's backward reads
    the re-gathered parameters. At parity with the reference and equal to FSDP2."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {"losses": [], "ref_losses": [], "their_losses": []}
    model = _build_checkpointed(kit, hp.fully_shard)
    ref = _build_checkpointed(kit)
    theirs = _build_checkpointed(kit, torch_fully_shard)
    opts = [kit.optimizer(kit.params(m)) for m in (model, ref, theirs)]
    for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=61):
        out["losses"].append(_chunked_step(kit, model, opts[0], x[_local()], y[_local()]))
        out["ref_losses"].append(_chunked_step(kit, ref, opts[1], x, y))
        out["their_losses"].append(_chunked_step(kit, theirs, opts[2], x[_local()], y[_local()]))
    full = hp.gather_full_state_dict(model)
    unwrapped = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in full.items()}
    out["param_diff"] = max(float(np.abs(unwrapped[k] - kit.to_numpy(v)).max())
                            for k, v in _named(kit, ref).items())
    return out


# ---------------------------------------------------------------------------- FSDP2's policies
def _policy_step(kit, model, opt, x, y) -> tuple:
    out = model(kit.tensor(x))
    loss = ((out.float() - kit.tensor(y)) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item(), str(out.dtype)


def run_torch_policies(kit) -> dict:
    """torch: bf16 compute, fp32 reduction, fp32 outputs from the root, input casting off on
    block 1, offloading (CPUOffloadPolicy on the root, OffloadPolicy on the blocks), given
    as hyper_parallel's policies, as FSDP2's policy objects to hp.fully_shard, and as the
    same objects to FSDP2: each run's losses, output dtypes and parameters; FSDP2's
    objects converted by hp.fully_shard; and the TypeError for a policy of the wrong kind."""
    import torch
    from torch.distributed import fsdp

    from hyper_parallel.fully_shard.policy import as_policy

    def policies(mp_class, offload_class, cpu_offload_class, bf16, fp32) -> list:
        """(mp_policy, offload_policy) of block 0, block 1 and the root."""
        return [(mp_class(param_dtype=bf16, reduce_dtype=fp32), offload_class()),
                (mp_class(param_dtype=bf16, reduce_dtype=fp32, cast_forward_inputs=False),
                 offload_class()),
                (mp_class(param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32),
                 cpu_offload_class(pin_memory=False))]

    ours = policies(hp.MixedPrecisionPolicy, hp.OffloadPolicy, hp.CPUOffloadPolicy,
                    "bfloat16", "float32")
    theirs = policies(fsdp.MixedPrecisionPolicy, fsdp.OffloadPolicy, fsdp.CPUOffloadPolicy,
                      torch.bfloat16, torch.float32)
    out = {}
    for name, shard, units in (("ours", hp.fully_shard, ours),
                               ("torch_policies", hp.fully_shard, theirs),
                               ("fsdp2", fsdp.fully_shard, theirs)):
        model = _build_spare(kit)
        kit.load(model, 0)
        for module, (mp, offload) in zip([*model.blocks, model], units):
            shard(module, mp_policy=mp, offload_policy=offload)
        opt = kit.optimizer(kit.params(model), kind="adamw")
        steps = [_policy_step(kit, model, opt, x[_local()], y[_local()])
                 for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=71)]
        out[name] = {"losses": [loss for loss, _ in steps],
                     "out_dtypes": sorted({dtype for _, dtype in steps}),
                     "params": {k: kit.to_numpy(v.full_tensor())
                                for k, v in model.named_parameters()}}
    # hyper_parallel's equivalents, with torch's dtype objects as FSDP2's policies hold them
    same = policies(hp.MixedPrecisionPolicy, hp.OffloadPolicy, hp.CPUOffloadPolicy,
                    torch.bfloat16, torch.float32)
    describe = hp.get_platform().option_from_native
    out["converted"] = [as_policy(their, type(our), "policy", describe) == our
                        for their_pair, our_pair in zip(theirs, same)
                        for their, our in zip(their_pair, our_pair)]
    out["wrong_kind"] = _attempt(lambda: hp.fully_shard(
        _build_spare(kit), offload_policy=fsdp.MixedPrecisionPolicy()))
    return out


# ---------------------------------------------------------------------------- entry point
def run_all() -> dict:
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