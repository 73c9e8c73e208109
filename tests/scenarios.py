"""Rank-side scenarios of the parity suite, written once for both frameworks.

Every scenario trains a model with hyper_parallel on this rank's slice of each global
batch and, in the same process, a single-process reference (same initial values, no
fully_shard) on the whole global batch. It returns plain Python/numpy results; the tests
(test_parity.py) compare them. ``run_many`` runs several scenarios in one launch so the
suite pays the process start-up once per (backend, world size).
"""

from __future__ import annotations

import contextlib
import logging
import math

import numpy as np

import hyper_parallel as hp
from hyper_parallel.fully_shard.param import FSDPParam
from hyper_parallel.fully_shard.state import STATE_ATTR
from tests.kit import get_kit, make_batches
from tests.unit_memory import held_beyond_shards

STEPS = 5
GLOBAL_BATCH = 8
D_IN, D_OUT = 37, 5


def _build(kit, name):
    """(model, wrap) for a scenario; wrap(model) applies fully_shard and returns options."""
    if name in ("tied", "twice"):
        blocks = [kit.Block(D_IN, 24, 16), kit.Block(16, 16, 16)]
        model = kit.Stack(blocks, kit.linear(16, D_OUT), twice=name == "twice")
        if name == "tied":
            kit.tie(blocks[1].fc1, blocks[1].fc2)
        return model
    if name == "inplace_view":  # blocks return views that the stack then changes in place
        blocks = [kit.Block(D_IN, 53, 29, view_output=True), kit.Block(29, 41, 23, view_output=True)]
        return kit.Stack(blocks, kit.linear(23, D_OUT), in_place=True)
    if name.startswith("recompute_") or name == "three_blocks":
        blocks = [kit.Block(D_IN, 53, 29), kit.Block(29, 41, 23), kit.Block(23, 31, 23)]
        if name == "three_blocks":
            return kit.Stack(blocks, kit.linear(23, D_OUT))
        # blocks 1 and 2 under activation checkpointing
        return kit.Stack(blocks, kit.linear(23, D_OUT), recompute=name.removeprefix("recompute_"))
    if name == "own_even":  # every block row count divides by 2 and 4: no padding
        blocks = [kit.Block(D_IN, 48, 32), kit.Block(32, 40, 24)]
        return kit.Stack(blocks, kit.linear(24, D_OUT))
    blocks = [kit.Block(D_IN, 53, 29), kit.Block(29, 41, 23)]
    return kit.Stack(blocks, kit.linear(23, D_OUT))


def _wrap(kit, model, name):
    platform = hp.get_platform()
    if name in ("nested", "nested_adamw", "twice", "inplace_view", "recompute_reentrant",
                "recompute_non_reentrant"):
        for block in model.blocks:
            hp.fully_shard(block)
        hp.fully_shard(model)
    elif name == "nested_keep":
        for block in model.blocks:
            hp.fully_shard(block, reshard_after_forward=False)
        hp.fully_shard(model, reshard_after_forward=False)
    elif name == "list_unit":
        hp.fully_shard([model.blocks[0], model.blocks[1]])
        hp.fully_shard(model)
    elif name == "tied":
        hp.fully_shard(model.blocks[0])
        hp.fully_shard(model)
    elif name == "ignored":
        head_bias = model.head.bias
        head_bias.requires_grad = False
        for block in model.blocks:
            hp.fully_shard(block)
        hp.fully_shard(model, ignored_params=[head_bias])
    elif name == "shard_dim1":
        pick = lambda p: 1 if len(platform.shape(p)) == 2 else 0  # noqa: E731
        for block in model.blocks:
            hp.fully_shard(block, shard_placement_fn=pick)
        hp.fully_shard(model, shard_placement_fn=pick)
    elif name in ("own_collectives", "own_even"):  # every sharded parameter alone
        for block in model.blocks:
            hp.fully_shard(block, own_collective_bytes=0)
        hp.fully_shard(model, own_collective_bytes=0)
    elif name == "own_mixed":  # big ones alone, small ones fused; dim-1 shards in block 1
        pick = lambda p: 1 if len(platform.shape(p)) == 2 else 0  # noqa: E731
        hp.fully_shard(model.blocks[0], own_collective_bytes=256)
        hp.fully_shard(model.blocks[1], own_collective_bytes=256, shard_placement_fn=pick)
        hp.fully_shard(model, own_collective_bytes=256)
    else:
        raise ValueError(name)


