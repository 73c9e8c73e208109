"""Rank side of tests/test_pipelining_checkpoint.py: checkpoints of pipelined runs.

examples/one_script's transformer (AdamW, stored under torch's names: ``key_map=
hp.torch_nn_names``), cut by ``hp.pipelining.pipeline_module_split`` and trained under
``Schedule1F1B`` at pp 2 on 2 ranks, beside the whole model trained in each rank's process
(the reference, ``STEPS`` steps). ``run``:

- ``pipelined``: the pp 2 run saves after ``SAVE_AT`` steps (``directory``/pp2, each rank
  its stage) and trains on to ``STEPS``; the test process resumes that checkpoint in one
  process, without pipelining, on both frameworks;
- ``from_whole``: the reference saves after ``SAVE_AT`` steps (every rank holds the whole
  model, as one process does: ``directory``/whole), and a pp 2 run of a model built with
  other values loads it and trains on;
- the errors, each on every rank and nothing loaded: a load whose stages leave a value of
  the checkpoint to no rank, a stage saved or loaded without ``pp_mesh``.

``resume_pp2`` (slow, its own launch): the other framework's pp 2 checkpoint, or one
process's (``save_whole``), resumed at pp 2. ``interleaved`` (slow): the pp 2 checkpoint loaded into ``ScheduleInterleaved1F1B``'s four
stages (two per rank: a list of model parts and one optimizer per part), trained on.
Per run: the last stage's losses of the steps after ``SAVE_AT``, against the reference's.
"""

from __future__ import annotations

import importlib
import os

import numpy as np

import hyper_parallel as hp
from tests.docs_examples_scenarios import lm_stage_names

STEPS = 4
SAVE_AT = 2


def _modules():
    from examples.one_script import train as script

    return script, importlib.import_module(f"examples.one_script.model_{hp.get_platform().name}")


def _loss_fn(vocab: int):
    def loss_fn(logits, targets):
        return hp.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
    return loss_fn


def _step(schedule, stages, opts, tokens, platform) -> float | None:
    """One pipelined step; the last stage's mean micro-batch loss (None elsewhere)."""
    losses = []
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    args = (platform.from_numpy(tokens[:, :-1]),) if first else ()
    kwargs = {"target": platform.from_numpy(tokens[:, 1:]), "losses": losses} if last else {}
    schedule.step(*args, **kwargs)
    for opt, stage in zip(opts, stages):
        if platform.name == "torch":
            opt.step()
            opt.zero_grad()
        else:
            opt(tuple(stage.gradients()))
    return float(np.mean([platform.to_numpy(v) for v in losses])) if last else None


def _pipelined(mesh, model, schedule: str, count: int):
    """``(stages, parts, schedule, one optimizer per part)`` of this rank."""
    script, framework = _modules()
    platform = hp.get_platform()
    names = lm_stage_names(count)
    stages, parts = hp.pipelining.pipeline_module_split(model, mesh["pp"], schedule,
                                                        platform.device_type(), names)
    cls = getattr(hp.pipelining, f"Schedule{schedule}")
    runner = cls(stages if len(stages) > 1 else stages[0], n_microbatches=2,
                 loss_fn=_loss_fn(script.SIZES["vocab"]))
    return stages, parts, runner, [framework.optimizer(part, 1e-2) for part in parts]


def _error(action) -> str:
    try:
        action()
    except hp.CheckpointError as error:
        return str(error)
    return "no error"


def _values(parts) -> list:
    platform = hp.get_platform()
    return [platform.to_numpy(q).copy() for part in parts
            for _, sub in platform.named_modules(part) for _, q in platform.direct_params(sub)]


