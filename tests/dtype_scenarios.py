"""Rank-side scenarios of tests/test_dtype_and_grad_delivery.py, written once for both
frameworks: a dtype change of a sharded model, and gradients delivered during backward.

Each scenario trains the nested model (two blocks and a head, odd sizes, so shards are
padded) with hyper_parallel on this rank's slice of each global batch and, in the same
process, a single-process reference on the whole batch (and, on torch, torch's own
``fully_shard`` on the same slices). Losses are computed in the model's own dtype (the
kit's train step computes them in float32). ``run_all`` runs several scenarios in one
launch: process start-up costs more than a scenario.
"""

from __future__ import annotations

import numpy as np

import hyper_parallel as hp
from hyper_parallel.fully_shard.param import fsdp_param_of
from hyper_parallel.fully_shard.state import STATE_ATTR
from tests.kit import get_kit, make_batches
from tests.scenarios import D_IN, D_OUT, GLOBAL_BATCH, _build, _named

STEPS = 4
BACK_STEPS = 2      # after the model is cast back to float32
MICRO_BATCHES = 3   # accumulation scenario: K micro-batches, the all-reduce deferred on K-1
SEED = 5


class _TorchSide:
    """What the scenarios need from torch beyond the kit."""

    def __init__(self, kit):
        import torch

        self.torch, self.kit = torch, kit

    def dtype(self, name):
        return getattr(self.torch, name)

    def cast_model(self, model, name):
        model.to(self.dtype(name))

    def optimizer(self, params):
        return self.kit.optimizer(params)

    def record_full_dtypes(self, module, seen):
        module.register_forward_pre_hook(lambda m, args: seen.append(str(m.weight.dtype)))

    def loss(self, model, x, y):
        out = model(self.torch.from_numpy(x))
        return ((out - self.torch.from_numpy(y)) ** 2).mean()

    def step(self, model, opt, x, y) -> tuple:
        """One optimizer step; (loss, the gradients' dtypes the optimizer saw)."""
        loss = self.loss(model, x, y)
        loss.backward()
        grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        return float(loss.item()), grad_dtypes

    def backward(self, model, x, y) -> float:
        """Backward only: the optimizer runs in the post-accumulate-grad hooks."""
        loss = self.loss(model, x, y)
        loss.backward()
        return float(loss.item())

    def on_delivery(self, model, callback):
        """``callback(param, grad)`` from each parameter's post-accumulate-grad hook."""
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(lambda p: callback(p, p.grad))

    def step_one(self, opt, grad):
        """Step an optimizer of one parameter on the gradient just delivered (``.grad``)."""
        opt.step()
        opt.zero_grad()

    def params_np(self, model) -> dict:
        return {k: v.detach().numpy().copy() for k, v in _named(self.kit, model).items()}


class _MindSporeSide:
    """The same on MindSpore: gradients come back from ``value_and_grad``; the per-parameter
    callback is ``Parameter.register_hook``, which sees what the unshard node's backward
    returned for the parameter."""

    def __init__(self, kit):
        import mindspore as ms

        self.ms, self.kit = ms, kit

    def dtype(self, name):
        return getattr(self.ms, name)

    def cast_model(self, model, name):
        model.to(self.dtype(name))

    def optimizer(self, params):
        """The kit's SGD with momentum, by hand: MindSpore's SGD kernels take no float64."""
        return _MomentumSGD(params)

    def record_full_dtypes(self, module, seen):
        module.register_forward_pre_hook(lambda cell, args: seen.append(_ms_name(cell.weight.dtype)))

    def _loss_and_grads(self, model, x, y) -> tuple:
        params = [p for p in self.kit.params(model) if p.requires_grad]

        def forward(x, y):
            return ((model(x) - y) ** 2).mean()

        return self.ms.value_and_grad(forward, None, params)(self.ms.Tensor(x), self.ms.Tensor(y))

    def step(self, model, opt, x, y) -> tuple:
        loss, grads = self._loss_and_grads(model, x, y)
        opt(grads)
        return float(loss.asnumpy()), sorted({_ms_name(g.dtype) for g in grads})

    def backward(self, model, x, y) -> float:
        return float(self._loss_and_grads(model, x, y)[0].asnumpy())

    def on_delivery(self, model, callback):
        for param in self.kit.params(model):
            param.register_hook(lambda grad, param=param: (callback(param, grad), grad)[1])

    def step_one(self, opt, grad):
        opt((grad,))

    def params_np(self, model) -> dict:
        return {k: v.asnumpy().copy() for k, v in _named(self.kit, model).items()}