def _freeze_like(kit, ref, name):
    if name == "ignored":
        ref.head.bias.requires_grad = False


def run_scenario(name: str, seed: int = 0) -> dict:
    kit = get_kit()
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    model, ref = _build(kit, name), _build(kit, name)
    kit.load(model, seed)
    kit.load(ref, seed)
    _freeze_like(kit, ref, name)
    _wrap(kit, model, name)
    kind = "adamw" if name == "nested_adamw" else "sgd"
    opt = kit.optimizer([p for p in kit.params(model) if p.requires_grad], kind=kind)
    ref_opt = kit.optimizer([p for p in kit.params(ref) if p.requires_grad], kind=kind)
    losses, ref_losses = [], []
    for step, (x, y) in enumerate(make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=seed + 7)):
        local = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        with hp.track_comms() as comms, _counting(platform, "copy_into_slice") as refill_copies, \
                _counting(FSDPParam, "grad_placeholder") as placeholders:
            losses.append(kit.train_step(model, opt, x[local], y[local]))
        ref_losses.append(kit.train_step(ref, ref_opt, x, y))
    full = hp.gather_full_state_dict(model)
    ref_full = {k: kit.to_numpy(v) for k, v in _named(kit, ref).items()}
    return {
        "losses": losses, "ref_losses": ref_losses,
        "param_diff": max(float(np.abs(full[k] - ref_full[k]).max()) for k in ref_full),
        "names_match": sorted(full) == sorted(ref_full),
        "last_step_comms": {op: e["calls"] for op, e in comms.summary().items()},
        "wire": {op: e["wire"] for op, e in comms.summary().items()},
        "reads_views": platform.capabilities.kernels_read_views,
        "refill_copies": refill_copies[0],  # last step: rank pieces copied into fulls
        "backed_shards": _backed_shards(platform, model),
        "placeholders": placeholders[0],  # last step: gradients filled in after backward
        "managed_params": sum(len(s.params) for s in _states(platform, model)),
        "reduces_in_backward": platform.capabilities.returns_grads_from_backward
                               and not platform.capabilities.collectives_overlap_compute,
    }


def _backed_shards(platform, model) -> list:
    """For every shard kept at the start of its padded piece: does the parameter still
    live there after the optimizer's steps (so the all-gather reads it without a copy)?"""
    return [platform.starts_with(fp.padded_shard, platform.local_tensor(fp.sharded_param))
            for state in _states(platform, model) for fp in state.params
            if fp.padded_shard is not None]


def _states(platform, model) -> list:
    """The fully_shard states with parameters under ``model``, each once."""
    states = {id(s): s for _, m in platform.named_modules(model)
              if (s := m.__dict__.get(STATE_ATTR)) is not None and s.groups}
    return list(states.values())


@contextlib.contextmanager
def _counting(owner, method: str):
    """Count calls of one method of ``owner`` (the platform, or a class; the method still
    runs) in a one-element list; 0 where ``owner`` has no such method (a platform without
    the optional StorageRelease part)."""
    calls, original = [0], owner.__dict__.get(method)
    bound = getattr(owner, method, None)
    if bound is None:
        yield calls
        return

    def counted(*args, **kwargs):
        calls[0] += 1
        return bound(*args, **kwargs)

    setattr(owner, method, counted)
    try:
        yield calls
    finally:
        if original is None:
            delattr(owner, method)
        else:
            setattr(owner, method, original)


