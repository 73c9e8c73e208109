"""Rank side of tests/test_torchtitan.py's pipeline cases: torchtitan 0.3.0's pipeline path
on 4 ranks (pipeline parallel 2 x data-parallel shard 2), under FSDP2 and under
hyper_parallel's ``fully_shard``.

The model is tests/torchtitan_scenarios.py's Llama 3 (float32, selective activation
checkpointing), configured by a ``Trainer.Config`` with ``pipeline_parallel_degree=2``.
It is built on meta and handed to torchtitan's ``pipeline_llm``, as its Trainer does:
``pipeline_llm`` splits it into stages (``tok_embeddings`` and ``layers.0`` on the first,
``layers.1``, ``norm`` and ``lm_head`` on the last, for a single-stage schedule), runs ``parallelize_llama`` on each
stage's module (``fully_shard`` on its blocks and module over the data-parallel mesh) and
builds the schedule the config names (``SCHEDULES``; ``Interleaved1F1B`` makes two stages
per rank: ``tok_embeddings``, ``layers.0``, ``layers.1``, ``norm`` with ``lm_head``). Then, as the Trainer: ``to_empty`` and
``init_weights`` on each stage module, the chunked loss given the last stage's ``lm_head``,
and per step the schedule's ``step`` with this rank's rows (one microbatch a row), the
loss divided by the global number of valid tokens, gradients clipped across the stages
(``clip_grad_norm_`` with the pp mesh), AdamW and the LR schedule. torch 2.13's schedules
take the rank's whole batch and cut it into microbatches themselves (torchtitan 0.3.0's
Trainer passes ready microbatches as ``arg_mbs``/``target_mbs``, which ``step`` in torch
2.13 does not take); the microbatches are the same rows.

Collectives are counted per step for both runs by tests/pipeline_scenarios.py's c10d
dispatch counter, and for hyper_parallel by ``hp.track_comms``.
"""

from __future__ import annotations

import contextlib

import hyper_parallel as hp

from tests import torchtitan_scenarios as titan
from tests.pipeline_scenarios import _c10d_counter

PP = 2
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


def trainer_config(schedule: str):
    """The ``Trainer.Config`` a user writes for 4 ranks: pipeline parallel 2 with
    ``schedule``, data-parallel shard over the rest, one row per microbatch."""
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.trainer import Trainer

    return Trainer.Config(
        training=TrainingConfig(mixed_precision_param="float32", seq_len=titan.SEQ,
                                local_batch_size=titan.LOCAL_BATCH,
                                disable_cuda_graphs=True),  # required with pipelining
        parallelism=ParallelismConfig(pipeline_parallel_degree=PP,
                                      pipeline_parallel_schedule=schedule,
                                      pipeline_parallel_microbatch_size=1,
                                      spmd_backend="partial_dtensor"),
        activation_checkpoint=SelectiveAC.Config())


def _pipelined(impl: str, config, parallel_dims, initial: dict):
    """torchtitan's ``pipeline_llm`` over the model built on meta, with ``impl``'s
    fully_shard; the stage modules materialised, initialised and given ``initial``.
    Returns (schedule, stage modules, has first stage, has last stage, loss function)."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import distribute_tensor
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama

    model_config = titan._model_config(False)
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    loss_fn = ChunkedLossWrapper.Config(
        num_chunks=titan.CHUNKS,
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=titan.VOCAB)).build()
    with titan.in_place_of_fsdp2() if impl == "hp" else contextlib.nullcontext():
        schedule, parts, has_first, has_last = pipeline_llm(
            model, parallel_dims=parallel_dims, training=config.training,
            parallelism=config.parallelism, compile_config=config.compile,
            ac_config=config.activation_checkpoint, dump_folder="",
            device=torch.device("cpu"), model_config=model_config,
            parallelize_fn=parallelize_llama, loss_fn=loss_fn)
    for part in parts:
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(buffer_device=None)
            for name, param in part.named_parameters():
                param.copy_(distribute_tensor(initial[titan._canonical(name)],
                                              param.device_mesh, param.placements))
        part.train()
        if impl == "fsdp2":  # gloo has no PREMUL_SUM (tests/torchtitan_scenarios.py)
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
    if has_last:
        loss_fn.set_lm_head(parts[-1].lm_head)
        parts[-1]._skip_lm_head = True
    return schedule, parts, has_first, has_last


def _train(impl: str, schedule_name: str, initial: dict, batches, world: int) -> dict:
    """titan.STEPS steps of torchtitan's ``Trainer.train_step`` with pipelining (its
    ``pp_forward_backward_step`` inlined)."""
    import torch
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.distributed import ParallelDims, utils as dist_utils

    config = trainer_config(schedule_name)
    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    schedule, parts, has_first, has_last = _pipelined(impl, config, parallel_dims, initial)
    optimizers = default_adamw(lr=titan.LR).build(model_parts=parts)
    schedulers = LRSchedulersContainer.Config(
        warmup_steps=1, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0,
    ).build(optimizers=optimizers, training_steps=titan.STEPS)
    batch_mesh, loss_mesh = parallel_dims.get_mesh("batch"), parallel_dims.get_mesh("loss")
    index = batch_mesh.get_local_rank()
    rows = slice(index * titan.LOCAL_BATCH, (index + 1) * titan.LOCAL_BATCH)
    out = {"losses": [], "grad_norms": [], "reduce_scatters": [], "c10d": []}
    for inputs, labels in batches:
        inputs, labels = inputs[rows], labels[rows]
        optimizers.zero_grad(set_to_none=config.training.disable_cuda_graphs)
        counter = _c10d_counter()
        with hp.track_comms() as comms, counter:
            global_valid_tokens = dist_utils.dist_sum_tensor(
                (labels != IGNORE_INDEX).sum(), batch_mesh)
            losses = [] if has_last else None
            schedule.step(*((inputs,) if has_first else ()),
                          target=labels if has_last else None, losses=losses,
                          loss_kwargs={"global_valid_tokens": global_valid_tokens},
                          return_outputs=False)
            norm = dist_utils.clip_grad_norm_(
                [p for part in parts for p in part.parameters()], titan.MAX_NORM,
                foreach=True, pp_mesh=parallel_dims.get_mesh("pp"), ep_enabled=False)
        optimizers.step()
        schedulers.step()
        if has_last:
            out["losses"].append(dist_utils.dist_sum(torch.sum(torch.stack(losses)),
                                                     loss_mesh))
        out["grad_norms"].append(float(norm))
        out["reduce_scatters"].append(comms.calls("reduce_scatter"))
        out["c10d"].append(counter.counts)
    out["params"] = {titan._canonical(name): titan._full(param)
                     for part in parts for name, param in part.named_parameters()}
    out["expert_biases"] = {}
    return out


def run() -> dict:
    """Each of SCHEDULES under FSDP2 and under hyper_parallel, on this rank's stage."""
    titan.import_torchtitan()
    from torchtitan.distributed import utils as dist_utils

    world = hp.get_platform().world_size()
    dist_utils.set_spmd_backend("partial_dtensor")
    batches = titan._batches(world // PP)
    initial = {name: p.detach() for name, p in titan._whole(False).named_parameters()}
    return {name: {impl: _train(impl, name, initial, batches, world)
                   for impl in ("fsdp2", "hp")} for name in SCHEDULES}
