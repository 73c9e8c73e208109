"""Rank side of tests/test_torchtitan.py's float8 cases: torchtitan 0.3.0's
``Float8LinearConverter`` on the Llama 3 model of tests/torchtitan_scenarios.py (float32,
selective activation checkpointing, 2 ranks fully sharded), under FSDP2 and under
hyper_parallel's ``fully_shard``.

[Note: what torchtitan 0.3.0's float8 path is on CPU]
Its converter checks the hardware when it is built: without NVIDIA SM89+ or AMD MI300+
only ``emulate=True`` passes (``has_cuda_capability(8, 9) or has_rocm_capability(9, 4) or
(emulate and not model_compile_enabled)``, else a ValueError), and ``emulate=True``
replaces the recipe with torchao's ``Float8LinearConfig(emulate=True)``: tensorwise
dynamic scaling, matmuls emulated in high precision. The converter swaps every
``Linear.Config`` whose dims are multiples of 16 (here every linear of the blocks and the
head) for its ``Float8Linear.Config``, whose module calls torchao's ``Float8Linear``
constructor. torchtitan 0.3.0 has no setting for FSDP float8 all-gather and never calls
``precompute_float8_dynamic_scale_for_fsdp``; and torchao wraps a weight for float8
all-gather (``WeightWithDynamicFloat8CastTensor``) only in ``Float8Linear.from_float``,
which torchtitan's modules do not go through, so ``enable_fsdp_float8_all_gather=True``
put in the converter's torchao config changes nothing by itself. ``wrap_for_float8_gather``
does what ``from_float`` does, on the model built on meta, before parallelization.

Runs (``RUNS``): FSDP2 as torchtitan builds the model (float8 all-gather off: gloo refuses
FSDP2's float8 all-gather, "Invalid scalar type"); hyper_parallel with the flag set in the
converter's torchao config only; hyper_parallel with the weights wrapped (float8 all-gather
on), without and with the scales precomputed after each optimizer step (torchao's
``precompute_float8_dynamic_scale_for_fsdp``). With tensorwise scales from an amax over the
whole weight, all compute the same math.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from unittest import mock

import hyper_parallel as hp

from tests import torchtitan_scenarios as titan

MP = "float32"
#: result key -> (fully_shard's implementation, enable_fsdp_float8_all_gather in the
#: converter's torchao config, weights wrapped for float8 all-gather, precomputed scales)
RUNS = {"fsdp2": ("fsdp2", False, False, False),
        "hp_flag_only": ("hp", True, False, False),
        "hp_float8_gather": ("hp", True, True, False),
        "hp_float8_gather_precompute": ("hp", True, True, True)}


def converted_config(float8_all_gather: bool):
    """The Llama 3 config through torchtitan's ``Float8LinearConverter`` (as its
    ``model_registry(..., converters=[...])`` applies it), emulated; with
    ``float8_all_gather`` its torchao config asks for FSDP float8 all-gather."""
    from torchtitan.components.quantization import Float8LinearConverter

    converter = Float8LinearConverter.Config(emulate=True).build()
    if float8_all_gather:
        converter.torchao_config = dataclasses.replace(converter.torchao_config,
                                                       enable_fsdp_float8_all_gather=True)
    return converter.convert(titan._model_config(False))


def wrap_for_float8_gather(model) -> None:
    """Each float8 linear whose config asks for FSDP float8 all-gather gets its weight
    wrapped as torchao's ``Float8Linear.from_float`` wraps it (module docstring)."""
    import torch
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    from torchtitan.components.quantization import Float8Linear

    for module in model.modules():
        if isinstance(module, Float8Linear) and module.config.enable_fsdp_float8_all_gather:
            module.weight = torch.nn.Parameter(
                WeightWithDynamicFloat8CastTensor(
                    module.weight, module.linear_mm_config,
                    module.config.cast_config_weight.target_dtype),
                requires_grad=module.weight.requires_grad)


@contextlib.contextmanager
def precomputed_scales(model):
    """torchao's ``precompute_float8_dynamic_scale_for_fsdp(model)`` after every optimizer
    step inside the block (torch's global optimizer post-step hook)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    handle = register_optimizer_step_post_hook(
        lambda *args: precompute_float8_dynamic_scale_for_fsdp(model))
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def float8_gathers():
    """The shard sizes (elements) of every float8 pre-all-gather hook call in the block,
    in order: what hyper_parallel sends in float8."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    original, numels = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather, []

    @functools.wraps(original)
    def recorded(self, *args, **kwargs):
        numels.append(self.numel())
        return original(self, *args, **kwargs)

    with mock.patch.object(WeightWithDynamicFloat8CastTensor, "fsdp_pre_all_gather", recorded):
        yield numels


def trainer_config():
    """The ``Trainer.Config`` of these runs: float32, selective activation checkpointing,
    every rank data-parallel shard, under "partial_dtensor" (the backend FSDP2 takes)."""
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.trainer import Trainer

    return Trainer.Config(
        training=TrainingConfig(mixed_precision_param=MP, seq_len=titan.SEQ,
                                local_batch_size=titan.LOCAL_BATCH),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        activation_checkpoint=SelectiveAC.Config())


def run() -> dict:
    """Each of RUNS from the same initial parameters on the same data, the model
    configured and parallelized as torchtitan's Trainer does: what ``titan.train``
    returns, the float8 gather hook's calls, the names of the float8 linears' weights and
    how many of them hold a precomputed scale at the end."""
    titan.import_torchtitan()
    from torchtitan.components.quantization import Float8Linear
    from torchtitan.distributed import ParallelDims, utils as dist_utils

    world = hp.get_platform().world_size()
    config = trainer_config()
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    batches, rows = titan._batches(world), titan._rows(1)
    initial = {name: p.detach() for name, p in titan._whole(False).named_parameters()}
    out = {}
    for key, (impl, flag, wrapped, precompute) in RUNS.items():
        parallel_dims = ParallelDims.from_config(config.parallelism, world)
        model = titan._sharded(impl, "selective", MP, False, parallel_dims, initial,
                               trainer_config=config,
                               model_config=converted_config(flag),
                               before_parallelize=wrap_for_float8_gather if wrapped else None)
        with precomputed_scales(model) if precompute else contextlib.nullcontext(), \
                float8_gathers() as numels:
            out[key] = titan.train(model, batches, rows, parallel_dims)
        out[key]["float8_gathered_numels"] = numels
        float8_linears = {titan._canonical(name): module for name, module
                          in model.named_modules() if isinstance(module, Float8Linear)}
        out[key]["float8_weights"] = sorted(f"{name}.weight" for name in float8_linears)
        out[key]["precomputed_scales"] = sum(
            getattr(module.weight._local_tensor, "_precomputed_scale", None) is not None
            for module in float8_linears.values())
    return out
