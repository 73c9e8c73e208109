"""Backend-agnostic fully_shard: imports no framework, talks to one Platform."""

from hyper_parallel.fully_shard.api import FSDPModule, fully_shard
from hyper_parallel.fully_shard.mesh import DeviceMesh, init_device_mesh
from hyper_parallel.fully_shard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "DeviceMesh", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "fully_shard", "init_device_mesh"]
