"""Rank side of tests/test_torchtitan.py: torchtitan 0.3.0's own Llama 3 training, under
torch's ``fully_shard`` and under hyper_parallel's in its place.

torchtitan's ``Trainer`` cannot be built here (its setup assumes a GPU; its ``Config`` can,
tests/torchtitan_trainer_config_scenarios.py). So ``train`` drives the pieces the trainer drives,
with its code: the Llama 3 model (a tiny config, ``_model_config``), ``parallelize_llama``
(activation checkpointing, then ``fully_shard`` on the blocks, on ``[norm, lm_head]`` and on
the model, through ``apply_fsdp_to_decoder``), ``init_weights``, the chunked loss
(``ChunkedLossWrapper``), its gradient clipping, optimizer and LR scheduler containers, and
``Trainer.train_step``'s loop body (``_step``). What is not torchtitan's own:

- ``import_torchtitan``: the expert-parallel Triton kernels torchtitan imports on every
  model import are stubbed (there is no triton on a CPU-only torch, and a dense Llama never
  calls them), and its meshes are built on "cpu" (its device type is "cuda" without a GPU);
- attention is its ``ScaledDotProductAttention`` (its FlexAttention compiles, too slow on
  CPU), swapped in as torchtitan's graph_trainer tests do;
- ``spmd_backend="partial_dtensor"``: FSDP2 takes torchtitan's parameters only in that mode
  (in the others, "spmd_types" by default, torchtitan passes torch's ``DataParallelMeshDims``
  with plain parameters, which FSDP2 refuses); hyper_parallel takes them, so it also runs
  ``SPMD_DEFAULT_CONFIGS`` under torchtitan's default "spmd_types";
- FSDP2's units reduce with SUM (``set_force_sum_reduction_for_comms``): torchtitan sets
  the gradient divide factor to 1.0, which FSDP2 turns into a PREMUL_SUM that gloo lacks
  (hyper_parallel's collectives always sum, and scale apart).

hyper_parallel stands in through ``in_place_of_fsdp2``: the ``fully_shard`` torchtitan
calls. Nothing else is rebound: hyper_parallel's units are instances of torch's
``FSDPModule``, so torchtitan's ``isinstance`` checks (its gradient divide factor of 1.0,
``ChunkedLossWrapper``'s gathered ``lm_head`` across the chunks) find them as they are.
Its ``MixedPrecisionPolicy`` is torch's own object, which ``hp.fully_shard`` accepts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from unittest import mock

import numpy as np

import hyper_parallel as hp

STEPS = 4
LOCAL_BATCH, SEQ = 2, 32
DIM, HEADS, LAYERS, VOCAB = 64, 4, 2, 256
CHUNKS = 8          # ChunkedLossWrapper's default
LR = 8e-4           # the debugmodel's AdamW
MAX_NORM = 1.0      # TrainingConfig's default
# (activation checkpointing, mixed_precision_param, tied embeddings); the first is
# torchtitan's debugmodel setting (selective AC, bf16 parameters with fp32 reduction)
CONFIGS = [("selective", "bfloat16", False), ("full", "bfloat16", False),
           ("none", "bfloat16", False), ("selective", "float32", False),
           ("full", "float32", False), ("none", "float32", False),
           ("selective", "bfloat16", True)]
SPMD_DEFAULT = "spmd_types"  # torchtitan's default spmd_backend, which FSDP2 refuses
# the configs hyper_parallel also trains under SPMD_DEFAULT: the debugmodel's, and float32
SPMD_DEFAULT_CONFIGS = [("selective", "bfloat16", False), ("selective", "float32", False)]
# (result key, fully_shard's implementation, spmd_backend) of the mixture-of-experts runs
RUNS = (("fsdp2", "fsdp2", "partial_dtensor"), ("hp", "hp", "partial_dtensor"),
        (f"hp_{SPMD_DEFAULT}", "hp", SPMD_DEFAULT))
# Qwen3-MoE (run_moe): selective AC, float32 (ties do not apply)
MOE_AC, MOE_MP = "selective", "float32"


def config_name(ac: str, mp: str, tied: bool) -> str:
    return f"{ac}-{mp}" + ("-tied" if tied else "")


def import_torchtitan():
    """torchtitan's modules the run uses, importable on a CPU-only torch (module docstring)."""
    kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")

    def missing(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{name} is a Triton kernel of expert parallelism, stubbed "
                               f"by tests/torchtitan_scenarios.py")
        return unavailable

    kernels.__getattr__ = missing
    if importlib.util.find_spec("triton") is None:
        sys.modules.setdefault(kernels.__name__, kernels)
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"


