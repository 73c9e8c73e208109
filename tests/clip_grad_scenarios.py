"""Rank side of the gradient-clipping suite (test_clip_grad.py).

The kit's small language model (embedding tied to a 37-row head that shards unevenly,
attention blocks, LayerNorms whose parameters stay whole below ``shard_threshold_bytes``)
trains for a few SGD steps with clipping active: even steps clip by the 2-norm, odd steps by
the inf-norm, each with a ``max_norm`` below the gradients' norm; the other norm is read too
(``max_norm=inf`` clips nothing). hyper_parallel's ``clip_grad_norm_`` on this rank's slice
of every batch is compared with a single-process reference on the whole batch that clips
with the framework's own whole-model clipping (torch: ``torch.nn.utils.clip_grad_norm_``;
MindSpore: ``ops.clip_by_global_norm`` for the 2-norm, which is the only norm it clips by,
and the inf-norm read from the gradients and applied by hand). On torch two more runs clip
with ``torch.nn.utils.clip_grad_norm_``: on hyper_parallel's DTensor gradients, and under
torch's FSDP2.

Layouts (``LAYOUTS``):
- ``fsdp``: every block a unit, the head unit holding the tied embedding, the root;
- ``outside``: the final norm's parameters in ``ignored_params`` (outside every unit: their
  gradients are averaged over the ranks by the test, as a user syncs such parameters) and
  the head unit on a replicate-only mesh (its own groups; shard group of one rank);
- ``hsdp``: the ``fsdp`` layout on a 2 x 2 (replicate, shard) mesh, 4 ranks (run inside the
  4-rank launch of tests/hsdp_scenarios.py).
"""

from __future__ import annotations

import math

import numpy as np

import hyper_parallel as hp
from tests.kit import get_kit
from tests.scenarios import _named

VOCAB, DIM, HIDDEN, BLOCKS = 37, 16, 24, 2
SEQ, LOCAL_BATCH = 8, 2
STEPS = {"torch": 4, "mindspore": 2}  # MindSpore CPU steps cost ~10x torch's
THRESHOLD = 128  # bytes: the LayerNorms' and small biases' parameters stay whole
INF = math.inf
# a step clips by CLIP_BY[step % 2] at MAX_NORM[that norm] (below the gradients' norm)
CLIP_BY = (2.0, INF)
MAX_NORM = {2.0: 0.1, INF: 0.01}

LAYOUTS = {"fsdp": {}, "outside": {"ignore_norm": True, "head_replicated": True},
           "hsdp": {"mesh": (2, 2)}}


def _build(kit):
    model = kit.LM(VOCAB, DIM, HIDDEN, BLOCKS, tie=True)
    kit.load(model, seed=3)
    return model


def _wrap(model, layout, fully_shard, mesh, head_mesh, **options) -> list:
    """Wrap ``model`` per ``layout``; returns the parameters left outside every unit."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **options)
    outside = [p for _, p in hp.get_platform().direct_params(model.norm)] \
        if layout.get("ignore_norm") else []
    head_unit = [model.embed, model.head] if outside else [model.embed, model.norm, model.head]
    fully_shard(head_unit, mesh=head_mesh, **options)
    fully_shard(model, mesh=mesh, **options, **({"ignored_params": set(outside)} if outside else {}))
    return outside


def _norm_of(value) -> float:
    if hasattr(value, "full_tensor"):  # torch's clip on DTensor gradients returns a DTensor
        value = value.full_tensor()
    return float(hp.get_platform().to_numpy(value))


class _Clippers:
    """Each way of clipping as ``clip(params, grads, max_norm, norm_type) -> (grads, norm)``;
    ``grads`` is None on torch (the gradients are the parameters' ``.grad``)."""

    def __init__(self, kit):
        self.kit = kit

    def hp(self, params, grads, max_norm, norm_type):
        if grads is None:
            return None, _norm_of(hp.clip_grad_norm_(params, max_norm, norm_type))
        grads, norm = hp.clip_grad_norm_(params, max_norm, norm_type, grads=grads)
        return grads, _norm_of(norm)

    def framework(self, params, grads, max_norm, norm_type):
        if self.kit.name == "torch":
            return None, _norm_of(self.kit.torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type))
        values = [np.abs(g.asnumpy().astype(np.float64)) for g in grads]
        norm = max(float(v.max()) for v in values) if math.isinf(norm_type) else \
            math.sqrt(sum(float((v * v).sum()) for v in values))
        if math.isinf(max_norm):
            return grads, norm
        if norm_type == 2.0:
            return tuple(self.kit.ops.clip_by_global_norm(tuple(grads), max_norm)), norm
        coef = min(max_norm / (norm + 1e-6), 1.0)
        return tuple(g * coef for g in grads), norm