def _named(kit, model):
    platform = hp.get_platform()
    out = {}
    for name, sub in platform.named_modules(model):
        for attr, p in platform.direct_params(sub):
            out.setdefault(f"{name}.{attr}" if name else attr, p)
    return out


def run_many(names: list) -> dict:
    return {name: run_scenario(name) for name in names}


def run_two_models() -> dict:
    """Two models wrapped independently, trained step by step in turn, each against its
    own reference: their roots, queues and callbacks must never mix."""
    kit = get_kit()
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    pairs = []
    for seed in (1, 2):
        model, ref = _build(kit, "nested"), _build(kit, "nested")
        kit.load(model, seed)
        kit.load(ref, seed)
        _wrap(kit, model, "nested")
        pairs.append((model, kit.optimizer(kit.params(model)), ref, kit.optimizer(kit.params(ref))))
    out = {"losses": [[], []], "ref_losses": [[], []]}
    local = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT, seed=3):
        for i, (model, opt, ref, ref_opt) in enumerate(pairs):
            out["losses"][i].append(kit.train_step(model, opt, x[local], y[local]))
            out["ref_losses"][i].append(kit.train_step(ref, ref_opt, x, y))
    diffs = []
    for model, _, ref, _ in pairs:
        full = hp.gather_full_state_dict(model)
        diffs.append(max(float(np.abs(full[k] - kit.to_numpy(v)).max()) for k, v in _named(kit, ref).items()))
    out["param_diff"] = max(diffs)
    return out


def run_memory() -> dict:
    """Bytes held by each block unit's full parameters at the end of the root's forward
    (blocks resharded after forward, or kept), by anything else the unit references
    (unit_memory.py), and by the full parameters of each unit as its gradient reduction
    is issued in backward (state.py, "releasing after backward"); the step's loss must
    still match."""
    kit = get_kit()
    platform = hp.get_platform()
    out = {}
    for keep in (False, True):
        # three blocks of different sizes: "the two largest" is neither all nor the first two
        model, ref = _build(kit, "three_blocks"), _build(kit, "three_blocks")
        kit.load(model, 0)
        kit.load(ref, 0)
        world = platform.world_size()
        block_bytes = [sum(_gathered_bytes(platform, p, world) for p in kit.params(b))
                       for b in model.blocks]
        root_bytes = sum(_gathered_bytes(platform, p, world) for p in kit.params(model)) \
            - sum(block_bytes)
        for block in model.blocks:
            hp.fully_shard(block, reshard_after_forward=not keep)
        hp.fully_shard(model)
        held, reachable, asked = [], [], []
        platform.keep_released_memory = asked.append  # an instance attribute: undone below

        def record(module, args, kwargs, output):  # runs after every block's post-forward
            states = [b.__dict__[STATE_ATTR] for b in model.blocks]
            held.append([sum(kit.storage_bytes(t) for t in s._full.tensors) for s in states])
            reachable.append([held_beyond_shards(platform, s) for s in states])

        platform.register_forward_hooks(model, lambda m, a, k: None, record)
        x, y = make_batches(1, GLOBAL_BATCH, D_IN, D_OUT)[0]
        rank, world = platform.rank(), platform.world_size()
        local = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        with _held_at_reduction(kit, model) as at_reduction:
            loss = kit.train_step(model, kit.optimizer(kit.params(model)), x[local], y[local])
        ref_loss = kit.train_step(ref, kit.optimizer(kit.params(ref)), x, y)
        del platform.keep_released_memory
        # what a step holds at once: the root's and every kept block's full parameters,
        # or the two largest blocks that reshard after forward
        expected = root_bytes + (sum(block_bytes) if keep else sum(sorted(block_bytes)[-2:]))
        out["keep" if keep else "reshard"] = {
            "held": held[0], "reachable": reachable[0], "at_reduction": at_reduction,
            "after_step": [b.__dict__[STATE_ATTR]._full is None for b in model.blocks],
            "loss": loss, "ref_loss": ref_loss, "asked_to_keep": asked, "expected_keep": expected}
    return out