@contextlib.contextmanager
def in_place_of_fsdp2():
    """hyper_parallel's ``fully_shard`` where torchtitan looks up FSDP2's: the name
    ``torchtitan.distributed.fsdp`` imported, which ``apply_fsdp_to_decoder`` calls."""
    import torchtitan.distributed.fsdp as titan_fsdp

    with mock.patch.object(titan_fsdp, "fully_shard", hp.fully_shard):
        yield


def _model_config(tied: bool):
    """The debugmodel flavour's build (torchtitan.models.llama3._debugmodel), smaller, with
    SDPA attention; ``tied``: embedding and output share their weight, as from the 1B on."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers, _output_linear_init,
    )

    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000,
                                    scaling="llama"),
            attn_backend="flex"))
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _moe_config():
    """Qwen3-MoE's build (torchtitan.models.qwen3's debugmodel_moe), smaller, with SDPA
    attention: 4 experts, 2 routed per token, auxiliary-loss-free load balancing (its
    default ``load_balance_coeff``)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT, _LINEAR_INIT, Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm,
    )

    head_dim = DIM // HEADS
    config = Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=HEADS // 2,
            head_dim=head_dim, moe_hidden_dim=48, num_experts=4, top_k=2, attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=1000000.0),
            moe_comm_backend="standard"))
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _whole(tied: bool, moe: bool = False):
    """The single-process model: torchtitan's init on the whole model, float32, no AC, no
    fully_shard. Its initial parameters are every run's."""
    import torch

    torch.manual_seed(0)
    model = (_moe_config() if moe else _model_config(tied)).build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _canonical(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "")


