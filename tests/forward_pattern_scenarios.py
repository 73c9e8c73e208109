"""Rank side of the forward-pattern suite: forwards that are not one clean pass.

Each pattern trains the kit's small language model (embedding, attention blocks, norms, a
37-row head that shards unevenly over 2 ranks) for ``STEPS`` SGD steps in one process three
ways: hyper_parallel on this rank's slice of every batch, a single-process reference on the
whole batch, and on torch, torch's own FSDP2 on the same slice with the same wrapping. The
model's forward stops at the final norm: the head is called by the loss, once per chunk of
the sequence (the chunked-loss pattern), and lives in one unit with the final norm (and the
embedding when they are tied).

Patterns (``PATTERNS``): options of the model and wrapping, and which loss step runs:
- ``chunked``: the head called on 4 chunks of the sequence, one backward;
- ``accumulate``: a backward per chunk over the retained graph of one model forward
  (torch only: a MindSpore backward is one ``value_and_grad`` call over the whole loss);
- ``two_forwards``: the whole model twice (on two inputs) before one backward;
- ``two_partial``: the model's forward twice, then the head once on their sum;
- ``eval_between``: after the training forward, a ``no_grad`` evaluation of the model and a
  second call of one block, then the backward (some parameters frozen);
- ``eval_after_step``: after every optimizer step, a forward of the whole model outside any
  training context, as an evaluation written without ``no_grad`` does (torch: grad mode on,
  the graph dropped; MindSpore: outside ``value_and_grad``);
- ``reshard_between`` / ``unshard_between``: an explicit ``reshard()`` / ``unshard()`` of
  every unit between forward and backward.
"""

from __future__ import annotations

import gc

import numpy as np

import hyper_parallel as hp
from hyper_parallel.fully_shard.state import STATE_ATTR
from tests.kit import get_kit
from tests.scenarios import _named

VOCAB, DIM, HIDDEN, BLOCKS = 37, 16, 24, 2
SEQ, LOCAL_BATCH, CHUNKS = 8, 2, 4
# optimizer steps per pattern; 2 on MindSpore, whose CPU steps of this model cost ~10x
# torch's (the second step still runs on the momentum the first one left)
STEPS = {"torch": 3, "mindspore": 2}

PATTERNS = {
    "chunked": {},
    "chunked_tied": {"tie": True},
    "chunked_keep": {"raf": False},
    "chunked_mixed_precision": {"mp": True},
    "chunked_recompute": {"recompute": True},
    "accumulate": {"step": "accumulate"},
    "accumulate_tied_recompute_keep": {"step": "accumulate", "tie": True, "recompute": True,
                                       "raf": False},
    "two_forwards": {"step": "two_forwards", "recompute": True},
    "two_partial": {"step": "two_partial", "tie": True},
    # torch FSDP2 fails in this one's backward: its no_grad forward frees the head unit's
    # full parameters that the training forward saved (reading freed storage)
    "eval_between": {"step": "eval_between", "freeze": True, "fsdp2_fails": True},
    "eval_between_keep": {"step": "eval_between", "freeze": True, "raf": False},
    "eval_after_step": {"step": "eval_after_step"},
    "reshard_between": {"step": "reshard_between", "raf": False},
    "unshard_between": {"step": "unshard_between"},
    "root_reshards": {"root_raf": True},
}
TORCH_ONLY = {"accumulate", "accumulate_tied_recompute_keep"}


def _shifted(kit, ids):
    """A second input: every token moved by one (elementwise, so it commutes with slicing
    the batch across ranks)."""
    return kit.ids((ids.astype(np.int64) + 1) % VOCAB)


def _chunked_loss(kit, model, ids, targets):
    hidden = model(kit.ids(ids))
    total = 0.0
    for h, t in zip(kit.chunks(hidden, CHUNKS, 1), kit.chunks(kit.ids(targets), CHUNKS, 1)):
        total = total + kit.lm_loss(model.head(h), t) / CHUNKS
    return total


def _units(model):
    """Every fully_shard unit of the model (a plain reference model has none)."""
    modules = [model, *model.blocks, model.head]
    return [m for m in modules if hasattr(m, "reshard")]


