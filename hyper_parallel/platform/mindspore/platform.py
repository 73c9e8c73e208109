"""MindSporePlatform: MindSpore 2.10 in PyNative mode, mccl on CPU, HCCL on Ascend.

[Note: what MindSpore CPU lacks, and how each primitive copes]
- The collectives, where CPU lacks a kernel, are composed from what there is
  (collective_ops.py).
- In-place arithmetic does not write through: the only writes used are ``copy_into`` (a
  whole-storage ``copy_``) and the collectives' own output buffers.
- Memory autograd holds is released and restored through the tensors' storages
  (storage_release.py).
- No ``autograd.Function``: ``differentiable_call`` is a Cell with a custom ``bprop``
  (unshard_cell.py).
"""

from __future__ import annotations

import datetime
import functools
import os
import time

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, mint, ops
from mindspore.common.tensor import swap_tensors
from mindspore.communication import GlobalComm
from mindspore.common.initializer import initializer
from mindspore.mint import distributed as msdist
from mindspore.nn.layer.normalization import _BatchNorm

from hyper_parallel.platform.mindspore import later_backward
from hyper_parallel.platform.base import Platform
from hyper_parallel.platform.capabilities import Capabilities
from hyper_parallel.platform.mindspore.collective_ops import MindSporeCollectiveOps
from hyper_parallel.platform.mindspore.cp_support import MindSporeContextParallelSupport
from hyper_parallel.platform.mindspore.state_io import MindSporeStateIO
from hyper_parallel.platform.mindspore.storage_release import MindSporeStorageRelease
from hyper_parallel.platform.mindspore.tp_support import MindSporeTensorParallelSupport
from hyper_parallel.platform.mindspore import native_log
from hyper_parallel.platform.mindspore.jit_guard import refuse_jitted_construct
from hyper_parallel.platform.mindspore.unshard_cell import run_differentiable

SUPPORTED_MINOR = "2.10"

_DTYPES = {
    "float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16,
    "float64": ms.float64, "int32": ms.int32, "int64": ms.int64,
    "int8": ms.int8, "uint8": ms.uint8,
}


def _check_version() -> None:
    if not ms.__version__.startswith(SUPPORTED_MINOR):
        raise ImportError(
            f"hyper_parallel supports mindspore {SUPPORTED_MINOR}.x, found {ms.__version__}; "
            f"install it with: pip install 'mindspore=={SUPPORTED_MINOR}.*' 'numpy<2'")


