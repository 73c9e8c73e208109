"""Rank side of the state-dict suite: save, load and reshard a training run, then resume it.

The kit's small language model (embedding, attention blocks, norms, a 37-row head that
shards unevenly) is trained with AdamW on a fixed global batch split over the ranks. The
launches form one chain, each reading what the earlier ones wrote into one directory:

- ``save`` (4 ranks): a few steps (``STEPS``), then a sharded checkpoint of the model and
  optimizer (``hp.save_checkpoint``), the full state dict (rank 0 only) written as
  a full checkpoint in the framework's format, and on torch a DCP checkpoint of torch's
  own ``get_state_dict``; then more steps: the uninterrupted run. Also the
  framework's own state dict round trip at the same world size (MindSpore
  ``save_checkpoint``/``load_checkpoint``/``load_param_into_net``; torch
  ``state_dict``/``load_state_dict``).
- ``load`` (2 and 1 ranks): a model built with other values loads each checkpoint (the
  sharded one from 4 ranks, the full one, on torch the DCP one), its full state dict is
  returned, and training resumes from one of them (``STEPS``). The 2-rank launch also saves a
  checkpoint at 2 ranks right after loading, which the 1-rank launch loads too.
  The 1-rank launch also trains the single-process reference and tries bad input; on
  MindSpore the 2-rank one also round-trips ``nn.Adam``'s state.

The test compares, per backend: the full state dict after each load with the saving run's;
the resumed losses and parameters with the uninterrupted run's and the reference's.
"""

from __future__ import annotations

import os

import numpy as np

import hyper_parallel as hp
from tests.kit import get_kit

VOCAB, DIM, HIDDEN, BLOCKS = 37, 16, 24, 2
SEQ, GLOBAL_BATCH = 8, 4
# optimizer steps before the checkpoint and after it; 1 and 1 on MindSpore, whose CPU steps
# of this model cost ~10x torch's (one step after the load already reads every moment and
# the step counter the load restored)
STEPS = {"torch": (2, 2), "mindspore": (1, 1)}
LR = 0.01


def _batches(kit, part=None):
    """The run's batches: all, or those ``"before"`` or ``"after"`` the checkpoint."""
    before, after = STEPS[kit.name]
    rng = np.random.default_rng(11)
    batches = [(rng.integers(0, VOCAB, (GLOBAL_BATCH, SEQ)),
                rng.integers(0, VOCAB, (GLOBAL_BATCH, SEQ))) for _ in range(before + after)]
    return {None: batches, "before": batches[:before], "after": batches[before:]}[part]


def _build(kit, seed, shard=True):
    model = kit.LM(VOCAB, DIM, HIDDEN, BLOCKS)
    kit.load(model, seed=seed)
    if shard:
        for block in model.blocks:
            hp.fully_shard(block)
        hp.fully_shard([model.norm, model.head])
        hp.fully_shard(model)
    return model, kit.optimizer(kit.params(model), lr=LR, kind="adamw")


def _train(kit, model, opt, batches, sharded=True):
    platform = hp.get_platform()
    rank, world = (platform.rank(), platform.world_size()) if sharded else (0, 1)
    mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    losses = []
    for ids, targets in batches:
        def loss(ids=ids[mine], targets=targets[mine]):
            return kit.lm_loss(model.head(model(kit.ids(ids))), kit.ids(targets))
        losses.append(kit.grad_step(model, opt, loss))
    return losses


def _mean_over_ranks(losses: list) -> list:
    """Every rank's losses averaged (the loss of the global batch), on every rank."""
    platform = hp.get_platform()
    if platform.world_size() == 1:
        return losses
    tensor = platform.from_numpy(np.asarray(losses, np.float32))
    platform.all_reduce(tensor, None, "sum")
    return [float(v) / platform.world_size() for v in platform.to_numpy(tensor)]


def _native_round_trip(kit, model, directory) -> float:
    """The framework's own state dict saved and loaded at the same world size, into a model
    built with other values: the largest difference of the gathered parameters."""
    platform = hp.get_platform()
    fresh, _ = _build(kit, seed=5)
    if kit.name == "mindspore":
        import mindspore as ms
        path = os.path.join(directory, f"native{platform.rank()}.ckpt")
        ms.save_checkpoint(model, path)
        ms.load_param_into_net(fresh, ms.load_checkpoint(path))
    else:
        fresh.load_state_dict(model.state_dict())
    mine, theirs = hp.gather_full_state_dict(model), hp.gather_full_state_dict(fresh)
    return max(float(np.abs(mine[k] - theirs[k]).max()) for k in mine)


def _torch_dcp_save(model, opt, path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def _torch_dcp_load(model, opt, path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def run_save(directory: str) -> dict:
    kit = get_kit()
    platform = hp.get_platform()
    model, opt = _build(kit, seed=3)
    before = _mean_over_ranks(_train(kit, model, opt, _batches(kit, "before")))
    hp.save_checkpoint(os.path.join(directory, "ws4"), model, opt)
    full = hp.get_full_state_dict(model, opt)
    if platform.rank() == 0:
        _save_full(kit, full, os.path.join(directory, "full.ckpt" if kit.name == "mindspore"
                                           else "full.pt"))
    if kit.name == "torch":
        _torch_dcp_save(model, opt, os.path.join(directory, "dcp4"))
    result = {"full_state": full, "before": before,
              "sharded_keys": sorted(hp.get_state_dict(model, opt)),
              "native_round_trip_diff": _native_round_trip(kit, model, directory)}
    result["after"] = _mean_over_ranks(_train(kit, model, opt, _batches(kit, "after")))
    result["final"] = hp.get_full_state_dict(model)
    platform.barrier()
    return result


def _save_full(kit, full: dict, path: str) -> None:
    """A full state dict as a checkpoint file in the framework's own format."""
    if kit.name == "torch":
        import torch

        torch.save({k: torch.from_numpy(v) for k, v in full.items()}, path)
    else:
        import mindspore as ms

        ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in full.items()], path)


