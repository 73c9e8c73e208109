"""Rank side of tests/test_torchtitan.py's cases of the model configured as torchtitan's
``Trainer`` configures it: ``model_config.update_from_config(trainer_config)``, which with
tensor parallelism on installs the Llama 3 sharding config (``set_llama3_sharding_config``),
so each module distributes its own parameters and redistributes its inputs in its forward
(torchtitan's ``Module.parallelize``), and ``ParallelDims.from_config``. Otherwise as
tests/torchtitan_scenarios.py: the same model, data, loss, optimizer and loop.

FSDP2 trains this model under ``spmd_backend="partial_dtensor"`` only (under "full_dtensor"
and the default "spmd_types" its ``fully_shard`` refuses the parameters torchtitan gives
it), so that is the backend both run under.
"""

from __future__ import annotations

import hyper_parallel as hp

from tests import torchtitan_scenarios as titan

TP = 2
SPMD_BACKEND = "partial_dtensor"
# (activation checkpointing, mixed_precision_param): the debugmodel's setting, and float32
# without activation checkpointing against the single-process reference
CONFIGS = [("selective", "bfloat16"), ("none", "float32")]
# Qwen3-MoE at expert_parallel_degree=2 over the 4 ranks: 2 expert groups of 2 ranks, each
# expert fully sharded over the 2 "efsdp" ranks of its group (torchtitan_scenarios.py)
MOE_EP = "moe-ep2"


def trainer_config(ac: str, mp: str):
    """The ``Trainer.Config`` a user writes for 4 ranks: tensor parallel 2 with sequence
    parallelism (its default), data parallel shard over the rest."""
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.trainer import Trainer

    ac_config = {"selective": SelectiveAC.Config(), "full": FullAC.Config(), "none": None}[ac]
    return Trainer.Config(
        training=TrainingConfig(mixed_precision_param=mp, seq_len=titan.SEQ,
                                local_batch_size=titan.LOCAL_BATCH),
        parallelism=ParallelismConfig(tensor_parallel_degree=TP, enable_sequence_parallel=True,
                                      spmd_backend=SPMD_BACKEND),
        activation_checkpoint=ac_config)


def run() -> dict:
    """Each of CONFIGS under FSDP2 and under hyper_parallel on this rank's rows, and the
    float32 whole model on every row; MOE_EP likewise, with the whole MoE model."""
    from torchtitan.distributed import ParallelDims, utils as dist_utils

    titan.import_torchtitan()
    world = hp.get_platform().world_size()
    batches, rows = titan._batches(world // TP), titan._rows(TP)
    initial = {name: p.detach() for name, p in titan._whole(False).named_parameters()}
    out = {"reference": titan.train(titan._whole(False), batches, slice(None))}
    for ac, mp in CONFIGS:
        config = trainer_config(ac, mp)
        dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
        result = {}
        for impl in ("fsdp2", "hp"):
            parallel_dims = ParallelDims.from_config(config.parallelism, world)
            model = titan._sharded(impl, ac, mp, False, parallel_dims, initial,
                                   trainer_config=config)
            result[impl] = titan.train(model, batches, rows, parallel_dims)
        out[titan.config_name(ac, mp, False)] = result
    moe_initial = {name: p.detach() for name, p in titan._whole(False, moe=True).named_parameters()}
    batches, rows = titan._batches(world), titan._rows(1)
    out[MOE_EP] = titan.expert_parallel_runs(world, moe_initial, batches, rows)
    out[MOE_EP]["reference"] = titan.train(titan._whole(False, moe=True), batches, slice(None))
    return out