def _train(kit, model, clip, rank_slice, sync_params=()) -> dict:
    """Train STEPS steps clipping with ``clip``; the norms it returned and the losses."""
    params = [p for p in kit.params(model) if p.requires_grad]
    opt = kit.optimizer(params, lr=0.1)
    rng = np.random.default_rng(11)
    world_batch = LOCAL_BATCH * hp.get_platform().world_size()
    synced = {id(p) for p in sync_params}
    out = {"losses": [], "norms": []}
    for step in range(STEPS[kit.name]):
        ids = rng.integers(0, VOCAB, (world_batch, SEQ))[rank_slice]
        targets = rng.integers(0, VOCAB, (world_batch, SEQ))[rank_slice]

        def loss_fn():
            return kit.lm_loss(model.head(model(kit.ids(ids))), kit.ids(targets))

        loss, grads = _backward(kit, loss_fn, params)
        for i, p in enumerate(params):  # parameters outside every unit: the user syncs them
            if id(p) in synced:
                grad = p.grad if grads is None else grads[i]
                hp.get_platform().all_reduce(grad, None, op="avg").wait()
        by = CLIP_BY[step % 2]
        other = CLIP_BY[(step + 1) % 2]
        _, measured = clip(params, grads, INF, other)  # max_norm inf: clips nothing
        grads, clipped_by = clip(params, grads, MAX_NORM[by], by)
        if grads is None:
            opt.step()
            opt.zero_grad()
        else:
            opt(grads)
        out["losses"].append(loss)
        out["norms"].append({by: clipped_by, other: measured})
    return out


def _backward(kit, loss_fn, params):
    if kit.name == "torch":
        loss = loss_fn()
        loss.backward()
        return float(loss.item()), None
    loss, grads = kit.ms.value_and_grad(loss_fn, None, params)()
    return float(loss.asnumpy()), grads