def _loss_fn(kit, model, pattern, ids, targets):
    step = pattern.get("step", "chunked")

    def loss():
        if step == "two_forwards":
            first = kit.lm_loss(model.head(model(kit.ids(ids))), kit.ids(targets))
            return first + kit.lm_loss(model.head(model(_shifted(kit, ids))), kit.ids(targets))
        if step == "two_partial":
            both = model(kit.ids(ids)) + model(_shifted(kit, ids))
            return kit.lm_loss(model.head(both), kit.ids(targets))
        result = _chunked_loss(kit, model, ids, targets)
        if step == "eval_between":
            with kit.no_grad():
                _chunked_loss(kit, model, targets, ids)
                model.blocks[1](model(kit.ids(ids)))
        elif step == "reshard_between":
            for unit in _units(model):
                unit.reshard()
        elif step == "unshard_between":
            for unit in _units(model):
                unit.unshard()
        return result

    return loss


def _accumulate_step(kit, model, opt, ids, targets) -> float:
    """torch: one model forward, a backward per chunk of the head's loss (retained graph)."""
    hidden = model(kit.ids(ids))
    total = 0.0
    for h, t in zip(kit.chunks(hidden, CHUNKS, 1), kit.chunks(kit.ids(targets), CHUNKS, 1)):
        loss = kit.lm_loss(model.head(h), t) / CHUNKS
        loss.backward(retain_graph=True)
        total += float(loss.item())
    opt.step()
    opt.zero_grad()
    return total


def _build(kit, pattern):
    model = kit.LM(VOCAB, DIM, HIDDEN, BLOCKS, tie=pattern.get("tie", False),
                   recompute=pattern.get("recompute", False))
    kit.load(model, seed=3)
    if pattern.get("freeze"):
        for param in (kit.params(model.blocks[0].attn)[0], kit.params(model.norm)[0]):
            param.requires_grad = False
    return model


def _wrap(kit, model, pattern, fully_shard, policy, low_precision, float32):
    raf = pattern.get("raf", True)
    body, head = policy(), policy()
    if pattern.get("mp"):
        body = policy(param_dtype=low_precision, reduce_dtype=float32)
        head = policy(param_dtype=low_precision, reduce_dtype=float32, output_dtype=float32)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=raf, mp_policy=body)
    head_unit = [model.norm, model.head]
    if pattern.get("tie"):  # a tied parameter belongs to one unit
        head_unit.insert(0, model.embed)
    fully_shard(head_unit, reshard_after_forward=raf, mp_policy=head)
    fully_shard(model, mp_policy=body, **({"reshard_after_forward": True}
                                          if pattern.get("root_raf") else {}))


def _diff(full: dict, reference: dict) -> float:
    missing = sorted(set(reference) - set(full))
    assert not missing, f"parameters missing after training: {missing}"
    return max(float(np.abs(full[k] - reference[k]).max()) for k in reference)


def _train(kit, model, pattern, slice_, record_root=False) -> tuple:
    opt = kit.optimizer([p for p in kit.params(model) if p.requires_grad], lr=0.1)
    rng = np.random.default_rng(11)
    losses, root_resharded, live, states = [], [], [], []
    # the root's embedding reads its sharded parameter after forward only if it resharded
    attr, sharded = hp.get_platform().direct_params(model.embed)[0]
    for _ in range(STEPS[kit.name]):
        world_batch = LOCAL_BATCH * hp.get_platform().world_size()
        ids = rng.integers(0, VOCAB, (world_batch, SEQ))[slice_]
        targets = rng.integers(0, VOCAB, (world_batch, SEQ))[slice_]
        if pattern.get("step") == "accumulate":
            losses.append(_accumulate_step(kit, model, opt, ids, targets))
            live.append(_live_full_params() if record_root else 0)
            states.append(_unit_states(model) if record_root else [])
            continue
        loss_fn = _loss_fn(kit, model, pattern, ids, targets)
        if record_root:
            def loss_fn(inner=loss_fn):
                value = inner()
                root_resharded.append(getattr(model.embed, attr) is sharded)
                return value
        losses.append(kit.grad_step(model, opt, loss_fn))
        states.append(_unit_states(model) if record_root else [])
        if pattern.get("step") == "eval_after_step":
            model.head(model(kit.ids(targets)))
        live.append(_live_full_params() if record_root else 0)
    return losses, root_resharded, live, states


def _unit_states(model) -> list:
    """Each unit's UnitState (unit_state.py) after a training step."""
    return [m.__dict__[STATE_ATTR].state.value for m in _units(model)]