def _sharded(impl: str, ac: str, mp: str, tied: bool, parallel_dims, initial: dict,
             moe: bool = False, trainer_config=None, model_config=None,
             before_parallelize=None):
    """torchtitan's model (Llama 3, or with ``moe`` Qwen3-MoE), built on meta, parallelized
    by its own ``parallelize_*`` with ``impl``'s fully_shard under ``parallel_dims``'
    spmd_backend, materialised and initialised as its trainer does, then given ``initial``.
    With ``trainer_config`` (a ``Trainer.Config``), the model's config is first updated from
    it as the trainer does (``update_from_config``: its sharding config). ``model_config``:
    the Llama 3 config to build instead of ``_model_config(tied)`` (e.g. a converter's);
    ``before_parallelize``: a function of the model built on meta, run before
    parallelization."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import distribute_tensor
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    config = model_config or (_moe_config() if moe else _model_config(tied))
    ac_config = {"selective": SelectiveAC.Config(), "full": FullAC.Config(), "none": None}[ac]
    training = TrainingConfig(mixed_precision_param=mp)
    parallelism = ParallelismConfig(spmd_backend=parallel_dims.spmd_backend)
    if trainer_config is not None:
        config.update_from_config(config=trainer_config)
        training, parallelism = trainer_config.training, trainer_config.parallelism
        ac_config = trainer_config.activation_checkpoint
    with torch.device("meta"):
        model = config.build()
    if before_parallelize is not None:
        before_parallelize(model)
    parallelize = parallelize_qwen3 if moe else parallelize_llama
    with in_place_of_fsdp2() if impl == "hp" else contextlib.nullcontext():
        parallelize(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                    compile_config=CompileConfig(), ac_config=ac_config, dump_folder="")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for name, param in model.named_parameters():
            param.copy_(distribute_tensor(initial[_canonical(name)], param.device_mesh,
                                          param.placements))
    if impl == "fsdp2":  # gloo has no PREMUL_SUM (module docstring)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def _batches(data_parallel: int) -> list:
    """(tokens, labels) of the global batch per step; a few labels of the first rows are
    ignored, so the ranks hold different numbers of valid tokens."""
    import torch
    from torchtitan.components.loss import IGNORE_INDEX

    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(VOCAB, (LOCAL_BATCH * data_parallel, SEQ + 1),
                               generator=generator)
        labels = tokens[:, 1:].clone()
        labels[0, :5] = IGNORE_INDEX
        out.append((tokens[:, :-1].contiguous(), labels))
    return out


def _step(model, loss_fn, optimizers, schedulers, inputs, labels, batch_mesh, loss_mesh,
          ep_enabled):
    """torchtitan's ``Trainer.train_step`` for one micro-batch without pipelining (its
    ``forward_backward_step`` and ``_forward_backward_body`` inlined): the loss is this rank's
    sum over the global number of valid tokens, clipped, stepped; returns the global loss
    and the gradient norm."""
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    optimizers.zero_grad(set_to_none=False)  # disable_cuda_graphs is False by default
    local_valid_tokens = (labels != IGNORE_INDEX).sum()
    global_valid_tokens = (dist_utils.dist_sum_tensor(local_valid_tokens, batch_mesh)
                           if batch_mesh is not None else local_valid_tokens)
    pred = model(inputs)
    loss, _ = loss_fn(pred, labels, global_valid_tokens)
    del pred
    loss.backward()
    grad_norm = dist_utils.clip_grad_norm_(list(model.parameters()), MAX_NORM, foreach=True,
                                           pp_mesh=None, ep_enabled=ep_enabled)
    optimizers.step()
    schedulers.step()
    global_loss = (dist_utils.dist_sum(loss.detach(), loss_mesh) if loss_mesh is not None
                   else float(loss.detach()))
    return global_loss, float(grad_norm)


def train(model, batches, rows: slice, parallel_dims=None) -> dict:
    """STEPS steps of torchtitan's training on ``rows`` of each global batch: the
    debugmodel's chunked loss, AdamW and LR schedule (the warmup shortened to fit STEPS),
    and for a mixture of experts its load-balancing hook (each step's expert bias from the
    tokens routed on every rank). Returns the global losses, gradient norms,
    hyper_parallel's reduce-scatters and all-gather bytes per step, the final full
    parameters and expert biases."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import (
        LRSchedulersContainer, default_adamw, register_moe_load_balancing_hook)

    loss_fn = ChunkedLossWrapper.Config(
        num_chunks=CHUNKS, loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB)).build()
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = default_adamw(lr=LR).build(model_parts=[model])
    register_moe_load_balancing_hook(optimizers, [model], parallel_dims or _OneProcess())
    schedulers = LRSchedulersContainer.Config(
        warmup_steps=1, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0,
    ).build(optimizers=optimizers, training_steps=STEPS)
    meshes = ((parallel_dims.get_mesh("batch"), parallel_dims.get_optional_mesh("loss"))
              if parallel_dims is not None else (None, None))
    out = {"losses": [], "grad_norms": [], "reduce_scatters": [], "all_gather_bytes": []}
    for inputs, labels in batches:
        with hp.track_comms() as comms:
            loss, norm = _step(model, loss_fn, optimizers, schedulers, inputs[rows],
                               labels[rows], *meshes,
                               parallel_dims is not None and parallel_dims.ep_enabled)
        out["losses"].append(loss)
        out["grad_norms"].append(norm)
        out["reduce_scatters"].append(comms.calls("reduce_scatter"))
        out["all_gather_bytes"].append(comms.nbytes("all_gather"))
    out["params"] = {_canonical(name): _full(param) for name, param in model.named_parameters()}
    out["expert_biases"] = {_canonical(name): _full(buffer)
                            for name, buffer in model.named_buffers() if "expert_bias" in name}
    return out


class _OneProcess:
    """What torchtitan's load-balancing hook reads of its ParallelDims, for the
    single-process reference: no expert or tensor parallelism, no mesh to sum tokens over."""

    ep_enabled, tp = False, 1

    def get_optional_mesh(self, name):
        return None


def _full(param) -> np.ndarray:
    import torch

    value = param.full_tensor() if hasattr(param, "full_tensor") else param
    return value.detach().to(torch.float32).numpy()


def _parallel_dims(spmd_backend: str, world: int):
    """torchtitan's ParallelDims of ``world`` ranks, fully sharded over all of them, under
    ``spmd_backend`` (set globally, as its trainer does)."""
    from torchtitan.distributed import ParallelDims, utils as dist_utils

    dist_utils.set_spmd_backend(spmd_backend)
    return ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1,
                        world_size=world, spmd_backend=spmd_backend)