class _MomentumSGD:
    """``opt(grads)``: torch's SGD with momentum (lr 0.05, momentum 0.9), in any dtype."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.buffers = [None] * len(self.params)

    def __call__(self, grads):
        for i, (param, grad) in enumerate(zip(self.params, grads)):
            buf = grad if self.buffers[i] is None else self.buffers[i] * self.momentum + grad
            self.buffers[i] = buf
            # in the parameter's dtype, as torch's in-place update keeps it
            param.set_data((param - buf * self.lr).astype(param.dtype))


def _ms_name(dtype) -> str:
    return str(dtype).split(".")[-1].lower()


def _side(kit):
    return _TorchSide(kit) if kit.name == "torch" else _MindSporeSide(kit)


def _local(rank: int, world: int, batch: int) -> slice:
    return slice(rank * batch // world, (rank + 1) * batch // world)


def _wrap(model, **options) -> None:
    for block in model.blocks:
        hp.fully_shard(block, **options)
    hp.fully_shard(model, **options)


def _torch_fsdp2(kit, mesh_shape, mp_reduce=None):
    """The nested model under torch's own fully_shard on the same mesh (None: not torch)."""
    if kit.name != "torch":
        return None
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    theirs = _build(kit, "nested")
    kit.load(theirs, SEED)
    mp = MixedPrecisionPolicy(reduce_dtype=getattr(torch, mp_reduce) if mp_reduce else None)
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(theirs, mesh=mesh, mp_policy=mp)
    return theirs


def _fsdp2_full(model) -> dict:
    return {k: v.full_tensor().detach().numpy() for k, v in model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    return max(float(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)).max())
               for k in b)


def _batches(steps: int, batch: int, dtype: str) -> list:
    return [(x.astype(dtype), y.astype(dtype))
            for x, y in make_batches(steps, batch, D_IN, D_OUT, seed=SEED + 1)]


