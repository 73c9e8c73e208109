"""Rank side of tests/test_pipelining.py's 3-D runs: examples/one_script's transformer cut
in two stages by ``hp.pipelining.pipeline_module_split`` (the embedding and the first
block; the second block, the norm and the head: tests/docs_examples_scenarios.py's
``lm_stage_names``), each stage's model part split by the tensor-parallel plan of
examples/one_script (the keys naming its own modules) over
``mesh["tp"]``, then its blocks and itself units over ``mesh["dp"]``, and trained by
``hp.pipelining.Schedule1F1B`` over ``mesh["pp"]``: mesh (pp 2, dp, tp 2). The last stage's
loss is ``hp.cross_entropy`` over the vocabulary-split logits inside ``hp.loss_parallel()``;
the gradients are clipped to ``MAX_NORM`` by ``hp.clip_grad_norm_(..., pp_mesh=mesh["pp"])``
(the norm over every stage, shard and tensor-parallel block). Against the unsplit model
trained in one process on the whole batch with the same AdamW and clipping: the last
stage's losses, every stage's gathered parameters, and the norms (equal on every rank)."""

from __future__ import annotations

import importlib

import numpy as np

import hyper_parallel as hp
from tests.docs_examples_scenarios import lm_stage_names, of_stage

STEPS = 5
SAVE_AT = 2
MICRO_BATCHES = 2
MAX_NORM = 0.5


def _plan_for(module, plan: dict) -> dict:
    names = {n.split(".")[0] for n, _ in hp.get_platform().named_modules(module) if n}
    return {key: style for key, style in plan.items() if key.split(".")[0] in names}


def _params(module) -> list:
    p = hp.get_platform()
    return [q for _, sub in p.named_modules(module) for _, q in p.direct_params(sub)]


def _deferred_whole(backend: str, framework, sizes: dict):
    """The whole model built without values (torch: on the meta device; MindSpore: under
    ``no_init_parameters``)."""
    if backend == "torch":
        import torch

        with torch.device("meta"):
            return framework.Transformer(**sizes)
    from mindspore.nn.utils import no_init_parameters

    with no_init_parameters():
        return framework.Transformer(**sizes)


def _materialised(backend: str, param) -> bool:
    return not param.is_meta if backend == "torch" else not param.has_init


def run(backend: str, dp: int, deferred: bool = False, save_to: str | None = None,
        resume_from: str | None = None) -> dict:
    """``deferred``: the whole model built without values, this rank's stage cut from it,
    split and sharded, then given its values (``hp.set_state_dict``, one parameter at a
    time): the other stages' parameters are never materialised on this rank. ``save_to``:
    a checkpoint after ``SAVE_AT`` steps (stored under torch's names). ``resume_from``:
    such a checkpoint loaded into the stages (built with other values), which train the
    steps after ``SAVE_AT`` only (``losses`` and ``norms`` are theirs)."""
    from examples.one_script import train as script

    framework = importlib.import_module(f"examples.one_script.model_{backend}")
    platform = hp.get_platform()
    mesh = hp.init_device_mesh(platform.device_type(), (2, dp, 2),
                               mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    vocab = script.SIZES["vocab"]
    whole = (_deferred_whole(backend, framework, script.SIZES) if deferred
             else framework.build(script.initial_values(seed=3 if resume_from else 0),
                                  **script.SIZES))
    names = lm_stage_names()
    stages, parts = hp.pipelining.pipeline_module_split(whole, mesh["pp"], "1F1B",
                                                        platform.device_type(), names)
    stage, module = stages[0], parts[0]
    mine = {id(q) for q in _params(module)}
    others = [q for q in _params(whole) if id(q) not in mine]
    # the stage's units and tensor-parallel layout made after the stage (torchtitan's order)
    hp.parallelize_module(module, mesh["tp"], _plan_for(module, script.tensor_parallel_plan()))
    for block in module.blocks:
        hp.fully_shard(block, mesh=mesh["dp"])
    hp.fully_shard(module, mesh=mesh["dp"])
    if deferred:
        if backend == "torch":
            module.to_empty(device="cpu")
        values = script.initial_values()
        native = hp.torch_nn_names if backend == "mindspore" else (lambda name: name)
        for key in hp.get_state_dict(module):  # the whole model's names
            hp.set_state_dict(module, {key: values[native(key)]}, strict=False)
    others_materialised = sum(_materialised(backend, q) for q in others)
    opt = framework.optimizer(module, 1e-2)

    def loss_fn(logits, targets):
        with hp.loss_parallel():
            return hp.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    schedule = hp.pipelining.Schedule1F1B(stage, MICRO_BATCHES, loss_fn=loss_fn)
    reference = framework.build(script.initial_values(), **script.SIZES)
    ref_opt = framework.optimizer(reference, 1e-2)

    def reference_loss(ids, targets):
        return hp.cross_entropy(reference(ids).reshape(-1, vocab), targets.reshape(-1))

    if resume_from is not None:
        hp.load_checkpoint(resume_from, module, opt, key_map=hp.torch_nn_names,
                           pp_mesh=mesh["pp"])
    losses, ref_losses, norms = [], [], []
    rows = script.BATCH // dp
    for step, tokens in enumerate(script.batches(STEPS)):
        if step == SAVE_AT and save_to is not None:
            hp.save_checkpoint(save_to, module, opt, key_map=hp.torch_nn_names,
                               pp_mesh=mesh["pp"])
        ref_losses.append(framework.train_step(
            reference, ref_opt, reference_loss, platform.from_numpy(tokens[:, :-1]),
            platform.from_numpy(tokens[:, 1:]), MAX_NORM, hp.clip_grad_norm_))
        if resume_from is not None and step < SAVE_AT:
            continue
        mine = tokens[dp_rank * rows:(dp_rank + 1) * rows]
        step_losses = []
        if stage.is_first:
            schedule.step(platform.from_numpy(mine[:, :-1]))
        else:
            schedule.step(target=platform.from_numpy(mine[:, 1:]), losses=step_losses)
            losses.append(float(np.mean([platform.to_numpy(v) for v in step_losses])))
        if backend == "torch":
            norm = hp.clip_grad_norm_(module.parameters(), MAX_NORM, pp_mesh=mesh["pp"])
            opt.step()
            opt.zero_grad()
        else:
            grads, norm = hp.clip_grad_norm_(module.trainable_params(), MAX_NORM,
                                             grads=stage.gradients(), pp_mesh=mesh["pp"])
            opt(grads)
        norms.append(float(platform.to_numpy(norm)))
    full = {k: np.asarray(v) for k, v in hp.gather_full_state_dict(module).items()}
    ref = of_stage({k: np.asarray(v) for k, v in hp.gather_full_state_dict(reference).items()},
                   names[pp_rank])
    platform.barrier()
    return {"pp_rank": pp_rank, "losses": losses if stage.is_last else None,
            "others_materialised": others_materialised, "others": len(others),
            "ref_losses": ref_losses, "norms": norms, "names_match": sorted(full) == sorted(ref),
            "param_rel_diff": max(float(np.abs(full[k] - ref[k]).max()
                                        / max(np.abs(ref[k]).max(), 1e-30)) for k in ref)}