def run(directory: str, interleaved: bool = False) -> dict:
    script, framework = _modules()
    platform = hp.get_platform()
    mesh = hp.init_device_mesh(platform.device_type(), (2,), mesh_dim_names=("pp",))
    vocab = script.SIZES["vocab"]
    batches = script.batches(STEPS)
    pp2, whole_dir = os.path.join(directory, "pp2"), os.path.join(directory, "whole")
    names = hp.torch_nn_names
    out: dict = {"pp_rank": mesh.get_local_rank("pp")}

    reference = framework.build(script.initial_values(), **script.SIZES)
    ref_opt = framework.optimizer(reference, 1e-2)
    loss_fn = _loss_fn(vocab)
    out["ref_losses"] = []
    for step, tokens in enumerate(batches):
        if step == SAVE_AT and not interleaved:
            hp.save_checkpoint(whole_dir, reference, ref_opt, key_map=names)
        out["ref_losses"].append(framework.train_step(
            reference, ref_opt, lambda i, t: loss_fn(reference(i), t),
            platform.from_numpy(tokens[:, :-1]), platform.from_numpy(tokens[:, 1:]),
            1e9, hp.clip_grad_norm_))  # clips nothing

    if interleaved:  # the pp 2 checkpoint as four stages, two per rank
        stages, parts, schedule, opts = _pipelined(
            mesh, framework.build(script.initial_values(seed=3), **script.SIZES),
            "Interleaved1F1B", 4)
        hp.load_checkpoint(pp2, parts, opts, key_map=names, pp_mesh=mesh["pp"])
        out["interleaved"] = [_step(schedule, stages, opts, t, platform)
                              for t in batches[SAVE_AT:]]
        platform.barrier()
        return out

    # pp 2 from the initial values, saved after SAVE_AT steps
    stages, parts, schedule, opts = _pipelined(
        mesh, framework.build(script.initial_values(), **script.SIZES), "1F1B", 2)
    out["pipelined"] = []
    for step, tokens in enumerate(batches):
        if step == SAVE_AT:
            hp.save_checkpoint(pp2, parts[0], opts[0], key_map=names, pp_mesh=mesh["pp"])
        out["pipelined"].append(_step(schedule, stages, opts, tokens, platform))
    out["save_without_pp_mesh"] = _error(
        lambda: hp.save_checkpoint(os.path.join(directory, "refused"), parts[0], opts[0],
                                   key_map=names))

    # the whole model's checkpoint, loaded at pp 2 into a model of other values
    stages, parts, schedule, opts = _pipelined(
        mesh, framework.build(script.initial_values(seed=3), **script.SIZES), "1F1B", 2)
    before = _values(parts)
    out["uncovered"] = _error(lambda: hp.load_checkpoint(
        whole_dir, parts[0], opts[0], pp_mesh=mesh["pp"],
        key_map=lambda n: None if names(n).startswith("head.") else names(n)))
    out["load_without_pp_mesh"] = _error(
        lambda: hp.load_checkpoint(whole_dir, parts[0], opts[0], key_map=names))
    out["unchanged"] = all(np.array_equal(a, b) for a, b in zip(before, _values(parts)))
    hp.load_checkpoint(whole_dir, parts[0], opts[0], key_map=names, pp_mesh=mesh["pp"])
    out["from_whole"] = [_step(schedule, stages, opts, t, platform) for t in batches[SAVE_AT:]]
    platform.barrier()
    return out


def resume_pp2(directory: str) -> dict:
    """A pp 2 run of a model built with other values resumes the pp 2 checkpoint in
    ``directory`` (the other framework's); its losses after ``SAVE_AT`` and the
    reference's."""
    script, framework = _modules()
    platform = hp.get_platform()
    mesh = hp.init_device_mesh(platform.device_type(), (2,), mesh_dim_names=("pp",))
    batches = script.batches(STEPS)
    stages, parts, schedule, opts = _pipelined(
        mesh, framework.build(script.initial_values(seed=3), **script.SIZES), "1F1B", 2)
    hp.load_checkpoint(os.path.join(directory, "pp2"), parts[0], opts[0],
                       key_map=hp.torch_nn_names, pp_mesh=mesh["pp"])
    losses = [_step(schedule, stages, opts, t, platform) for t in batches[SAVE_AT:]]
    reference = framework.build(script.initial_values(), **script.SIZES)
    ref_opt = framework.optimizer(reference, 1e-2)
    loss_fn = _loss_fn(script.SIZES["vocab"])
    ref_losses = [framework.train_step(reference, ref_opt, lambda i, t: loss_fn(reference(i), t),
                                       platform.from_numpy(t[:, :-1]),
                                       platform.from_numpy(t[:, 1:]), 1e9, hp.clip_grad_norm_)
                  for t in batches]
    platform.barrier()
    return {"pp_rank": mesh.get_local_rank("pp"), "crossed": losses, "ref_losses": ref_losses}


def save_whole(directory: str) -> None:
    """In one process: the whole model trained ``SAVE_AT`` steps, saved as
    ``directory``/pp2 (what ``resume_pp2`` loads)."""
    script, framework = _modules()
    platform = hp.get_platform()
    model = framework.build(script.initial_values(), **script.SIZES)
    opt = framework.optimizer(model, 1e-2)
    loss_fn = _loss_fn(script.SIZES["vocab"])
    for t in script.batches(STEPS)[:SAVE_AT]:
        framework.train_step(model, opt, lambda i, t: loss_fn(model(i), t),
                             platform.from_numpy(t[:, :-1]), platform.from_numpy(t[:, 1:]),
                             1e9, hp.clip_grad_norm_)
    hp.save_checkpoint(os.path.join(directory, "pp2"), model, opt, key_map=hp.torch_nn_names)


def resume_whole(directory: str) -> list:
    """In one process: the pp 2 checkpoint loaded into the whole model (built with other
    values) and its optimizer, trained on; the losses of the steps after ``SAVE_AT``."""
    script, framework = _modules()
    platform = hp.get_platform()
    model = framework.build(script.initial_values(seed=3), **script.SIZES)
    opt = framework.optimizer(model, 1e-2)
    hp.load_checkpoint(os.path.join(directory, "pp2"), model, opt, key_map=hp.torch_nn_names)
    loss_fn = _loss_fn(script.SIZES["vocab"])
    return [framework.train_step(model, opt, lambda i, t: loss_fn(model(i), t),
                                 platform.from_numpy(t[:, :-1]), platform.from_numpy(t[:, 1:]),
                                 1e9, hp.clip_grad_norm_)
            for t in script.batches(STEPS)[SAVE_AT:]]