@contextlib.contextmanager
def _held_at_reduction(kit, model):
    """Yield a list that gets, as each block's gradient reduction is issued (the core's
    debug log says so), the bytes that block's full parameters still hold."""
    states = [b.__dict__[STATE_ATTR] for b in model.blocks]
    found = []

    class Record(logging.Handler):
        def emit(self, record):
            name, _, event = record.getMessage().partition(": ")
            for state in states:  # named by the root's first forward
                if event.startswith("reduce-scatter issued") and state.name == name:
                    full = state._full
                    found.append(0 if full is None else
                                 sum(kit.storage_bytes(t) for t in full.tensors))

    logger = logging.getLogger("hyper_parallel.fully_shard")
    handler, level = Record(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _gathered_bytes(platform, param, shard_size: int) -> int:
    """Bytes of a full parameter gathered from dim-0 shards padded to equal rows (fp32)."""
    rows, *rest = platform.shape(param)
    return -(-rows // shard_size) * shard_size * math.prod(rest) * 4


def run_fsdp2_compare(hsdp: bool = False) -> dict:
    """torch only: hyper_parallel and torch's own fully_shard on the same model and data,
    over one torch DeviceMesh: 1-D (FSDP) or (2, world/2) replicate x shard (HSDP). The
    torch mesh is passed to hp.fully_shard as it is (accepted on torch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    kit = get_kit()
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    shape, names = ((2, world // 2), ("replicate", "shard")) if hsdp else ((world,), ("shard",))
    torch_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    ours, theirs = _build(kit, "nested"), _build(kit, "nested")
    kit.load(ours, 0)
    kit.load(theirs, 0)
    for block in ours.blocks:
        hp.fully_shard(block, mesh=torch_mesh)
    hp.fully_shard(ours, mesh=torch_mesh)
    for block in theirs.blocks:
        torch_fully_shard(block, mesh=torch_mesh)
    torch_fully_shard(theirs, mesh=torch_mesh)
    opt, their_opt = kit.optimizer(kit.params(ours)), kit.optimizer(kit.params(theirs))
    local = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    losses, their_losses = [], []
    for x, y in make_batches(STEPS, GLOBAL_BATCH, D_IN, D_OUT):
        losses.append(kit.train_step(ours, opt, x[local], y[local]))
        their_losses.append(kit.train_step(theirs, their_opt, x[local], y[local]))
    full = hp.gather_full_state_dict(ours)
    their_full = {k: v.full_tensor().detach().numpy() for k, v in theirs.state_dict().items()}
    return {"losses": losses, "their_losses": their_losses,
            "param_diff": max(float(np.abs(full[k] - their_full[k]).max()) for k in their_full),
            "local_shapes_match": all(tuple(a.to_local().shape) == tuple(b.to_local().shape)
                                      for a, b in zip(ours.parameters(), theirs.parameters()))}


def run_prefetch_trace() -> dict:
    """The debug log of the third step of the nested model: with implicit prefetch, each
    block's all-gather is issued before that block's forward consumes it (and, where full
    parameters are released, each block's re-gather before its backward needs it)."""
    kit = get_kit()
    model = _build(kit, "nested")
    kit.load(model, 0)
    _wrap(kit, model, "nested")
    opt = kit.optimizer(kit.params(model))
    events = []

    class Collect(logging.Handler):
        def emit(self, record):
            events.append(record.getMessage())

    logger = logging.getLogger("hyper_parallel.fully_shard")
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    for step, (x, y) in enumerate(make_batches(3, GLOBAL_BATCH, D_IN, D_OUT)):
        events.clear()
        kit.train_step(model, opt, x, y)
    logger.removeHandler(handler)
    logger.setLevel(level)  # later jobs of a shared launch log as before
    return {"events": list(events)}