def _full_torch(kit, model) -> dict:
    """torch FSDP2's full parameters, a tied one under each of its names."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().numpy()
            for n, p in _named(kit, model).items()}


def _diff(full: dict, reference: dict) -> float:
    assert set(full) >= set(reference), sorted(set(reference) - set(full))
    return max(float(np.abs(full[k] - reference[k]).max()) for k in reference)


def run_layout(name: str, reference: dict) -> dict:
    kit = get_kit()
    platform = hp.get_platform()
    layout = LAYOUTS[name]
    rank, world = platform.rank(), platform.world_size()
    clippers = _Clippers(kit)
    if not reference:  # shared by every layout of the launch: the same math
        ref = _build(kit)
        reference.update(_train(kit, ref, clippers.framework, slice(None)))
        reference["full"] = {k: kit.to_numpy(v) for k, v in _named(kit, ref).items()}
    mesh_shape = layout.get("mesh", (world,))
    names = ("replicate", "shard")[-len(mesh_shape):]
    mesh = hp.init_device_mesh(platform.device_type(), mesh_shape, mesh_dim_names=names)
    head_mesh = hp.init_device_mesh(platform.device_type(), (world, 1),
                                    mesh_dim_names=("replicate", "shard")) \
        if layout.get("head_replicated") else mesh
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    result = {"ref": {k: reference[k] for k in ("losses", "norms")}}
    model = _build(kit)
    outside = _wrap(model, layout, hp.fully_shard, mesh, head_mesh, shard_threshold_bytes=THRESHOLD)
    result["hp"] = _train(kit, model, clippers.hp, mine, outside)
    result["hp"]["diff"] = _diff(hp.gather_full_state_dict(model), reference["full"])
    if kit.name == "torch" and not outside:
        model = _build(kit)
        _wrap(model, layout, hp.fully_shard, mesh, head_mesh, shard_threshold_bytes=THRESHOLD)
        result["hp_torch_clip"] = _train(kit, model, clippers.framework, mine)
        result["hp_torch_clip"]["diff"] = _diff(hp.gather_full_state_dict(model), reference["full"])
        from torch.distributed.fsdp import fully_shard

        theirs = _build(kit)
        _wrap(theirs, layout, fully_shard, mesh.native, head_mesh.native)
        result["fsdp2"] = _train(kit, theirs, clippers.framework, mine)
        result["fsdp2"]["diff"] = _diff(_full_torch(kit, theirs), reference["full"])
    return result


def run_layouts(names: list) -> dict:
    reference: dict = {}
    return {name: run_layout(name, reference) for name in names}


def run_bad_input() -> dict:
    """The error each bad call raises (type and message), and whether a gradient changed."""
    kit = get_kit()
    platform = hp.get_platform()
    model = _build(kit)
    _wrap(model, LAYOUTS["fsdp"], hp.fully_shard, None, None, shard_threshold_bytes=THRESHOLD)
    params = [p for p in kit.params(model) if p.requires_grad]
    ids = kit.ids(np.arange(2 * SEQ).reshape(2, SEQ) % VOCAB)
    _, grads = _backward(kit, lambda: kit.lm_loss(model.head(model(ids)), ids), params)
    before = [platform.to_numpy(platform.local_tensor(p.grad if grads is None else g))
              for p, g in zip(params, grads or params)]
    calls = {
        "max_norm_string": lambda: _call(params, grads, "1.0"),
        "max_norm_none": lambda: _call(params, grads, None),
        "max_norm_negative": lambda: _call(params, grads, -1.0),
        "norm_type_negative": lambda: _call(params, grads, 1.0, norm_type=-2.0),
        "norm_type_zero": lambda: _call(params, grads, 1.0, norm_type=0),
        "grads_wrong_length": lambda: hp.clip_grad_norm_(params, 1.0, grads=list(grads or params)[:-1]),
        "nonfinite": lambda: hp.clip_grad_norm_(params, 1.0, error_if_nonfinite=True,
                                                grads=_with_inf(params, grads)),
    }
    if kit.name == "mindspore":
        calls["mindspore_without_grads"] = lambda: hp.clip_grad_norm_(params, 1.0)
    errors = {}
    for key, call in calls.items():
        try:
            call()
            errors[key] = None
        except Exception as error:  # noqa: BLE001 - the test reads type and message
            errors[key] = (type(error).__name__, str(error))
    after = [platform.to_numpy(platform.local_tensor(p.grad if grads is None else g))
             for p, g in zip(params, grads or params)]
    unchanged = all(np.array_equal(a, b) for a, b in zip(before, after))
    result = {"errors": errors, "grads_unchanged": unchanged}
    if kit.name == "torch":  # the grads= form returns what the in-place form leaves in .grad
        returned, norm = hp.clip_grad_norm_(params, 1e-3, grads=[p.grad for p in params])
        in_place = hp.clip_grad_norm_(params, 1e-3)
        result["grads_form_same"] = float(norm) == float(in_place) and all(
            np.array_equal(platform.to_numpy(g), platform.to_numpy(p.grad))
            for g, p in zip(returned, params))
    return result


def _with_inf(params, grads) -> list:
    """The gradients with an infinite first element."""
    grads = [p.grad for p in params] if grads is None else list(grads)
    return [grads[0] * float("inf"), *grads[1:]]


def _call(params, grads, max_norm, norm_type=2.0):
    if grads is None:
        return hp.clip_grad_norm_(params, max_norm, norm_type)
    return hp.clip_grad_norm_(params, max_norm, norm_type, grads=grads)


def run_all(names: list) -> dict:
    return {"layouts": run_layouts(names), "bad_input": run_bad_input()}
