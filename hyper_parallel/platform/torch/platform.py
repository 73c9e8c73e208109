"""TorchPlatform: PyTorch on CPU (gloo) or CUDA (NCCL).

Every primitive is a direct call into torch; views are real on torch, so the "explicit
write" primitives are zero-copy here. Sharded parameters are DTensors over the torch
DeviceMesh behind our DeviceMesh, so torch tools written for FSDP2 parameters
(``clip_grad_norm_``, distributed checkpoint, ``full_tensor()``) work on them. What makes
the rest of torch's ecosystem accept the library's units (FSDPModule identity, FSDP2's
all-gather extension, torch's tensor-parallel DTensors) is hyper_parallel/interop/torch/,
which extends this class.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh, init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    ShardPlacementResult as _FSDP2ShardPlacementResult)
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.platform.torch import later_backward
from hyper_parallel.platform.base import MeshDescription, PlacementDescription, Platform
from hyper_parallel.platform.capabilities import Capabilities
from hyper_parallel.platform.torch.collective_ops import TorchCollectiveOps
from hyper_parallel.platform.torch.cp_support import TorchContextParallelSupport
from hyper_parallel.platform.torch.state_io import TorchStateIO
from hyper_parallel.platform.torch.storage_release import TorchStorageRelease
from hyper_parallel.platform.torch.tp_support import TorchTensorParallelSupport
from hyper_parallel.platform.torch.eager_hooks import call_eagerly, eager
from hyper_parallel.platform.torch.released_memory import ReleasedMemory
from hyper_parallel.platform.torch.unshard_function import run_differentiable

MIN_TORCH = (2, 13)  # the oldest release the suite runs on (make torch-compat)

_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
    "int8": torch.int8, "uint8": torch.uint8,
}

_SHARDED_PARAMS = "_hp_sharded_params"  # on a module: {attribute name: its sharded parameter}


def _register_sharded(module) -> None:
    """Make the module's registered parameters its sharded ones again where a full tensor
    (never a Parameter) is registered; a user's replacement stays for the next forward."""
    for name, param in module.__dict__[_SHARDED_PARAMS].items():
        if not isinstance(module._parameters.get(name), torch.nn.Parameter):
            module._parameters[name] = param


def _check_version() -> None:
    found = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if found < MIN_TORCH:
        raise ImportError(
            f"hyper_parallel needs torch >= {'.'.join(map(str, MIN_TORCH))}, found "
            f"{torch.__version__}; upgrade with: pip install 'torch>=2.13,<=2.14.1'")


