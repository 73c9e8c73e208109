"""hyper_parallel: FSDP2-style fully_shard for PyTorch and MindSpore.

Importing this package loads no framework; the first call that needs one picks it:
HP_BACKEND, else the model's framework, else the one the script imported
(hyper_parallel.platform, [Note: which framework]). Every name is the same object on every
framework: the tensor-parallel ones (``parallelize_module``, the styles, ``Shard``/
``Replicate``, ``loss_parallel``, ``cross_entropy``) are hyper_parallel.tensor_parallel's,
written once, so a script moves between the frameworks with its model and nothing else
(on torch, ``parallelize_module`` also takes torch's own styles and meshes).
"""

from hyper_parallel.checkpoint import (
    CheckpointError, ShardedValue, export_full, gather_full_state_dict, get_full_state_dict,
    get_state_dict, load_checkpoint, save_checkpoint, set_state_dict, torch_nn_names,
    SplitKey, per_expert_keys,
)
from hyper_parallel.clip_grad import clip_grad_norm_
from hyper_parallel.comm_stats import CommStats, comm_stats, track_comms
from hyper_parallel.distributed import destroy_distributed, init_distributed
from hyper_parallel.fully_shard import (
    CPUOffloadPolicy, DataParallelMeshDims, DeviceMesh, FSDPModule, MixedPrecisionPolicy,
    OffloadPolicy, ShardPlacementResult, UnshardHandle, fully_shard, init_device_mesh,
    register_fsdp_forward_method, share_comm_ctx,
)
from hyper_parallel.fully_shard import (
    CastGather, GatherCodec, GatherContext, Int8RowGather, set_gather_codec,
)
from hyper_parallel.expert_parallel import ExpertParallel, update_expert_bias
from hyper_parallel import interop
from hyper_parallel import pipelining
from hyper_parallel.platform import get_platform
from hyper_parallel.tensor_parallel import (
    ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput, Replicate,
    RowwiseParallel, SequenceParallel, Shard, cross_entropy, loss_parallel, parallelize_module,
)

from hyper_parallel.context_parallel import context_parallel, scaled_dot_product_attention

interop.register()  # torch's platform with its ecosystem's adapters (interop/__init__.py)

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy", "CheckpointError", "CommStats", "DataParallelMeshDims", "DeviceMesh",
    "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "ShardPlacementResult", "ShardedValue",
    "clip_grad_norm_", "comm_stats", "destroy_distributed", "export_full", "fully_shard",
    "gather_full_state_dict",
    "get_full_state_dict", "get_platform", "get_state_dict", "init_device_mesh",
    "init_distributed", "load_checkpoint", "register_fsdp_forward_method", "save_checkpoint",
    "set_state_dict", "share_comm_ctx", "torch_nn_names", "track_comms", "UnshardHandle",
    "SplitKey", "per_expert_keys",
    "CastGather", "GatherCodec", "GatherContext", "Int8RowGather", "set_gather_codec",
    "ColwiseParallel", "PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput",
    "Replicate", "RowwiseParallel", "SequenceParallel", "Shard", "cross_entropy",
    "loss_parallel", "parallelize_module",
    "ExpertParallel", "update_expert_bias",
    "pipelining",
    "context_parallel", "scaled_dot_product_attention",
]