def _reference(kit, pattern, cache: dict) -> tuple:
    """(losses, full parameters) of the single-process reference on the whole batch. The
    patterns that train the same function on the same model share one: wrapping options,
    activation checkpointing and explicit reshard/unshard/evaluation calls change nothing
    in a plain model's training (MindSpore CPU steps are slow)."""
    step = pattern.get("step", "chunked")
    math = "chunked" if step in ("eval_between", "eval_after_step", "reshard_between",
                                "unshard_between") else step
    key = (math, pattern.get("tie", False), pattern.get("freeze", False))
    if key not in cache:
        ref = _build(kit, pattern)
        losses, *_ = _train(kit, ref, pattern, slice(None))
        cache[key] = losses, {k: kit.to_numpy(v) for k, v in _named(kit, ref).items()}
    return cache[key]


def run_pattern(name: str, references: dict) -> dict:
    kit = get_kit()
    platform = hp.get_platform()
    pattern = PATTERNS[name]
    rank, world = platform.rank(), platform.world_size()
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    ref_losses, ref_full = _reference(kit, pattern, references)
    model = _build(kit, pattern)
    low = "bfloat16" if kit.name == "torch" else "float16"  # bf16 matmul: none on MindSpore CPU
    _wrap(kit, model, pattern, hp.fully_shard, hp.MixedPrecisionPolicy, low, "float32")
    losses, root_resharded, live, states = _train(kit, model, pattern, mine, record_root=True)
    full = hp.gather_full_state_dict(model)
    result = {"losses": losses, "ref_losses": ref_losses, "ref_diff": _diff(full, ref_full),
              "root_resharded": root_resharded, "world": world,
              "live_full_params": live, "units": len(_units(model)), "states": states}
    if kit.name == "torch" and not pattern.get("fsdp2_fails"):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        theirs = _build(kit, pattern)
        _wrap(kit, theirs, pattern, fully_shard, MixedPrecisionPolicy, torch.bfloat16,
              torch.float32)
        result["fsdp2_losses"], *_ = _train(kit, theirs, pattern, mine)
        their_full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().numpy()
                      for n, p in theirs.named_parameters()}
        result["fsdp2_diff"] = _diff(full, their_full)
    return result


def _live_full_params() -> int:
    """How many sets of full parameters (one per unshard node) are alive in the process:
    the same after every step (a count that grows with the steps is a leak)."""
    from hyper_parallel.fully_shard.state import FullParams

    gc.collect()
    return sum(type(o) is FullParams for o in gc.get_objects())


def _registration_trace(kit, model, is_unsharded) -> dict:
    """Which of the first block's registered parameters are unsharded (``is_unsharded``)
    after a training forward (blocks keep their full parameters), after the step, after
    an explicit unshard(), in that unit's state dict then, and after reshard()."""
    block = model.blocks[0]
    probe = lambda: [is_unsharded(p) for p in _named(kit, block).values()]  # noqa: E731
    trace = {}
    rank = hp.get_platform().rank()
    ids = np.random.default_rng(5).integers(0, VOCAB, (LOCAL_BATCH, SEQ)) + rank

    def loss():
        value = _chunked_loss(kit, model, ids % VOCAB, ids[:, ::-1] % VOCAB)
        trace["after_forward"] = probe()
        return value

    kit.grad_step(model, kit.optimizer(kit.params(model)), loss)
    trace["after_step"] = probe()
    block.unshard()
    trace["after_unshard"] = probe()
    if kit.name == "torch":
        trace["state_dict"] = [is_unsharded(v) for v in block.state_dict(keep_vars=True).values()]
        block.unshard()  # the state dict hook registered the sharded parameters again
    block.reshard()
    trace["after_reshard"] = probe()
    return trace


def run_registration() -> dict:
    """Parameter registration while units are unsharded, for hyper_parallel and (torch)
    FSDP2 on the same model."""
    kit = get_kit()
    pattern = {"raf": False}
    model = _build(kit, pattern)
    _wrap(kit, model, pattern, hp.fully_shard, hp.MixedPrecisionPolicy, None, None)
    sharded = {id(p) for p in kit.params(model)}
    result = {"hp": _registration_trace(kit, model, lambda p: id(p) not in sharded)}
    if kit.name == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor import DTensor

        theirs = _build(kit, pattern)
        _wrap(kit, theirs, pattern, fully_shard, MixedPrecisionPolicy, None, None)
        result["fsdp2"] = _registration_trace(kit, theirs, lambda p: not isinstance(p, DTensor))
    return result


def run_all(names: list) -> dict:
    """Every pattern of ``names`` in this launch (one process start-up for all), and the
    registration trace."""
    kit = get_kit()
    references: dict = {}
    skipped = set() if kit.name == "torch" else TORCH_ONLY
    out = {name: run_pattern(name, references) for name in names if name not in skipped}
    out["registration"] = run_registration()
    return out