def _rows(tp: int) -> slice:
    """This rank's rows of each global batch: tensor parallelism is the mesh's innermost
    dim, so the ranks of one tensor-parallel group share their data-parallel index."""
    index = hp.get_platform().rank() // tp
    return slice(index * LOCAL_BATCH, (index + 1) * LOCAL_BATCH)


def run() -> dict:
    """Each of CONFIGS trained under FSDP2 and under hyper_parallel on this rank's rows,
    beside the float32 whole model trained on every row; SPMD_DEFAULT_CONFIGS under
    hyper_parallel with SPMD_DEFAULT too."""
    import_torchtitan()
    world = hp.get_platform().world_size()
    parallel_dims = _parallel_dims("partial_dtensor", world)
    batches, rows = _batches(world), _rows(1)
    out, references = {}, {}
    for ac, mp, tied in CONFIGS:
        initial = {name: p.detach() for name, p in _whole(tied).named_parameters()}
        result = {}
        for impl in ("fsdp2", "hp"):
            model = _sharded(impl, ac, mp, tied, parallel_dims, initial)
            result[impl] = train(model, batches, rows, parallel_dims)
        if tied not in references:
            references[tied] = train(_whole(tied), batches, slice(None))
        result["reference"] = references[tied]
        out[config_name(ac, mp, tied)] = result
    parallel_dims = _parallel_dims(SPMD_DEFAULT, world)
    for ac, mp, tied in SPMD_DEFAULT_CONFIGS:
        initial = {name: p.detach() for name, p in _whole(tied).named_parameters()}
        model = _sharded("hp", ac, mp, tied, parallel_dims, initial)
        out[config_name(ac, mp, tied)][f"hp_{SPMD_DEFAULT}"] = train(model, batches, rows,
                                                                     parallel_dims)
    return out


def run_moe() -> dict:
    """torchtitan's Qwen3-MoE (``_moe_config``) with its load balancing, float32, selective
    AC, on this rank's rows: under FSDP2 and hyper_parallel with "partial_dtensor", under
    hyper_parallel with SPMD_DEFAULT, both again with expert parallelism
    (``expert_parallel_runs``), and the whole model on every row."""
    import_torchtitan()
    world = hp.get_platform().world_size()
    batches, rows = _batches(world), _rows(1)
    initial = {name: p.detach() for name, p in _whole(False, moe=True).named_parameters()}
    out = {}
    for key, impl, spmd_backend in RUNS:
        parallel_dims = _parallel_dims(spmd_backend, world)
        model = _sharded(impl, MOE_AC, MOE_MP, False, parallel_dims, initial, moe=True)
        out[key] = train(model, batches, rows, parallel_dims)
    out.update(expert_parallel_runs(world, initial, batches, rows))
    out["reference"] = train(_whole(False, moe=True), batches, slice(None))
    return out


def expert_parallel_runs(world: int, initial: dict, batches: list, rows: slice) -> dict:
    """Qwen3-MoE at ``expert_parallel_degree=2`` configured as torchtitan's Trainer does
    (``update_from_config``, ``ParallelDims.from_config``): its ``ExpertParallel`` all-to-all
    dispatch, the experts fully sharded over the ``efsdp`` ranks left in each expert group
    through ``shard_placement_fn``'s per-parameter meshes (FSDP2's ``ShardPlacementResult``
    with its ``mesh_info``), the rest over every rank, its gradient clipping over both
    meshes (``ep_enabled``); under FSDP2 ("fsdp2_ep2") and hyper_parallel ("hp_ep2")."""
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.trainer import Trainer

    config = Trainer.Config(
        training=TrainingConfig(mixed_precision_param=MOE_MP, seq_len=SEQ,
                                local_batch_size=LOCAL_BATCH),
        parallelism=ParallelismConfig(expert_parallel_degree=2, spmd_backend="partial_dtensor"),
        activation_checkpoint=SelectiveAC.Config())
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    out = {}
    for impl in ("fsdp2", "hp"):
        parallel_dims = ParallelDims.from_config(config.parallelism, world)
        model = _sharded(impl, MOE_AC, MOE_MP, False, parallel_dims, initial, moe=True,
                         trainer_config=config)
        out[f"{impl}_ep2"] = train(model, batches, rows, parallel_dims)
    return out