def run_cast(reduce_dtype: str | None = None) -> dict:
    """``model.to(float64)`` after fully_shard, STEPS steps in float64, then back to
    float32 for BACK_STEPS more."""
    kit = get_kit()
    side = _side(kit)
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    model, ref = _build(kit, "nested"), _build(kit, "nested")
    kit.load(model, SEED)
    kit.load(ref, SEED)
    side.cast_model(ref, "float64")
    _wrap(model, mp_policy=hp.MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
    side.cast_model(model, "float64")
    # the library still knows each converted parameter as the shard it manages (what
    # clip_grad_norm_ reads to reduce a shard's norm over its group)
    tracked = [fsdp_param_of(p) is not None for p in kit.params(model)]
    theirs = _torch_fsdp2(kit, (world,), reduce_dtype)
    if theirs is not None:
        side.cast_model(theirs, "float64")
    full_dtypes = []
    side.record_full_dtypes(model.blocks[0].fc1, full_dtypes)
    opt, ref_opt = side.optimizer(kit.params(model)), side.optimizer(kit.params(ref))
    their_opt = side.optimizer(list(theirs.parameters())) if theirs is not None else None
    out = {"losses": [], "ref_losses": [], "their_losses": [], "grad_dtypes": set(),
           "tracked_after_cast": tracked}
    local = _local(rank, world, GLOBAL_BATCH)
    for x, y in _batches(STEPS, GLOBAL_BATCH, "float64"):
        loss, grad_dtypes = side.step(model, opt, x[local], y[local])
        out["losses"].append(loss)
        out["grad_dtypes"].update(grad_dtypes)
        out["ref_losses"].append(side.step(ref, ref_opt, x, y)[0])
        if theirs is not None:
            out["their_losses"].append(side.step(theirs, their_opt, x[local], y[local])[0])
    full = hp.gather_full_state_dict(model)
    out["grad_dtypes"] = sorted(out["grad_dtypes"])
    out["param_dtypes"] = sorted({_dtype_name(platform, p) for p in kit.params(model)})
    out["full_dtypes_in_forward"] = sorted(set(full_dtypes))
    out["gathered_dtypes"] = sorted({str(v.dtype) for v in full.values()})
    out["param_diff"] = _max_diff(full, side.params_np(ref))
    if theirs is not None:
        out["their_param_diff"] = _max_diff(full, _fsdp2_full(theirs))
    out.update(_cast_back(kit, side, model, ref, opt, ref_opt, local))
    return out


def _cast_back(kit, side, model, ref, opt, ref_opt, local) -> dict:
    """Back to float32 after training in float64: parameters, gathers and gradients follow."""
    platform = hp.get_platform()
    side.cast_model(model, "float32")
    side.cast_model(ref, "float32")
    back = {"back_losses": [], "back_ref_losses": [], "back_grad_dtypes": set()}
    for x, y in _batches(BACK_STEPS, GLOBAL_BATCH, "float32"):
        loss, grad_dtypes = side.step(model, opt, x[local], y[local])
        back["back_losses"].append(loss)
        back["back_grad_dtypes"].update(grad_dtypes)
        back["back_ref_losses"].append(side.step(ref, ref_opt, x, y)[0])
    back["back_grad_dtypes"] = sorted(back["back_grad_dtypes"])
    back["back_param_dtypes"] = sorted({_dtype_name(platform, p) for p in kit.params(model)})
    back["back_param_diff"] = _max_diff(hp.gather_full_state_dict(model), side.params_np(ref))
    return back


def _dtype_name(platform, tensor) -> str:
    return _ms_name(platform.dtype_of(tensor)) if platform.name == "mindspore" \
        else str(platform.dtype_of(tensor))


def run_optimizer_in_backward(mesh_shape: tuple) -> dict:
    """One optimizer per parameter, stepped from that parameter's delivery callback during
    backward, against the same model stepped normally (hyper_parallel, the reference, and on
    torch torch's fully_shard with the same hooks). Every callback records whether the
    gradient was there, whether backward was still running and whether the end-of-backward
    drain had started (a gradient delivered as soon as its reduction completes comes
    earlier)."""
    kit = get_kit()
    side = _side(kit)
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    mesh = hp.init_device_mesh(platform.device_type(), mesh_shape,
                               mesh_dim_names=("replicate", "shard"))
    hooked, stepped, ref = (_build(kit, "nested") for _ in range(3))
    for model in (hooked, stepped, ref):
        kit.load(model, SEED)
    _wrap(hooked, mesh=mesh)
    _wrap(stepped, mesh=mesh)
    calls, phase = [], {"draining": False}
    _optimizer_per_parameter(kit, side, hooked, lambda name, grad: calls.append(
        (name, grad is not None, platform.in_backward(), phase["draining"])))
    theirs = _torch_fsdp2(kit, mesh_shape)
    their_calls = []
    if theirs is not None:
        _optimizer_per_parameter(kit, side, theirs,
                                 lambda name, grad: their_calls.append(grad is not None))
    opt, ref_opt = kit.optimizer(kit.params(stepped)), kit.optimizer(kit.params(ref))
    local = _local(rank, world, GLOBAL_BATCH)
    out = {"losses": [], "stepped_losses": [], "ref_losses": [], "per_backward": [],
           "their_calls": []}
    for step, (x, y) in enumerate(_batches(STEPS, GLOBAL_BATCH, "float32")):
        calls.clear()
        phase["draining"] = False
        out["losses"].append(side.backward(hooked, x[local], y[local]))
        out["per_backward"].append(list(calls))
        if step == 0:  # the root's iteration context exists from its first forward on
            _watch_drain(hooked, phase)
        out["stepped_losses"].append(side.step(stepped, opt, x[local], y[local])[0])
        out["ref_losses"].append(side.step(ref, ref_opt, x, y)[0])
        if theirs is not None:
            their_calls.clear()
            side.backward(theirs, x[local], y[local])
            out["their_calls"].append(list(their_calls))
    full = hp.gather_full_state_dict(hooked)
    out["trainable"] = len([p for p in kit.params(hooked) if p.requires_grad])
    out["param_diff_vs_stepped"] = _max_diff(full, hp.gather_full_state_dict(stepped))
    out["param_diff"] = _max_diff(full, side.params_np(ref))
    if theirs is not None:
        out["their_param_diff"] = _max_diff(full, _fsdp2_full(theirs))
    out["sync_collectives"] = hooked.__dict__[STATE_ATTR].iteration.sync_collectives
    return out


def _optimizer_per_parameter(kit, side, model, record) -> None:
    """Each parameter's own optimizer, stepped on its gradient as it is delivered, after
    ``record(name, grad)``."""
    named = _named(kit, model)
    names = {id(p): name for name, p in named.items()}
    optimizers = {id(p): kit.optimizer([p]) for p in named.values()}

    def deliver(param, grad):
        record(names[id(param)], grad)
        side.step_one(optimizers[id(param)], grad)

    side.on_delivery(model, deliver)


def _watch_drain(model, phase) -> None:
    """Mark when the root's end-of-backward drain starts (not the one a forward starts with)."""
    context = model.__dict__[STATE_ATTR].iteration
    drain = context.drain

    def watched():
        phase["draining"] = phase["draining"] or hp.get_platform().in_backward()
        drain()

    context.drain = watched


def run_deferred_all_reduce() -> dict:
    """HSDP 2x2, MICRO_BATCHES micro-batches with the replicate all-reduce deferred on all
    but the last, one optimizer step after them: delivery callbacks per micro-batch, and
    the result against one step on the whole batch."""
    kit = get_kit()
    side = _side(kit)
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    mesh = hp.init_device_mesh(platform.device_type(), (2, world // 2),
                               mesh_dim_names=("replicate", "shard"))
    model, ref = _build(kit, "nested"), _build(kit, "nested")
    kit.load(model, SEED)
    kit.load(ref, SEED)
    _wrap(model, mesh=mesh)
    calls = []
    side.on_delivery(model, lambda param, grad: calls.append(id(param)))
    opt, ref_opt = kit.optimizer(kit.params(model)), kit.optimizer(kit.params(ref))
    batch = 12  # divisible by 4 ranks x 3 micro-batches
    local = _local(rank, world, batch)
    out = {"calls_per_micro_batch": [], "losses": [], "ref_losses": []}

    def before_micro_batch(index, is_last):
        if index:
            out["calls_per_micro_batch"].append(len(calls))
        calls.clear()
        model.set_requires_all_reduce(is_last)

    for x, y in _batches(STEPS, batch, "float32"):
        out["losses"].append(kit.train_step(model, opt, x[local], y[local],
                                            micro_batches=MICRO_BATCHES, sync_fn=before_micro_batch))
        out["calls_per_micro_batch"].append(len(calls))
        out["ref_losses"].append(kit.train_step(ref, ref_opt, x, y))
    out["trainable"] = len([p for p in kit.params(model) if p.requires_grad])
    out["param_diff"] = _max_diff(hp.gather_full_state_dict(model), side.params_np(ref))
    return out


SCENARIOS = {
    "cast": lambda: run_cast(),
    "cast_reduce_float32": lambda: run_cast(reduce_dtype="float32"),
    "optimizer_in_backward": lambda: run_optimizer_in_backward((1, hp.get_platform().world_size())),
    "hsdp_optimizer_in_backward": lambda: run_optimizer_in_backward((2, hp.get_platform().world_size() // 2)),
    "hsdp_deferred_all_reduce": run_deferred_all_reduce,
}


def run_all(names: list) -> dict:
    return {name: SCENARIOS[name]() for name in names}
