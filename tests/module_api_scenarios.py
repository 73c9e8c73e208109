"""Rank side of tests/test_module_api.py: FSDPModule and fully_shard API semantics, once for
both frameworks.

Every training scenario runs hyper_parallel on this rank's slice of each global batch and a
single-process reference (same initial values, no fully_shard) on the whole batch, in the
same process; on torch it also runs torch's own FSDP2 with the same calls where FSDP2 has
the feature. ``run_all`` runs everything in one launch (``reset_iter_state``'s scenarios:
reset_scenarios.py) and returns plain Python values.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np

import hyper_parallel as hp
from hyper_parallel.fully_shard.mesh import MeshInfo
from hyper_parallel.fully_shard.state import STATE_ATTR
from tests.kit import get_kit, make_batches
from tests.scenarios import _named

STEPS = 5
FAIL_STEP = 2          # the step an injected exception aborts (implicit prefetch is active)
GLOBAL_BATCH = 8
D_IN, D_OUT = 37, 5
D_GEN = 16             # the generate model maps D_GEN -> D_GEN
GEN_STEPS = 3          # submodule rounds per generate call


class InjectedFailure(Exception):
    """The exception the reset scenarios raise on purpose."""


# ---------------------------------------------------------------------------- helpers
def _local() -> slice:
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    return slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)


def _build(kit, head=None):
    return kit.Stack([kit.Block(D_IN, 53, 29), kit.Block(29, 41, 23)],
                     head if head is not None else kit.linear(23, D_OUT))


def _build_normed(kit):
    """As ``_build``, with a LayerNorm before the head: recovery must also leave the
    framework's autograd able to differentiate it (MindSpore kept state of the aborted
    ``value_and_grad`` that failed the next LayerNorm backward)."""
    return _build(kit, kit.norm_then_linear(23, D_OUT))


def _pair(kit, build=_build, seed=0):
    model, ref = build(kit), build(kit)
    kit.load(model, seed)
    kit.load(ref, seed)
    return model, ref


def _wrap(model, shard=hp.fully_shard, **options):
    for block in model.blocks:
        shard(block, **options)
    shard(model, **options)
    return model


def _param_diff(kit, model, ref) -> float:
    full = hp.gather_full_state_dict(model)
    return max(float(np.abs(full[k] - kit.to_numpy(v)).max()) for k, v in _named(kit, ref).items())


def _sees_sharded_params(model) -> bool:
    """Every module computes with its registered (sharded) parameters: no full parameter
    is left attached."""
    platform = hp.get_platform()
    return all(getattr(sub, attr) is p for _, sub in platform.named_modules(model)
               for attr, p in platform.direct_params(sub))


def _attempt(action, model=None):
    """(error type name, message, model untouched?) of ``action()``."""
    platform = hp.get_platform()

    def snapshot():
        if model is None:
            return None
        return (type(model), [id(p) for _, sub in platform.named_modules(model)
                              for _, p in platform.direct_params(sub)])

    before = snapshot()
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the error itself is what is checked
        untouched = snapshot() == before and (model is None or STATE_ATTR not in model.__dict__)
        return type(error).__name__, str(error), untouched
    return None, "", snapshot() == before


def _torch_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (hp.get_platform().world_size(),), mesh_dim_names=("shard",))


# ---------------------------------------------------------------------------- ignored_params
def run_ignored_outside(kit) -> dict:
    """ignored_params holding parameters of a module outside the unit: training is at
    parity and the outsider is left exactly as it was (same object, values, no marks)."""
    model, ref = _pair(kit)
    outsider = kit.linear(4, 3)
    kit.load(outsider, 5)
    strangers = list(kit.params(outsider))
    before = [(id(p), type(p), kit.to_numpy(p)) for p in strangers]
    hp.fully_shard(model.blocks[0], ignored_params={strangers[0]})
    hp.fully_shard(model.blocks[1])
    hp.fully_shard(model, ignored_params=strangers)
    after = list(kit.params(outsider))
    untouched = (
        [(id(p), type(p)) for p in after] == [(i, t) for i, t, _ in before]
        and all(np.array_equal(kit.to_numpy(p), v) for p, (_, _, v) in zip(after, before))
        and not any(getattr(p, a, None) for p in after for a in ("_hp_sharded_by", "_hp_replaced_by"))
        and not isinstance(outsider, hp.FSDPModule)
        and all(id(p) not in {id(q) for q in kit.params(model)} for p in after))
    opt, ref_opt = kit.optimizer(kit.params(model)), kit.optimizer(kit.params(ref))
    losses, ref_losses = [], []
    for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=11):
        losses.append(kit.train_step(model, opt, x[_local()], y[_local()]))
        ref_losses.append(kit.train_step(ref, ref_opt, x, y))
    out = {"losses": losses, "ref_losses": ref_losses, "param_diff": _param_diff(kit, model, ref),
           "outsider_untouched": untouched,
           "outsider_unchanged_by_training": all(
               np.array_equal(kit.to_numpy(p), v) for p, (_, _, v) in zip(after, before))}
    # bad entries: rejected, module untouched
    m = _build(kit)
    out["name_not_param"] = _attempt(lambda: hp.fully_shard(m, ignored_params=["head.bias"]), m)
    m = _build(kit)
    out["bare_param"] = _attempt(lambda: hp.fully_shard(m, ignored_params=m.head.weight), m)
    if kit.name == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        theirs = _build(kit)
        kit.load(theirs, 0)
        mesh = _torch_mesh()
        torch_fully_shard(theirs.blocks[0], mesh=mesh, ignored_params={strangers[0]})
        torch_fully_shard(theirs.blocks[1], mesh=mesh)
        torch_fully_shard(theirs, mesh=mesh, ignored_params=set(strangers))
        their_opt = kit.optimizer(kit.params(theirs))
        out["their_losses"] = [kit.train_step(theirs, their_opt, x[_local()], y[_local()])
                               for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=11)]
    return out


# ---------------------------------------------------------------------------- forward methods
def _build_gen(kit):
    """A Stack with ``generate``: GEN_STEPS rounds of block 0, block 1 and the head, each
    round's output fed to the next; returns every round's output."""
    tanh = kit.torch.tanh if kit.name == "torch" else kit.ops.tanh

    class GenStack(kit.Stack):
        def generate(self, x, rounds=GEN_STEPS):
            outs = []
            for _ in range(rounds):
                x = tanh(self.head(self.blocks[1](self.blocks[0](x))))
                outs.append(x)
            return outs

    return GenStack([kit.Block(D_GEN, 24, D_GEN), kit.Block(D_GEN, 20, D_GEN)],
                    kit.linear(D_GEN, D_GEN))


class _Via:
    """Something kit.train_step can call: ``model.<method>(x)``, its outputs summed."""

    def __init__(self, model, method: str):
        self.model, self.method = model, method

    def __call__(self, x):
        outs = getattr(self.model, self.method)(x)
        total = outs[0]
        for out in outs[1:]:
            total = total + out
        return total

    def parameters(self):
        return self.model.parameters()

    def trainable_params(self):
        return self.model.trainable_params()


def _generate(kit, model, x) -> list:
    with hp.get_platform().no_grad():
        return [kit.to_numpy(o) for o in model.generate(kit.tensor(x))]


def _max_diff(a: list, b: list) -> float:
    return max(float(np.abs(p - q).max()) for p, q in zip(a, b))


def run_forward_method(kit) -> dict:
    """generate() registered on the root: it runs with the full parameters before any
    forward (outputs equal the reference's), it trains (a step whose loss comes from
    generate) and forward steps after it stay at parity."""
    model, ref = _pair(kit, _build_gen)
    _wrap(model)
    hp.register_fsdp_forward_method(model, "generate")
    wrapper = vars(model).get("generate")
    hp.register_fsdp_forward_method(model, "generate")  # twice: the hooks run once
    out = {"wrapped": wrapper is not None, "registered_once": vars(model).get("generate") is wrapper}
    batches = make_batches(STEPS, GLOBAL_BATCH, D_GEN, D_GEN, seed=31)
    x0 = batches[0][0]
    out["generate_first"] = _max_diff(_generate(kit, model, x0), _generate(kit, ref, x0))
    out["sharded_after_generate"] = _sees_sharded_params(model)
    opt, ref_opt = kit.optimizer(kit.params(model)), kit.optimizer(kit.params(ref))
    losses, ref_losses = [], []
    for step, (x, y) in enumerate(batches):
        ours, theirs = (_Via(model, "generate"), _Via(ref, "generate")) if step == 0 else (model, ref)
        losses.append(kit.train_step(ours, opt, x[_local()], y[_local()]))
        ref_losses.append(kit.train_step(theirs, ref_opt, x, y))
    out.update(losses=losses, ref_losses=ref_losses, param_diff=_param_diff(kit, model, ref))
    ours_last = _generate(kit, model, x0)
    out["generate_last"] = _max_diff(ours_last, _generate(kit, ref, x0))
    out["deepcopy"] = _attempt(lambda: copy.deepcopy(model))[:2]
    out["generate_after_deepcopy"] = _max_diff(_generate(kit, model, x0), ours_last)
    # not a unit: a no-op; a unit without the method: ValueError
    plain = _build_gen(kit)
    hp.register_fsdp_forward_method(plain, "generate")
    out["plain_untouched"] = "generate" not in vars(plain)
    out["missing"] = _attempt(lambda: hp.register_fsdp_forward_method(model, "sample"))[:2]
    if kit.name == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

        theirs = _build_gen(kit)
        kit.load(theirs, 0)
        _wrap(theirs, torch_fully_shard, mesh=_torch_mesh())
        torch_register(theirs, "generate")
        fresh = _build_gen(kit)
        kit.load(fresh, 0)
        _wrap(fresh)
        hp.register_fsdp_forward_method(fresh, "generate")
        out["fsdp2_generate"] = _max_diff(_generate(kit, fresh, x0), _generate(kit, theirs, x0))
    return out


# ---------------------------------------------------------------------------- reshard_after_forward
def _state(module):
    return module.__dict__[STATE_ATTR]


def run_reshard_after_forward(kit) -> dict:
    """Validation and mapping of reshard_after_forward (shard group of 2 ranks)."""
    platform = hp.get_platform()
    world = platform.world_size()
    out = {"world": world}
    for value in (0, -1, 3, 1.5, "2"):
        block = kit.Block(8, 12, 6)
        out[f"bad {value!r}"] = _attempt(
            lambda: hp.fully_shard(block, reshard_after_forward=value), block)
    # a sub-group needs a shard group with a non-trivial factor: a 4-rank shard dim over
    # the 2 ranks' group, a mesh that does not cover the job: where the platform frees full
    # parameters (torch) making its post-forward groups is refused before anything changes
    real = hp.init_device_mesh(platform.device_type(), (world,), mesh_dim_names=("shard",))
    four = hp.DeviceMesh(real.device_type, (4,), ("shard",), [real.get_group(0)], real.native)
    block = kit.Block(8, 12, 6)
    out["sub_group"] = _attempt(
        lambda: hp.fully_shard(block, mesh=four, reshard_after_forward=2), block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _build(kit)
        hp.fully_shard(model.blocks[0], reshard_after_forward=1)
        hp.fully_shard(model.blocks[1], reshard_after_forward=world)
        hp.fully_shard(model)
        hp.fully_shard(kit.Block(8, 12, 6), reshard_after_forward=1)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)
                       and "reshard_after_forward=1" in str(w.message)]
    out["stored"] = [_state(model.blocks[0]).reshard_after_forward,
                     _state(model.blocks[1]).reshard_after_forward,
                     _state(model).reshard_after_forward]
    # the setter takes the same values; a rejected value changes no unit
    setter = {}
    for value in (1, world, None, False, True):
        model.set_reshard_after_forward(value)
        setter[repr(value)] = [_state(m).reshard_after_forward for m in (model.blocks[0], model)]
    model.set_reshard_after_forward(False)
    for value in (0, 3, "yes"):
        setter[f"bad {value!r}"] = _attempt(lambda: model.set_reshard_after_forward(value))[:2] + (
            [_state(m).reshard_after_forward for m in (model.blocks[0], model)],)
    (group,) = _state(model.blocks[0]).groups
    real_info = group.mesh_info
    group.mesh_info = MeshInfo(four)  # as if block 0 were sharded over 4 ranks
    try:
        setter["sub_group"] = _attempt(lambda: model.set_reshard_after_forward(2))[:2] + (
            [_state(m).reshard_after_forward for m in (model.blocks[0], model)],)
    finally:
        group.mesh_info = real_info
    out["setter"] = setter
    # 1 keeps block full parameters: no re-gather in backward
    out["gathers"] = {}
    for value in (1, world):
        m = _build(kit)
        for block in m.blocks:  # the root keeps its default
            hp.fully_shard(block, reshard_after_forward=value)
        hp.fully_shard(m)
        opt = kit.optimizer(kit.params(m))
        for x, y in make_batches(2, GLOBAL_BATCH, D_IN, D_OUT, seed=41):
            with hp.track_comms() as comms:
                kit.train_step(m, opt, x[_local()], y[_local()])
        out["gathers"][value] = comms.calls("all_gather")
    if kit.name == "torch":
        out["fsdp2"] = _fsdp2_reshard_after_forward(kit, world)
    return out


def _fsdp2_reshard_after_forward(kit, world: int) -> dict:
    """What torch's FSDP2 does with the same values: the error type, or whether the unit
    reshards after forward (a post-forward mesh)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh, out = _torch_mesh(), {}
    for value in (0, -1, 3, 1.5, "2", 1, world):
        block = kit.Block(8, 12, 6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                torch_fully_shard(block, mesh=mesh, reshard_after_forward=value)
            except Exception as error:  # noqa: BLE001 - the type is what is compared
                out[repr(value)] = type(error).__name__
                continue
        group = block._get_fsdp_state()._fsdp_param_group
        out[repr(value)] = group.post_forward_mesh_info is not None
    return out


# ---------------------------------------------------------------------------- entry point
def run_all() -> dict:
    # reset_scenarios.py imports this file's helpers, so it is imported here
    from tests.reset_scenarios import run_reset, run_reset_before_first_forward

    kit = get_kit()
    out = {"reshard_after_forward": run_reshard_after_forward(kit),
           "ignored_outside": run_ignored_outside(kit),
           "reset_before_first_forward": run_reset_before_first_forward(kit)}
    # MindSpore 2.10 ends the process (segmentation fault) when a backward hook raises
    modes = ("forward", "between", "backward") if kit.name == "torch" else ("forward", "between")
    for mode in modes:
        out[f"reset_{mode}"] = run_reset(kit, mode)
    out["forward_method"] = run_forward_method(kit)
    return out
