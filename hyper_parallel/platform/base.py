"""The Platform interface: every primitive the backend-agnostic core may call.

[Note: the required contract]
The core (``hyper_parallel/fully_shard``) is written once and never imports a framework.
What it needs from PyTorch or MindSpore is the abstract methods below, in four groups:
process groups, collectives, tensors, autograd and modules. A platform holds no FSDP
logic: it answers "gather this buffer", "make this differentiable", "write this tensor
into that one", never "what should a unit do now". What a framework may lack lives in
optional parts with their own files: ``StorageRelease`` (freeing memory autograd holds),
``StateIO`` (optimizer state and checkpoint files); ``capabilities`` says what a platform
can do. docs/adding-a-platform.md walks through the contract.

[Note: defaults]
Where PyTorch and MindSpore spell a primitive alike, it is implemented once here or in
``TensorPrimitives`` (tensors.py, the tensor half of the contract), as a default a platform
overrides where its framework spells it differently or does it faster; never a stub.

[Note: no aliasing, no in-place arithmetic]
MindSpore on CPU silently ignores in-place arithmetic and its views do not write through
(docs/platforms.md). The core therefore only uses operations that return new tensors
(``cat``, ``reshape``, ``narrow``, ``cast``, ``scale``, ``add``) plus explicit writes:
``copy_into``, ``StorageRelease`` and the collectives' output buffers (collectives.py).
Reading a narrowed or reshaped tensor is always allowed; writing through one never is.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from hyper_parallel.platform.comm_stats import CommStats
from hyper_parallel.platform.capabilities import Capabilities
from hyper_parallel.platform.collectives import Collectives
from hyper_parallel.platform.tensors import TensorPrimitives

@dataclass(frozen=True)
class MeshDescription:
    """A framework's own mesh object as the core needs it (``mesh_from_native``)."""

    shape: tuple            # ranks along each dim
    dim_names: tuple        # one name per dim
    groups: list            # this rank's process group along each dim
    device_type: str
    rank_grid: list         # the global ranks, nested one list level per dim


@dataclass(frozen=True)
class PlacementDescription:
    """A framework's own shard placement result as the core needs it
    (``shard_placement_from_native``): the dims are names or positions in ``mesh``."""

    placement: Any          # an object with ``.dim``, or None (dim 0)
    mesh: Any               # the framework's own mesh
    shard_dims: tuple       # the dims that shard (joined into one group if several)
    replicate_dims: tuple   # the dims that replicate, () for none