class TorchPlatform(TorchCollectiveOps, TorchStateIO, TorchTensorParallelSupport,
                    TorchContextParallelSupport, TorchStorageRelease, Platform):
    name = "torch"

    def __init__(self) -> None:
        _check_version()
        super().__init__()
        # CUDA's caching allocator keeps freed blocks, CPU's malloc does not; the pool moves
        # memory with a private storage method (a torch without it frees).
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self._released = ReleasedMemory() if device == "cpu" and hasattr(
            torch.UntypedStorage, "_swap_data_ptr_") else None
        # own collectives: on CPU (gloo) a call costs tens of microseconds, copying 1 MiB in
        # and out about as much (make bench); CUDA keeps FSDP2's fused layout
        self._capabilities = Capabilities(
            device_type=device, can_release_storage=True, registers_full_tensors=True,
            reports_unused_grads=True,
            default_own_collective_bytes=1 << 20 if device == "cpu" else None)

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    # ------------------------------------------------------------------ process groups
    def is_initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def init_process_group(self, rank, world_size, master_addr, master_port, timeout_s):
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        dist.init_process_group(
            backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))

    def destroy_process_group(self) -> None:
        dist.destroy_process_group()

    def new_mesh_groups(self, device_type, mesh_shape, dim_names):
        if not dist.is_initialized() and "RANK" not in os.environ:  # env:// would fail on it
            raise RuntimeError("a device mesh on torch needs a process group and this process has "
                               "joined none; call hp.init_distributed() first (a process no "
                               "launcher started joins a one-rank group)")
        native = init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=tuple(dim_names))
        return self.mesh_from_native(native).groups, native

    def mesh_from_native(self, native_mesh):
        if not isinstance(native_mesh, TorchDeviceMesh):
            return None
        names = native_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(native_mesh.ndim))
        groups = [native_mesh.get_group(i) for i in range(native_mesh.ndim)]
        return MeshDescription(tuple(native_mesh.mesh.shape), tuple(names), groups,
                               native_mesh.device_type, native_mesh.mesh.tolist())

    def option_from_native(self, option):
        # imported on the first object that is not hyper_parallel's own, from where torch
        # defines them (the public names may be rebound, platform/torch/fsdp2_units.py)
        from torch.distributed.fsdp._fully_shard._fsdp_api import (
            DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy)

        known = (MixedPrecisionPolicy, OffloadPolicy, DataParallelMeshDims)
        if not isinstance(option, known):
            return None
        return type(option).__name__, {f.name: getattr(option, f.name)
                                       for f in dataclasses.fields(option)}

    def shard_placement_from_native(self, result):
        if not isinstance(result, _FSDP2ShardPlacementResult):
            return None
        info = result.mesh_info
        named = getattr(info, "dp_mesh_dims", None)
        if named is not None:  # FSDP2 read the data-parallel dims of a whole mesh by name
            return PlacementDescription(result.placement, info.spmd_mesh, named.shard_names,
                                        named.replicate_names)
        shard, replicate = info.shard_mesh_dim, getattr(info, "replicate_mesh_dim", None)
        return PlacementDescription(result.placement, info.mesh, () if shard is None else (shard,),
                                    () if replicate is None else (replicate,))

    def new_group(self, ranks, distinct=False):
        if len(ranks) == self.world_size() and not distinct:
            return dist.group.WORLD
        return dist.new_group(list(ranks))

    def mesh_from_groups(self, device_type, groups, rank_grid, dim_names):
        return TorchDeviceMesh.from_group(list(groups), device_type, mesh=rank_grid,
                                          mesh_dim_names=tuple(dim_names))

    def group_rank(self, group) -> int:
        return dist.get_rank(group)

    def group_size(self, group) -> int:
        return dist.get_world_size(group)

    # ------------------------------------------------------------------ tensors
    dtype_names = _DTYPES

    def is_tensor(self, obj) -> bool:
        return isinstance(obj, torch.Tensor)

    def element_size(self, dtype) -> int:
        return dtype.itemsize

    def zeros(self, shape, dtype):
        return torch.zeros(tuple(shape), dtype=dtype, device=self._capabilities.device_type)

    def empty(self, shape, dtype):
        shape = tuple(shape)
        kept = self._released and self._released.take(math.prod(shape) * dtype.itemsize)
        if kept is not None:
            return torch.empty(0, dtype=dtype).set_(kept, 0, shape)
        return torch.empty(shape, dtype=dtype, device=self._capabilities.device_type)

    def from_numpy(self, array):
        return torch.tensor(array, device=self._capabilities.device_type)

    def to_numpy(self, tensor):
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        return tensor.detach().cpu().numpy().copy()

    def cat(self, tensors, dim=0):
        return torch.cat(list(tensors), dim=dim)

    def clone(self, tensor):
        return tensor.clone()

    def scale(self, tensor, factor, may_overwrite=False):
        if may_overwrite:
            with torch.no_grad():
                return tensor.mul_(factor)
        return tensor * factor

    def vector_norm(self, tensor, norm_type):
        with torch.no_grad():
            return torch.linalg.vector_norm(tensor, norm_type, dtype=torch.float32)

    def copy_into(self, dst, src) -> None:
        # autograd saved ``dst`` for backward; refilling it with the same values is not
        # the in-place modification the version counter guards against.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(dst):
            dst.copy_(src)

    def no_grad(self):
        return torch.no_grad()

    def is_grad_enabled(self) -> bool:
        return torch.is_grad_enabled()

    def in_backward(self) -> bool:
        return torch._C._current_graph_task_id() != -1  # -1: no backward on this thread

    # ------------------------------------------------------------------ parameters
    def named_modules(self, module):
        return list(module.named_modules(remove_duplicate=False))

    def direct_params(self, module):
        return [(n, p) for n, p in module._parameters.items() if p is not None]

    def children_of(self, module):
        return module._modules, isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict,
                                                    torch.nn.Sequential))

    def register_param(self, module, attr_name, param) -> None:
        module._parameters[attr_name] = param
        sharded = module.__dict__.get(_SHARDED_PARAMS)
        if sharded is None:
            sharded = module.__dict__[_SHARDED_PARAMS] = {}
            # state dicts hold the sharded parameters whatever the unit's state (FSDP2)
            module.register_state_dict_pre_hook(lambda m, *_: _register_sharded(m))
            module.register_load_state_dict_pre_hook(lambda m, *_: _register_sharded(m))
        sharded[attr_name] = param

    def attach_tensor(self, module, attr_name, tensor) -> None:
        # As FSDP2: while the unit is unsharded, parameters() and named_parameters() yield
        # the full tensors; module.<attr_name> reads them from there.
        module._parameters[attr_name] = tensor

    def _sharded_param(self, module, attr_name):
        """The sharded parameter ``register_param`` gave ``module`` as ``attr_name``, None if
        none, also while a full tensor is attached in its place."""
        return module.__dict__.get(_SHARDED_PARAMS, {}).get(attr_name)

    def detach_tensor(self, module, attr_name) -> None:
        module._parameters[attr_name] = module.__dict__[_SHARDED_PARAMS][attr_name]

    def make_sharded_param(self, orig_param, local_shard, native_mesh, shard_mesh_dim,
                           shard_dim, full_shape, backing=None):
        placements = [Replicate()] * native_mesh.ndim
        if shard_dim is not None:
            placements[shard_mesh_dim] = Shard(shard_dim)
        return self._dtensor_param(orig_param, local_shard, native_mesh, placements, full_shape,
                                   backing)

    def _dtensor_param(self, orig_param, local_shard, mesh, placements, full_shape, backing):
        """The sharded parameter: a DTensor of ``local_shard`` over ``mesh``."""
        stride = torch.empty(full_shape, device="meta").stride()
        if backing is not None:
            own = local_shard.detach()  # a view of the caller's padded shard, kept as one
        else:
            # clone: a dim-0 narrow is already contiguous, and a view would keep the whole
            # unsharded parameter alive behind every shard
            own = local_shard.detach().clone(memory_format=torch.contiguous_format)
        dtensor = DTensor.from_local(own, mesh, placements,
                                     run_check=False, shape=torch.Size(full_shape), stride=stride)
        return torch.nn.Parameter(dtensor, requires_grad=orig_param.requires_grad)

    def local_tensor(self, param):
        return param.to_local()

    def is_deferred(self, tensor) -> bool:
        return tensor.is_meta

    def deferred_part(self, param, dim, start, length):
        return param.narrow(dim, start, length)

    def is_shard_like(self, new, sharded) -> bool:
        return isinstance(new, DTensor) and new.shape == sharded.shape and \
            new.device_mesh == sharded.device_mesh and \
            tuple(new.placements) == tuple(sharded.placements)

    def replace_local(self, param, local) -> bool:
        if not isinstance(param, DTensor):
            return False
        param._local_tensor = local  # as FSDP2 re-pads a materialised shard
        return True

    def starts_with(self, whole, part) -> bool:
        return part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() and \
            part.storage_offset() == whole.storage_offset() and part.is_contiguous()

    def write_grad(self, param, placeholder, local_grad, to_main_grad) -> None:
        if to_main_grad:
            local_grad = local_grad.to(torch.float32)
        grad = DTensor.from_local(local_grad, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
        attr = "main_grad" if to_main_grad else "grad"
        existing = getattr(param, attr, None)
        setattr(param, attr, grad if existing is None else existing + grad)
        # Autograd accumulates nothing into a sharded parameter (the unshard node returns no
        # gradient for it): the hooks of register_post_accumulate_grad_hook run here, once
        # the reduced gradient is in place, without grad recording, as autograd runs them.
        hooks = getattr(param, "_post_accumulate_grad_hooks", None)
        if hooks:
            with torch.no_grad():
                for hook in list(hooks.values()):
                    hook(param)

    # ------------------------------------------------------------------ autograd and hooks
    def forward_for_later_backward(self, module, fn, inputs, keep_graph):
        return later_backward.forward_for_later_backward(module, fn, inputs, keep_graph)

    def differentiable_call(self, inputs, forward_fn, backward_fn, grads_to_inputs=True):
        return run_differentiable(inputs, forward_fn, backward_fn, grads_to_inputs)

    def register_forward_hooks(self, module, pre_hook, post_hook):
        return [
            module.register_forward_pre_hook(eager(pre_hook), with_kwargs=True, prepend=True),
            module.register_forward_hook(eager(post_hook), with_kwargs=True),
        ]

    def register_grad_hook(self, tensor, fn) -> None:
        if not tensor.requires_grad:
            return
        tensor.register_hook(lambda grad: call_eagerly(fn))
        # An in-place op on a view moves the view's history onto its base, and a hook on the
        # view never fires (FSDP2 warns and then fails in backward on freed parameters).
        # The base's gradient is computed either way. Only a non-leaf base: a hook on a leaf
        # (a user's tensor) would outlive this backward and fire in every later one.
        base = tensor._base
        if base is not None and base.requires_grad and base.grad_fn is not None:
            base.register_hook(lambda grad: call_eagerly(fn))

    def queue_backward_final_callback(self, fn) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: call_eagerly(fn))