def _load_full(kit, path: str) -> dict:
    """What ``_save_full`` wrote, read back by the framework: ``{name: tensor}``."""
    if kit.name == "torch":
        import torch

        return torch.load(path, weights_only=True)
    import mindspore as ms

    return dict(ms.load_checkpoint(path))


def _load_and_resume(kit, load, resume) -> dict:
    """A model with other values, loaded by ``load(model, opt)``, then (``resume``) trained
    on: the loaded state, and the losses and parameters after."""
    model, opt = _build(kit, seed=5)
    load(model, opt)
    out = {"loaded": hp.get_full_state_dict(model, opt)}
    if resume:
        out["after"] = _mean_over_ranks(_train(kit, model, opt, _batches(kit, "after")))
        out["final"] = hp.get_full_state_dict(model)
    return out


def run_load(directory: str) -> dict:
    kit = get_kit()
    platform = hp.get_platform()
    world = platform.world_size()
    full_path = os.path.join(directory, "full.ckpt" if kit.name == "mindspore" else "full.pt")
    sources = {
        "sharded_from_4": lambda m, o: hp.load_checkpoint(os.path.join(directory, "ws4"), m, o),
        "full": lambda m, o: hp.set_state_dict(m, _load_full(kit, full_path), o),
    }
    if world == 1:
        sources["sharded_from_2"] = lambda m, o: hp.load_checkpoint(
            os.path.join(directory, "ws2"), m, o)
    if kit.name == "torch":
        sources["dcp_from_4"] = lambda m, o: _torch_dcp_load(m, o, os.path.join(directory, "dcp4"))
    # every source's loaded state is compared; training resumes from one per launch (the
    # same code runs after any load that gave the same state)
    resumed = "sharded_from_4" if world == 2 else "sharded_from_2"
    result = {name: _load_and_resume(kit, load, name == resumed) for name, load in sources.items()}
    if world == 2:
        model, opt = _build(kit, seed=5)
        sources["sharded_from_4"](model, opt)
        hp.save_checkpoint(os.path.join(directory, "ws2"), model, opt)
        # every rank gets the full state on request
        result["all_ranks_full"] = hp.get_full_state_dict(model, opt, rank0_only=False)
    if world == 2 and kit.name == "mindspore":
        result["nn_adam"] = _nn_adam_round_trip(kit, os.path.join(directory, "ws2_adam"))
    if world == 1:
        result["reference"] = _reference(kit)
        result["bad_input"] = _bad_input(kit, directory)
    platform.barrier()
    return result


def _nn_adam_round_trip(kit, path) -> dict:
    """MindSpore's ``nn.Adam`` (moments, step and beta powers) through a checkpoint into a
    model with other values: the full states before and after."""
    from mindspore import nn

    model, _ = _build(kit, seed=3)
    opt = nn.Adam(kit.params(model), learning_rate=LR)
    _train(kit, model, opt, _batches(kit, "before")[:1])
    hp.save_checkpoint(path, model, opt)
    fresh, _ = _build(kit, seed=5)
    fresh_opt = nn.Adam(kit.params(fresh), learning_rate=LR)
    hp.load_checkpoint(path, fresh, fresh_opt)
    return {"saved": hp.get_full_state_dict(model, opt),
            "loaded": hp.get_full_state_dict(fresh, fresh_opt)}


def _reference(kit) -> dict:
    model, opt = _build(kit, seed=3, shard=False)
    losses = _train(kit, model, opt, _batches(kit), sharded=False)
    return {"losses": losses, "final": hp.get_full_state_dict(model)}


def _bad_input(kit, directory) -> dict:
    """Each bad load: its error message, and whether the model stayed as it was."""
    model, opt = _build(kit, seed=5)
    _train(kit, model, opt, _batches(kit, "before")[:1])  # every optimizer has its state now
    good = hp.get_full_state_dict(model, opt)
    other = kit.LM(VOCAB + 3, DIM, HIDDEN, BLOCKS)
    wrong_shape = dict(good)
    wrong_shape["head.weight"] = np.zeros((VOCAB + 1, DIM), np.float32)
    norm_key = next(k for k in good if k.startswith("norm."))
    missing = {k: v for k, v in good.items() if k != norm_key}
    unexpected = dict(good, **{"extra.weight": np.zeros((2, 2), np.float32)})
    broken = os.path.join(directory, "ws4_missing_rank")
    os.makedirs(broken, exist_ok=True)
    for name in os.listdir(os.path.join(directory, "ws4")):
        if name != "rank-00003.safetensors":
            with open(os.path.join(directory, "ws4", name), "rb") as src, \
                    open(os.path.join(broken, name), "wb") as dst:
                dst.write(src.read())
    cases = {
        "other_model": lambda: hp.set_state_dict(model, hp.gather_full_state_dict(other)),
        "wrong_shape": lambda: hp.set_state_dict(model, wrong_shape, opt),
        "missing_key": lambda: hp.set_state_dict(model, missing, opt),
        "unexpected_key": lambda: hp.set_state_dict(model, unexpected, opt),
        "missing_rank_file": lambda: hp.load_checkpoint(broken, model, opt),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            message = None
        except (ValueError, FileNotFoundError) as error:
            message = str(error)
        now = hp.get_full_state_dict(model, opt)
        out[name] = {"error": message,
                     "unchanged": all(np.array_equal(now[k], good[k]) for k in good)}
    out["missing_key"]["key"] = norm_key
    return out


def run_phase(phase: str, directory: str) -> dict:
    return run_save(directory) if phase == "save" else run_load(directory)