class Platform(Collectives, TensorPrimitives):
    """One framework on one kind of device. Obtain it with ``get_platform()``."""

    #: "torch" or "mindspore"
    name: str = ""
    #: ``{name: framework dtype}`` for "float32", "float16", "bfloat16", "float64", "int64"...
    dtype_names: dict

    def __init__(self) -> None:
        self.comm_stats = CommStats()
        self.collective_check = None  # a CollectiveCheck under HP_DEBUG=collectives

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this platform can do (capabilities.py); the same record every time."""

    # ------------------------------------------------------------------ process groups
    @abc.abstractmethod
    def is_initialized(self) -> bool:
        """Whether this process already joined the framework's default process group."""

    @abc.abstractmethod
    def init_process_group(self, rank: int, world_size: int, master_addr: str,
                           master_port: int, timeout_s: float) -> None:
        """Join the default group (gloo/NCCL on torch, mccl/HCCL on MindSpore)."""

    @abc.abstractmethod
    def destroy_process_group(self) -> None:
        """Leave the default group (after a final barrier by the caller)."""

    @abc.abstractmethod
    def group_rank(self, group: Any) -> int:
        """This process's rank inside ``group`` (None: the default group)."""

    @abc.abstractmethod
    def group_size(self, group: Any) -> int:
        """Number of ranks in ``group`` (None: the default group)."""

    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int], distinct: bool = False) -> Any:
        """A process group over the global ``ranks`` (ascending). Every rank calls this for
        every group, in the same order, also the ranks outside ``ranks``. Over every rank
        it may be the default group, unless ``distinct``: a communicator of its own."""

    def rank(self) -> int:
        """Global rank, 0 when not initialized."""
        return self.group_rank(None) if self.is_initialized() else 0

    def world_size(self) -> int:
        """Global world size, 1 when not initialized."""
        return self.group_size(None) if self.is_initialized() else 1

    def device_type(self) -> str:
        """The device this process computes on: "cpu", "cuda" or "npu"."""
        return self.capabilities.device_type

    def join_from_launcher_env(self) -> bool:
        """Join the default group the framework's own way when its own launcher started this
        process without torchrun-style variables (msrun); return whether it did. The
        default: there is no such launcher."""
        return False

    def new_mesh_groups(self, device_type: str, mesh_shape: tuple, dim_names: tuple) -> tuple:
        """The process groups of a mesh: ``(groups_per_dim, native_mesh)``, where
        ``groups_per_dim[i]`` is this rank's group along dim ``i``. Every rank calls this in
        the same order. The default makes every line of the rank grid a ``new_group`` and
        has no native mesh; a framework with its own mesh type (torch) overrides it."""
        grid = np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape)
        me, groups = self.rank(), []
        for dim in range(len(mesh_shape)):
            mine = None
            for line in np.moveaxis(grid, dim, -1).reshape(-1, mesh_shape[dim]):
                ranks = [int(r) for r in line]
                group = self.new_group(ranks)
                if me in ranks:
                    mine = group
            groups.append(mine)
        return groups, None

    def mesh_from_native(self, native_mesh: Any) -> MeshDescription | None:
        """A framework mesh object described; None if ``native_mesh`` is not one."""
        return None

    def option_from_native(self, option: Any) -> tuple[str, dict] | None:
        """A framework's own object for one of ``fully_shard``'s options (torch's
        ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy``,
        ``DataParallelMeshDims``) as ``(class name, {field: value})``, which the core
        rebuilds as its class of that name (``policy.as_policy``, ``mesh.as_dp_mesh_dims``);
        None if ``option`` is not one. Recognised by class, not by field names, so an
        object that merely has a ``param_dtype`` is not taken for a policy. The default: the
        framework has no such objects of its own."""
        return None

    def shard_placement_from_native(self, result: Any) -> PlacementDescription | None:
        """A framework's own ``shard_placement_fn`` result (torch FSDP2's
        ``ShardPlacementResult``) described; None if ``result`` is not one."""
        return None

    def mesh_from_groups(self, device_type: str, groups: Sequence[Any], rank_grid: list,
                         dim_names: Sequence[str]) -> Any:
        """The framework's own mesh whose dim ``i`` is ``groups[i]`` and whose ranks are
        ``rank_grid``, for ``make_sharded_param``; None where the framework needs none."""
        return None

    # ------------------------------------------------------------------ autograd and hooks
    @abc.abstractmethod
    def no_grad(self):
        """A context manager in which operations are not recorded for autograd."""

    @abc.abstractmethod
    def is_grad_enabled(self) -> bool:
        """Whether operations run now are recorded for a later backward."""

    @abc.abstractmethod
    def in_backward(self) -> bool:
        """Whether autograd is running a backward pass now. A module's forward called then is
        a recomputation (activation checkpointing), not a new iteration's forward."""

    @abc.abstractmethod
    def differentiable_call(self, inputs: Sequence[Any], forward_fn: Callable,
                            backward_fn: Callable, grads_to_inputs: bool = True) -> list:
        """Run ``forward_fn(inputs) -> outputs`` (a list of tensors) so that autograd calls
        ``backward_fn(output_grads) -> input_grads`` exactly once per backward, after the
        gradients of *all* outputs (every use) have been summed. What the node saves for
        backward bypasses the user's saved-tensor hooks (activation checkpointing matches
        saved tensors by position, and a recomputation that finds the parameters there
        makes no node). ``grads_to_inputs=False``: the node still runs when an input
        requires a gradient, but what ``backward_fn`` returns is dropped and the inputs
        receive nothing from it (the caller delivers gradients itself)."""

    @abc.abstractmethod
    def forward_for_later_backward(self, module: Any, fn: Callable, inputs: Sequence[Any],
                                   keep_graph: bool) -> tuple:
        """Run ``fn(*inputs)`` now, ``module``'s trainable parameters differentiated, and
        return ``(output, backward)``: ``backward(grad_output)``, called once later, runs
        that forward's backward and returns ``(input_grads, param_grads)``: a gradient per
        input, and ``param_grads`` a gradient per trainable parameter where
        ``capabilities.returns_grads_from_backward`` (else None: they accumulate on the
        parameters). ``keep_graph=False`` (only where
        ``capabilities.backward_of_latest_forward_only``): keep nothing but the inputs and
        recompute the forward at ``backward`` (a pipeline's backward of an older forward)."""

    @abc.abstractmethod
    def register_forward_hooks(self, module: Any, pre_hook: Callable, post_hook: Callable) -> list:
        """Install ``pre_hook(module, args, kwargs) -> None | (args, kwargs)`` and
        ``post_hook(module, args, kwargs, output) -> None | output``; return removable handles.
        The hooks run eagerly even when the module is compiled (torch.compile skips them;
        a MindSpore construct compiled by jit is refused at its first call)."""

    @abc.abstractmethod
    def register_grad_hook(self, tensor: Any, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the gradient of ``tensor`` is computed in backward, also when
        ``tensor`` is a view that the caller later changes in place. ``fn`` may then run
        more than once in one backward and must be idempotent."""

    @abc.abstractmethod
    def queue_backward_final_callback(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once after the current backward pass; only valid during backward."""

    def discard_aborted_autograd(self) -> None:
        """An exception ended a step midway (``reset_iter_state``): drop what the framework's
        autograd still holds of the aborted recording, so that the next step starts clean.
        The default does nothing (torch's graph goes with the tensors that referenced it)."""

    # ------------------------------------------------------------------ modules and parameters
    @abc.abstractmethod
    def named_modules(self, module: Any) -> list:
        """``[(qualified_name, submodule), ...]`` including ``module`` itself as ""."""

    @abc.abstractmethod
    def direct_params(self, module: Any) -> list:
        """``[(attr_name, parameter), ...]`` registered directly on ``module``."""

    def forward_function(self, module: Any) -> Callable:
        """The method a call of ``module`` runs (torch: ``forward``), whose signature tells
        how the module is called."""
        return module.forward

    @abc.abstractmethod
    def children_of(self, module: Any) -> tuple:
        """``(the dict that registers module's children by name, whether module is a
        list or dict container whose entries are its children)``: pipelining/split.py
        edits a copy's dict to cut a stage from a whole model."""

    def children_changed(self, module: Any) -> None:
        """``module``'s children were replaced in ``children_of``'s dict: refresh what the
        framework keeps beside it. The default: nothing."""

    @abc.abstractmethod
    def register_param(self, module: Any, attr_name: str, param: Any) -> None:
        """Replace (or add) the parameter registered on ``module`` as ``attr_name``."""

    @abc.abstractmethod
    def make_sharded_param(self, orig_param: Any, local_shard: Any, native_mesh: Any,
                           shard_mesh_dim: int, shard_dim: int | None, full_shape: tuple,
                           backing: Any = None) -> Any:
        """A new parameter holding a copy of ``local_shard`` (its own memory: a view would keep
        the whole unsharded parameter alive) that replaces ``orig_param`` (same name, same
        ``requires_grad``). On torch it is a DTensor over ``native_mesh`` sharded on
        ``shard_dim`` along mesh dim ``shard_mesh_dim`` and replicated on the others
        (replicated everywhere when ``shard_dim`` is None).

        ``backing``: new memory of the caller's that ``local_shard`` is a leading view of
        (the shard with padding rows after it). Where views write through, the parameter
        keeps that view instead of a copy, so ``backing`` stays the padded shard as the
        optimizer updates it (``starts_with`` tells whether it still is).

        ``orig_param`` split by tensor parallelism (``param_local_values``): the parameter
        spans the data-parallel and the tensor-parallel mesh dims (torch: as FSDP2's,
        ``_StridedShard`` where both shard the same dim), and ``attach_tensor`` presents
        full tensors for it as tensor-parallel parameters."""

    @abc.abstractmethod
    def local_tensor(self, param: Any) -> Any:
        """The differentiable local shard of a parameter made by ``make_sharded_param``."""

    @abc.abstractmethod
    def write_grad(self, param: Any, placeholder: Any, local_grad: Any, to_main_grad: bool) -> None:
        """Deliver a reduced gradient shard as soon as its reduction completes: accumulate it
        into ``param.grad`` (torch) or fill ``placeholder``, the zeros backward returned for
        ``param`` (``capabilities.returns_grads_from_backward``); with ``to_main_grad``
        accumulate it in float32 into ``param.main_grad`` instead. Then run what the
        framework runs once a leaf's gradient is accumulated (torch: the parameter's
        post-accumulate-grad hooks)."""

    def unit_bases(self) -> tuple:
        """Classes a unit's class derives from after the module's own, so that the
        framework's code written for its own fully sharded units recognises it (torch:
        FSDP2's ``FSDPModule``, interop/torch/fsdp2_units.py). The default: none."""
        return ()

    def present_unit(self, module: Any, reduce_accumulated: Callable[[], None]) -> None:
        """Called once for each module of a new unit: let the framework's code that drives
        its own units find what it asks for; ``reduce_accumulated()`` reduces the gradients
        accumulated with gradient sync off, waits for them and reshards (torch's pipeline
        stages call it after the last microbatch). The default: nothing to present."""

    def native_unit_api(self, module: Any) -> str | None:
        """The framework's own API that made ``module`` a fully sharded unit of its own
        (torch: "torch's fully_shard (FSDP2)"), which ``fully_shard`` refuses; None where
        none did (a hyper_parallel unit included). The default: none."""
        return None

    def updated_in_forward(self, module: Any) -> list:
        """Parameters that ``module``'s own forward overwrites in place (MindSpore
        BatchNorm's moving statistics). ``fully_shard`` leaves them whole on every rank, as
        FSDP2 leaves torch's buffers, so the update reaches them."""
        return []

    def registered_param(self, module: Any, attr_name: str) -> Any:
        """The parameter registered on ``module`` as ``attr_name`` now (None if none)."""
        return dict(self.direct_params(module)).get(attr_name)

    def param_requires_grad(self, param: Any) -> bool:
        """Whether the optimizer trains ``param``."""
        return param.requires_grad

    def param_grad(self, param: Any) -> Any:
        """The gradient accumulated on ``param``, None if it has none; only asked where
        gradients accumulate on the parameters (not ``returns_grads_from_backward``)."""
        return getattr(param, "grad", None)

    def starts_with(self, whole: Any, part: Any) -> bool:
        """Whether ``part``'s elements are the leading elements of ``whole``'s memory, so
        writes to ``part`` are seen in ``whole``. The default: views do not write through."""
        return False

    def attach_tensor(self, module: Any, attr_name: str, tensor: Any) -> None:
        """Make ``module.<attr_name>`` read ``tensor``, the full parameter, after
        ``register_param`` registered the sharded one there (``capabilities.
        registers_full_tensors`` says whether the module's parameters then yield it too).
        The default: an instance attribute shadows the registered parameter in both
        frameworks' attribute lookup, so the module computes with the full tensor while
        ``parameters()`` keeps seeing the sharded one. A tensor-parallel parameter's
        ``tensor`` is this rank's tensor-parallel part (torch presents it as a DTensor)."""
        object.__setattr__(module, attr_name, tensor)

    def detach_tensor(self, module: Any, attr_name: str) -> None:
        """Undo ``attach_tensor`` (detaching twice is harmless)."""
        module.__dict__.pop(attr_name, None)

    # ------------------------------------------------------------------ deferred values
    def is_deferred(self, tensor: Any) -> bool:
        """Whether ``tensor`` has a shape but no values yet (torch's meta device, a MindSpore
        Parameter built under ``no_init_parameters()``). The default: never."""
        return False

    def deferred_part(self, param: Any, dim: int, start: int, length: int) -> Any:
        """Elements ``[start, start + length)`` of ``dim`` of a deferred ``param`` without
        making the whole tensor; only asked where ``is_deferred`` said so."""
        raise TypeError(f"{type(self).__name__} has no deferred tensors")

    def is_shard_like(self, new: Any, sharded: Any) -> bool:
        """Whether ``new``, registered in place of the sharded parameter ``sharded``, is laid
        out as it is. The default compares the local shapes."""
        return self.shape(self.local_tensor(new)) == self.shape(self.local_tensor(sharded))

    def replace_local(self, param: Any, local: Any) -> bool:
        """Make ``param`` hold ``local`` as its local shard, keeping the object (an optimizer
        may hold it); False where the framework cannot (the default)."""
        return False

    def gather_codec_of(self, local: Any) -> Any:
        """The ``GatherCodec`` (fully_shard/gather_codec.py) a framework's own tensor type
        asks for, read from a sharded parameter's local tensor (torch: a subclass with
        FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``); None for a plain one."""
        return None

    # ------------------------------------------------------------------ tensor parallelism
    def param_local_values(self, param: Any) -> Any:
        """The values fully_shard shards for ``param``: the parameter itself, or, where
        tensor parallelism already split it (torch: a DTensor), this rank's part of it."""
        return param

    def full_over_tensor_parallel(self, sharded_param: Any, local_full: Any) -> Any:
        """``local_full`` (this rank's tensor-parallel part) gathered into the whole tensor."""
        return local_full

    def tensor_parallel_block(self, sharded_param: Any) -> tuple | None:
        """Where this rank's tensor-parallel part of ``sharded_param`` (made by
        ``make_sharded_param`` from a parameter tensor parallelism split) lies in the whole
        tensor: ``(whole shape, offset in every dim)``; None where the part is not one block
        of it (a placement that interleaves). Only asked of such parameters."""
        raise TypeError(f"{type(self).__name__} has no tensor-parallel parameters")

    def refresh_converted_param(self, param: Any) -> None:
        """``param``'s values were converted in place by the framework's module conversion
        (``.to(dtype)``): make the same object a parameter of its new dtype in every
        respect. The default does nothing."""
