"""Backend-agnostic fully_shard: imports no framework, talks to one Platform."""

from hyper_parallel.fully_shard.api import FSDPModule, fully_shard
from hyper_parallel.fully_shard.forward_method import register_fsdp_forward_method
from hyper_parallel.fully_shard.fsdp_module import UnshardHandle, share_comm_ctx
from hyper_parallel.fully_shard.codec_choice import set_gather_codec
from hyper_parallel.fully_shard.gather_codec import CastGather, GatherCodec, GatherContext, Int8RowGather
from hyper_parallel.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.fully_shard.mesh import DataParallelMeshDims
from hyper_parallel.fully_shard.placement import ShardPlacementResult
from hyper_parallel.fully_shard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "DeviceMesh", "FSDPModule",
           "MixedPrecisionPolicy", "OffloadPolicy", "ShardPlacementResult", "fully_shard",
           "init_device_mesh", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx",
           "CastGather", "GatherCodec", "GatherContext", "Int8RowGather", "set_gather_codec"]