class MindSporePlatform(MindSporeCollectiveOps, MindSporeStateIO, MindSporeStorageRelease,
                        MindSporeTensorParallelSupport, MindSporeContextParallelSupport,
                        Platform):
    name = "mindspore"

    def __init__(self) -> None:
        _check_version()
        super().__init__()
        self._store = None
        self._world_gather = None  # ops.AllGather on the world group, made on first use
        self._left = False  # MindSpore's destroy_process_group leaves GlobalComm.INITED True

    @functools.cached_property
    def capabilities(self) -> Capabilities:
        # A kernel copies a view it reads (storage_release.py has the reproducer's
        # facts); its optimizers cannot make state for an empty parameter; value_and_grad
        # returns what the bprops returned. On CPU async_op changes nothing: sync and
        # async collectives are queued alike on the kernel pipeline, so a reduction
        # pipeline would only add the placeholder copies. On Ascend HCCL runs on its own
        # stream.
        return Capabilities(device_type="cpu" if self._on_cpu else "npu",
                            can_release_storage=True, kernels_read_views=False,
                            pads_local_shards=True, returns_grads_from_backward=True,
                            collectives_overlap_compute=not self._on_cpu,
                            release_after_reduction=self._on_cpu,
                            backward_of_latest_forward_only=True)

    @property
    def _on_cpu(self) -> bool:
        # Read when needed, never at construction: touching the context before an msrun
        # worker's communication.init() breaks that init.
        return ms.get_context("device_target") == "CPU"

    # ------------------------------------------------------------------ process groups
    def is_initialized(self) -> bool:
        return bool(GlobalComm.INITED) and not self._left

    def _ensure_pynative(self) -> None:
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            ms.set_context(mode=ms.PYNATIVE_MODE)

    def init_process_group(self, rank, world_size, master_addr, master_port, timeout_s):
        from mindspore.communication.management import _init_with_store

        self._refuse_rejoin()
        native_log.quiet()
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = msdist.TCPStore(master_addr, master_port, world_size=world_size,
                                      is_master=rank == 0, timeout=timeout)
        backend = "mccl" if self._on_cpu else "hccl"
        _init_with_store(backend=backend, timeout=timeout, world_size=world_size, rank=rank,
                         store=self._store)

    def join_from_launcher_env(self) -> bool:
        # msrun runs the script as its scheduler (MS_ROLE=MS_SCHED, where init() serves the
        # job and returns when it ends) and as each worker (MS_ROLE=MS_WORKER).
        if os.environ.get("MS_ROLE") not in ("MS_SCHED", "MS_WORKER"):
            return False
        from mindspore.communication import init

        self._refuse_rejoin()
        native_log.quiet()
        init()
        return True

    def _refuse_rejoin(self) -> None:
        if self._left:
            raise RuntimeError("MindSpore 2.10 cannot join a process group again in a process that "
                               "left one (its collectives fail: docs/platforms.md); leave once, at "
                               "the end, or start a new process")

    def destroy_process_group(self) -> None:
        # Collectives on CPU complete lazily: a rank that tears down while a peer's last
        # collective is still in flight makes that peer fail. Finish this rank's work, then
        # meet every rank on the store before anyone leaves.
        self._finish_collectives()
        if self._store is not None:
            self._store_rendezvous("hp_exit")
        msdist.destroy_process_group()
        self._left = True

    def _finish_collectives(self, group=None) -> None:
        token = Tensor(np.ones(1, np.float32))
        msdist.all_reduce(token, group=group)
        token.asnumpy()

    def _store_rendezvous(self, key: str, timeout_s: float = 120.0) -> None:
        world, deadline = self.world_size(), time.monotonic() + timeout_s
        self._store.add(key, 1)
        while self._store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(0.005)
        self._store.add(key + "_seen", 1)
        if self.rank() == 0:  # the store lives here: stay until every rank stopped asking it
            while self._store.add(key + "_seen", 0) < world and time.monotonic() < deadline:
                time.sleep(0.005)

    def new_group(self, ranks, distinct=False):
        if len(ranks) == self.world_size() and not distinct:
            return GlobalComm.WORLD_COMM_GROUP
        return msdist.new_group(list(ranks), backend="mccl" if self._on_cpu else "hccl")

    def group_rank(self, group) -> int:
        return msdist.get_rank(GlobalComm.WORLD_COMM_GROUP if group is None else group)

    def group_size(self, group) -> int:
        return msdist.get_world_size(GlobalComm.WORLD_COMM_GROUP if group is None else group)

    # ------------------------------------------------------------------ tensors
    dtype_names = _DTYPES

    def is_tensor(self, obj) -> bool:
        return isinstance(obj, Tensor)

    def zeros(self, shape, dtype):
        return mint.zeros(tuple(shape), dtype=dtype)

    def empty(self, shape, dtype):
        return mint.empty(tuple(shape), dtype=dtype)

    def from_numpy(self, array):
        return Tensor(np.array(array, order="C"))  # a copy; ascontiguousarray makes 0-d 1-d

    def to_numpy(self, tensor):
        return tensor.asnumpy().copy()

    def cast(self, tensor, dtype):
        return tensor if tensor.dtype == dtype else tensor.astype(dtype)

    def movedim(self, tensor, source, destination):
        return tensor if source == destination else ops.moveaxis(tensor, source, destination)

    def narrow(self, tensor, dim, start, length):
        # mint.narrow accepts an empty slice at the end, and skips ops.narrow's Python-side
        # validation, which reads the tensor's ndim: a wait for the whole async pipeline
        return mint.narrow(tensor, dim, start, length)

    def cat(self, tensors, dim=0):
        tensors = list(tensors)
        return ops.cat(tensors, dim) if len(tensors) > 1 else tensors[0] + 0

    def alias(self, tensor):
        return tensor  # a Cell may output an existing tensor as its own output

    def no_grad(self):
        from mindspore.graph.api import _no_grad

        return _no_grad()

    def is_grad_enabled(self) -> bool:
        from mindspore.graph.api import _pynative_executor

        # requires_grad: a value_and_grad is recording this forward (outside one, no
        # backward can follow it, as under torch's no_grad)
        return bool(_pynative_executor.enable_grad() and _pynative_executor.requires_grad())

    def in_backward(self) -> bool:
        from mindspore.graph.api import _pynative_executor

        return _pynative_executor.get_current_autodiff_engine_id() != -1  # -1: no backward

    # ------------------------------------------------------------------ parameters
    def named_modules(self, module):
        return [(name, cell) for name, cell in module.cells_and_names()]

    def direct_params(self, module):
        return [(n, p) for n, p in module._params.items() if p is not None]

    def forward_function(self, module):
        return module.construct

    def children_of(self, module):
        return module._cells, isinstance(module, (ms.nn.CellList, ms.nn.CellDict,
                                                  ms.nn.SequentialCell))

    def children_changed(self, module):
        if isinstance(module, ms.nn.SequentialCell):  # its construct runs this list
            module.cell_list = list(module._cells.values())

    def register_param(self, module, attr_name, param) -> None:
        module._params[attr_name] = param

    def updated_in_forward(self, module):
        if isinstance(module, _BatchNorm):  # training writes the batch statistics into them
            return [module.moving_mean, module.moving_variance]
        return []

    def make_sharded_param(self, orig_param, local_shard, native_mesh, shard_mesh_dim,
                           shard_dim, full_shape, backing=None):
        # set_data cannot shrink a Parameter: autograd keeps its original shape.
        return Parameter(local_shard + 0, name=orig_param.name,
                         requires_grad=orig_param.requires_grad)

    def refresh_converted_param(self, param) -> None:
        # Cell.to assigns param.data, but a custom-bprop Cell returns a Parameter's
        # gradient in the dtype the object was created with: swap in a fresh one (the
        # object keeps its identity, so optimizers still hold it), with our attributes.
        fresh = Parameter(param + 0, name=param.name, requires_grad=param.requires_grad)
        for key, value in param.__dict__.items():
            fresh.__dict__.setdefault(key, value)
        swap_tensors(param, fresh)

    def local_tensor(self, param):
        return param

    def is_deferred(self, tensor) -> bool:
        return bool(getattr(tensor, "has_init", False))

    def deferred_part(self, param, dim, start, length):
        shape = list(param.shape)
        shape[dim] = length
        init = getattr(getattr(param, "init_mode", None), "init", None)
        if init is None:
            raise ValueError(f"parameter {param.name!r} is uninitialised and has no initializer "
                             f"to make its shard from; build it with an initializer "
                             f"(mindspore.common.initializer) under no_init_parameters()")
        if length == 0:
            return mint.zeros(tuple(shape), dtype=param.dtype)
        # the initializer at the shard's shape, as MindSpore's own sliced init does
        return initializer(init, tuple(shape), param.dtype).init_data()

    def param_requires_grad(self, param) -> bool:
        # The Parameter.requires_grad getter waits for the whole async pipeline first; its
        # setter waits too, so _param_info is always current.
        info = getattr(param, "_param_info", None)
        return param.requires_grad if info is None else info.requires_grad

    def write_grad(self, param, placeholder, local_grad, to_main_grad) -> None:
        if to_main_grad:
            local_grad = local_grad.astype(ms.float32)
            existing = getattr(param, "main_grad", None)
            param.main_grad = local_grad if existing is None else existing + local_grad
        else:
            self.copy_into(placeholder, local_grad)  # value_and_grad returned this very tensor
        # No hook to run: MindSpore has no post-accumulate-grad hook, and a Parameter's
        # register_hook already saw what the unshard node's backward returned for it.

    # ------------------------------------------------------------------ autograd and hooks
    def forward_for_later_backward(self, module, fn, inputs, keep_graph):
        return later_backward.forward_for_later_backward(module, fn, inputs, keep_graph)

    def differentiable_call(self, inputs, forward_fn, backward_fn, grads_to_inputs=True):
        return run_differentiable(inputs, forward_fn, backward_fn, grads_to_inputs)

    def register_forward_hooks(self, module, pre_hook, post_hook):
        self._ensure_pynative()  # hooks and custom bprop Cells need PyNative

        def refusing_jit_pre_hook(cell, args, kwargs):
            refuse_jitted_construct(cell)
            return pre_hook(cell, args, kwargs)

        return [
            module.register_forward_pre_hook(refusing_jit_pre_hook, with_kwargs=True,
                                             prepend=True),
            module.register_forward_hook(post_hook, with_kwargs=True),
        ]

    def register_grad_hook(self, tensor, fn) -> None:
        tensor.register_hook(lambda grad: fn())

    def queue_backward_final_callback(self, fn) -> None:
        from mindspore.graph.api import _pynative_executor

        _pynative_executor.queue_backward_final_callback(fn)

    def discard_aborted_autograd(self) -> None:
        from mindspore.graph.api import _pynative_executor

        # value_and_grad opens a graph before calling the function and closes it after it
        # returns: an exception in between leaves the graph open, and under launch_blocking
        # the next LayerNorm backward then fails ("LayerNormGrad, the index 7 is out of
        # range"). MindSpore's own jit and recompute paths clear the executor on an exception.
        _pynative_executor.clear_res()
