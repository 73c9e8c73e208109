"""The Platform interface: every primitive the backend-agnostic core may call.

[Note: why an explicit interface]
The core (``hyper_parallel/fully_shard``) is written once and never imports a framework.
Everything it needs from PyTorch or MindSpore is one of the methods below. A platform holds
no FSDP logic: it answers "gather this flat buffer", "make this differentiable", "write this
tensor into that one", never "what should a unit do now".

[Note: no aliasing, no in-place arithmetic]
MindSpore on CPU silently ignores in-place arithmetic and its views do not write through
(docs/platforms.md). The core therefore only uses functional tensor operations that return
new tensors (``cat``, ``reshape``, ``narrow``, ``cast``, ``scale``, ``add``) plus three
explicit writes: ``copy_into`` / ``copy_into_slice`` (a tensor into another, or into a slice
of another), ``release_storage``/``restore_storage`` (free and re-allocate a tensor's
memory while autograd keeps a reference; the optional ``StorageRelease`` part,
storage_release.py) and the collectives' output buffers. Reading a narrowed or reshaped
tensor is always allowed; writing through one never is.

[Note: composed collectives]
Where a device lacks a collective, the platform composes it from what exists and records
what went on the wire (``CommStats``). The core never knows.

Shared plain-Python plumbing that is the same for every framework (attaching a computed
tensor as a module attribute) is implemented here once.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hyper_parallel import watchdog
from hyper_parallel.comm_stats import CommStats
from hyper_parallel.platform.capabilities import Capabilities


class Handle:
    """A collective in flight. ``wait()`` blocks until its output buffer is valid."""

    def __init__(self, native: Any = None, on_done: Callable[[], None] | None = None):
        self._native = native
        self._on_done = on_done
        self._done = False
        # the output of collectives that allocate it (reduce_scatter_new) or restore it
        # (all_gather_into_released)
        self.result: Any = None

    def wait(self) -> None:
        if self._done:
            return
        if self._native is not None:
            self._native.wait()
        self._done = True
        if self._on_done is not None:
            on_done, self._on_done, self._native = self._on_done, None, None
            on_done()  # dropped first: a closure that refers to this handle is then no cycle


@dataclass(frozen=True)
class MeshDescription:
    """A framework's own mesh object as the core needs it (``mesh_from_native``)."""

    shape: tuple            # ranks along each dim
    dim_names: tuple        # one name per dim
    groups: list            # this rank's process group along each dim
    device_type: str
    rank_grid: list         # the global ranks, nested one list level per dim


class Platform(abc.ABC):
    """One framework on one kind of device. Obtain it with ``get_platform()``."""

    #: "torch" or "mindspore"
    name: str = ""

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
    def join_from_launcher_env(self) -> bool:
        """Join the default group the framework's own way when its own launcher started this
        process (msrun) without the torchrun-style variables; return whether it did."""

    @abc.abstractmethod
    def destroy_process_group(self) -> None:
        """Leave the default group (after a final barrier by the caller)."""

    @abc.abstractmethod
    def rank(self) -> int:
        """Global rank, 0 when not initialized."""

    @abc.abstractmethod
    def world_size(self) -> int:
        """Global world size, 1 when not initialized."""

    @abc.abstractmethod
    def device_type(self) -> str:
        """The device this process computes on: "cpu", "cuda" or "npu"."""

    @abc.abstractmethod
    def new_mesh_groups(self, device_type: str, mesh_shape: tuple, dim_names: tuple) -> tuple:
        """Create the process groups of a mesh; return ``(groups_per_dim, native_mesh)``.

        ``groups_per_dim[i]`` is this rank's group along dim ``i`` (every rank calls this,
        in the same order). ``native_mesh`` is the framework's own mesh object, or None.
        """

    @abc.abstractmethod
    def mesh_from_native(self, native_mesh: Any) -> MeshDescription | None:
        """A framework mesh object described; None if ``native_mesh`` is not one."""

    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Any:
        """A process group over the global ``ranks`` (ascending): a mesh role that joins
        several dims needs one. Every rank calls this for every group, in the same order,
        also the ranks outside ``ranks``."""

    def mesh_from_groups(self, device_type: str, groups: Sequence[Any], rank_grid: list,
                         dim_names: Sequence[str]) -> Any:
        """The framework's own mesh whose dim ``i`` is ``groups[i]`` and whose ranks are
        ``rank_grid`` (nested lists, one level per dim), for ``make_sharded_param``; None
        where the framework needs none (the default)."""
        return None

    @abc.abstractmethod
    def group_rank(self, group: Any) -> int:
        """This process's rank inside ``group``."""

    @abc.abstractmethod
    def group_size(self, group: Any) -> int:
        """Number of ranks in ``group``."""

    # ------------------------------------------------------------------ collectives
    @abc.abstractmethod
    def all_gather_into(self, output: Any, input: Any, group: Any, async_op: bool = False,
                        dim: str = "") -> Handle:
        """Gather every rank's 1-D ``input`` into the 1-D ``output`` (rank-major)."""

    @abc.abstractmethod
    def reduce_scatter(self, output: Any, input: Any, group: Any, async_op: bool = False,
                       dim: str = "") -> Handle:
        """SUM-reduce the 1-D ``input`` over ``group``; ``output`` gets this rank's chunk."""

    def all_gather_pieces(self, input: Any, group: Any, group_size: int, async_op: bool = False,
                          dim: str = "") -> tuple:
        """All-gather the 1-D ``input`` into new memory; return ``(pieces, whole, handle)``:
        once ``handle.wait()`` returned, ``pieces[r]`` (1-D, read-only) holds rank r's input
        and ``whole`` is the flat rank-major buffer that the pieces are slices of, or None
        where the platform's gather delivers separate tensors (which saves a copy into one
        buffer; MindSpore CPU). The default gathers into one new buffer."""
        numel = self.shape(input)[0]
        whole = self.empty((group_size * numel,), self.dtype_of(input))
        handle = self.all_gather_into(whole, input, group, async_op=async_op, dim=dim)
        return [self.narrow(whole, 0, r * numel, numel) for r in range(group_size)], whole, handle

    def reduce_scatter_new(self, input: Any, group: Any, group_size: int, async_op: bool = False,
                           dim: str = "", may_overwrite_input: bool = False) -> Handle:
        """``reduce_scatter`` into new memory: this rank's chunk is ``handle.result`` (memory
        of the caller's own, which it may scale in place) once ``handle.wait()`` returned.
        ``may_overwrite_input``: the caller never reads ``input`` again, so a platform that
        composes the reduce-scatter may reduce it in place instead of copying it first. The
        default allocates the output and calls ``reduce_scatter``."""
        output = self.empty((self.shape(input)[0] // group_size,), self.dtype_of(input))
        handle = self.reduce_scatter(output, input, group, async_op=async_op, dim=dim)
        handle.result = output
        return handle

    def reduce_scatter_pieces(self, pieces: Sequence[Sequence[Any]], group: Any,
                              async_op: bool = False, dim: str = "") -> Handle:
        """``reduce_scatter_new`` of an input given in parts, never concatenated by the
        caller: ``pieces[r]`` is the list of 1-D tensors whose concatenation rank r
        receives the sum of (equal total lengths). Views of a
        gradient and zeros for its padding go in as they are; the platform concatenates
        only what its collective needs, at most once. The parts are left as they were. The
        default concatenates everything into one flat input (one copy, which a composed
        reduce-scatter then reduces in place)."""
        flat = self.cat([part for parts in pieces for part in parts], 0)
        return self.reduce_scatter_new(flat, group, len(pieces), async_op=async_op, dim=dim,
                                       may_overwrite_input=True)

    @abc.abstractmethod
    def all_reduce(self, tensor: Any, group: Any, op: str = "sum", async_op: bool = False,
                   dim: str = "") -> Handle:
        """Reduce ``tensor`` in place over ``group`` ("sum", "avg", "max", "min")."""

    @abc.abstractmethod
    def barrier(self, group: Any = None) -> None:
        """Block until every rank of ``group`` (default: world) arrives."""

    def _record(self, op: str, wire: str, nbytes: int, dim: str, group: Any = None,
                tensor: Any = None) -> None:
        """Called as a collective over ``group`` is issued; ``tensor``: what this rank sends."""
        if self.collective_check is not None and self.collective_check.intercept(
                op, wire, dim, group, tensor):
            return  # the check's own exchange (collective_check.py): not the user's traffic
        self.comm_stats.record(op, wire, nbytes, dim)
        watch = watchdog.active()
        if watch is not None:
            watch.issued(op, dim)

    # ------------------------------------------------------------------ tensors
    #: ``{name: framework dtype}`` for "float32", "float16", "bfloat16", "float64", "int64"...
    dtype_names: dict  # set by each platform (a class constant, never changed)

    def dtype(self, name: str) -> Any:
        """The framework dtype named ``name`` (a key of ``dtype_names``)."""
        try:
            return self.dtype_names[name]
        except KeyError:
            raise ValueError(f"unknown dtype name {name!r}; valid: {sorted(self.dtype_names)}"
                             ) from None

    @abc.abstractmethod
    def is_tensor(self, obj: Any) -> bool:
        """Whether ``obj`` is a framework tensor (Parameters included)."""

    @abc.abstractmethod
    def shape(self, tensor: Any) -> tuple:
        """Shape as a tuple of ints."""

    @abc.abstractmethod
    def dtype_of(self, tensor: Any) -> Any:
        """The tensor's dtype."""

    @abc.abstractmethod
    def element_size(self, dtype: Any) -> int:
        """Bytes per element of ``dtype``."""

    @abc.abstractmethod
    def zeros(self, shape: Sequence[int], dtype: Any) -> Any:
        """A new zero-filled tensor on the compute device."""

    @abc.abstractmethod
    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """A new tensor whose values are undefined: for a buffer that a collective or a
        copy then overwrites whole (filling it first would be a wasted pass over memory)."""

    @abc.abstractmethod
    def from_numpy(self, array: Any) -> Any:
        """A new tensor on the compute device holding a copy of a numpy array."""

    @abc.abstractmethod
    def to_numpy(self, tensor: Any) -> Any:
        """A numpy copy of a tensor's values (sharded parameters: the local shard)."""

    @abc.abstractmethod
    def cast(self, tensor: Any, dtype: Any) -> Any:
        """``tensor`` in ``dtype`` (the same tensor when it already is)."""

    @abc.abstractmethod
    def reshape(self, tensor: Any, shape: Sequence[int]) -> Any:
        """A reshaped tensor, valid for reading."""

    @abc.abstractmethod
    def movedim(self, tensor: Any, source: int, destination: int) -> Any:
        """``tensor`` with dimension ``source`` moved to ``destination``, valid for reading."""

    @abc.abstractmethod
    def narrow(self, tensor: Any, dim: int, start: int, length: int) -> Any:
        """Elements ``[start, start+length)`` of ``dim``, valid for reading."""

    @abc.abstractmethod
    def cat(self, tensors: Sequence[Any], dim: int = 0) -> Any:
        """A new tensor concatenating ``tensors`` along ``dim``."""

    @abc.abstractmethod
    def contiguous(self, tensor: Any) -> Any:
        """A tensor with its own dense memory (a copy when ``tensor`` is a strided read)."""

    @abc.abstractmethod
    def alias(self, tensor: Any) -> Any:
        """The same memory as ``tensor`` under a new tensor object, so a new autograd node
        can output it (full parameters kept from an earlier iteration)."""

    @abc.abstractmethod
    def clone(self, tensor: Any) -> Any:
        """A new tensor with the same values and its own memory."""

    @abc.abstractmethod
    def scale(self, tensor: Any, factor: float, may_overwrite: bool = False) -> Any:
        """``tensor * factor``. ``may_overwrite``: nobody else reads ``tensor`` (a buffer the
        core owns), so a platform whose in-place arithmetic writes through may scale it in
        place and return it, which saves an allocation the size of the tensor."""

    @abc.abstractmethod
    def vector_norm(self, tensor: Any, norm_type: float) -> Any:
        """A new 0-d float32 tensor: the ``norm_type``-norm (> 0) of all of a non-empty
        ``tensor``'s elements, computed in float32 whatever its dtype; ``inf``: the largest
        absolute value."""

    @abc.abstractmethod
    def add(self, a: Any, b: Any) -> Any:
        """A new tensor ``a + b``."""

    @abc.abstractmethod
    def copy_into(self, dst: Any, src: Any) -> None:
        """Write ``src`` (same shape and dtype) into ``dst`` in place, without disturbing
        autograd's bookkeeping of ``dst``."""

    @abc.abstractmethod
    def copy_into_slice(self, dst: Any, dim: int, start: int, src: Any) -> None:
        """Write ``src`` into ``dst``'s slice ``[start, start + src.shape[dim])`` along
        ``dim`` in place (the rest of ``dst`` unchanged), like ``copy_into``: refilling a
        released full parameter straight from the all-gather output, one rank's rows at a
        time, costs one copy instead of two."""

    def keep_released_memory(self, nbytes: int) -> None:
        """Allow up to ``nbytes`` (the largest asked for wins) of the memory
        ``release_storage`` frees to be kept for the next ``restore_storage`` or ``empty``
        of the same size, where the allocator would otherwise return it to the system and
        fault it in again page by page (CPU torch, see torch/released_memory.py). The core
        asks for what one step gathers again (iteration.py, ``keep_working_set``). The
        default keeps nothing: a caching allocator (CUDA) needs no help, and a platform
        that cannot release storage (MindSpore) has nothing to keep."""

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

    # ------------------------------------------------------------------ parameters
    @abc.abstractmethod
    def named_modules(self, module: Any) -> list:
        """``[(qualified_name, submodule), ...]`` including ``module`` itself as ""."""

    @abc.abstractmethod
    def direct_params(self, module: Any) -> list:
        """``[(attr_name, parameter), ...]`` registered directly on ``module``."""

    @abc.abstractmethod
    def register_param(self, module: Any, attr_name: str, param: Any) -> None:
        """Replace (or add) the parameter registered on ``module`` as ``attr_name``."""

    def param_requires_grad(self, param: Any) -> bool:
        """Whether the optimizer trains ``param`` (both frameworks spell it the same)."""
        return param.requires_grad

    def param_local_values(self, param: Any) -> Any:
        """The values fully_shard shards for ``param``: the parameter itself, or, where
        tensor parallelism already split it across ranks (torch: a DTensor parameter), this
        rank's part of it (no gradient recorded). The unit's full tensors are then that
        part gathered over data parallel; ``make_sharded_param`` and ``attach_tensor`` make
        them the tensor-parallel parameter again. The default (no tensor-parallel
        parameters, MindSpore) is ``param`` itself."""
        return param

    def refresh_converted_param(self, param: Any) -> None:
        """``param``'s values were converted in place by the framework's module conversion
        (``.to(dtype)``): make the same object a parameter of its new dtype in every respect.
        The default does nothing (torch: its conversion already swaps in a new DTensor)."""

    def full_over_tensor_parallel(self, sharded_param: Any, local_full: Any) -> Any:
        """``local_full``, this rank's tensor-parallel part of ``sharded_param``'s values
        (its shards gathered over data parallel), gathered over tensor parallelism into the
        whole tensor (a collective over the tensor-parallel ranks). The default (no
        tensor-parallel parameters) returns ``local_full``."""
        return local_full

    @abc.abstractmethod
    def make_sharded_param(self, orig_param: Any, local_shard: Any, native_mesh: Any,
                           shard_mesh_dim: int, shard_dim: int, full_shape: tuple,
                           backing: Any = None) -> Any:
        """A new parameter holding a copy of ``local_shard`` (its own memory: a view would keep
        the whole unsharded parameter alive) that replaces ``orig_param`` (same name, same
        ``requires_grad``). On torch it is a DTensor over ``native_mesh`` sharded on
        ``shard_dim`` along mesh dim ``shard_mesh_dim`` and replicated on the others
        (replicated everywhere when ``shard_dim`` is None).

        ``backing``: new memory of the caller's that ``local_shard`` is a leading view of
        (the shard with padding rows after it). Where views write through, the parameter
        then keeps that view instead of a copy, so ``backing`` stays the padded shard as the
        optimizer updates it (``starts_with`` tells whether it still is); elsewhere it is
        ignored.

        ``orig_param`` split by tensor parallelism (``param_local_values`` is its local
        part, which ``local_shard`` and ``full_shape`` describe): the parameter spans the
        data-parallel and the tensor-parallel mesh dims, with the tensor-parallel
        placements on the latter (torch: as FSDP2's, ``_StridedShard`` where both shard
        the same dim), and ``attach_tensor`` presents full tensors for it as
        tensor-parallel parameters."""

    # ------------------------------------------------------------------ deferred init
    @abc.abstractmethod
    def is_deferred(self, tensor: Any) -> bool:
        """Whether ``tensor`` has a shape but no values yet: torch's meta device, a
        MindSpore Parameter built under ``no_init_parameters()``."""

    @abc.abstractmethod
    def deferred_part(self, param: Any, dim: int, start: int, length: int) -> Any:
        """Elements ``[start, start + length)`` of ``dim`` of a deferred ``param``, without
        making the whole tensor: torch a meta tensor (values come with ``to_empty``),
        MindSpore the parameter's initializer run at the part's shape (materialised)."""

    @abc.abstractmethod
    def registered_param(self, module: Any, attr_name: str) -> Any:
        """The parameter registered on ``module`` as ``attr_name`` now (None if none)."""

    @abc.abstractmethod
    def is_shard_like(self, new: Any, sharded: Any) -> bool:
        """Whether ``new``, registered in place of the sharded parameter ``sharded``, is laid
        out as it is (torch: a DTensor of the same global shape, mesh and placements;
        MindSpore: the same local shape)."""

    @abc.abstractmethod
    def replace_local(self, param: Any, local: Any) -> bool:
        """Make ``param`` hold ``local`` as its local shard, keeping the object (an optimizer
        may hold it). Return False where the framework cannot: a plain torch tensor
        cannot become a DTensor in place."""

    @abc.abstractmethod
    def starts_with(self, whole: Any, part: Any) -> bool:
        """Whether ``part``'s elements are the leading elements of ``whole``'s memory, so
        that writes to ``part`` are seen in ``whole`` (False where views do not write
        through)."""

    @abc.abstractmethod
    def local_tensor(self, param: Any) -> Any:
        """The differentiable local shard of a parameter made by ``make_sharded_param``."""

    @abc.abstractmethod
    def param_grad(self, param: Any) -> Any:
        """The gradient accumulated on ``param`` (torch: ``.grad``), None if it has none;
        only asked where gradients accumulate on the parameters (not
        ``capabilities.returns_grads_from_backward``)."""

    @abc.abstractmethod
    def grad_placeholder(self, param: Any) -> Any:
        """What backward returns for ``param`` while its reduced gradient is still on the
        wire: a zero tensor that ``write_grad`` fills later where gradients are returned to
        the user (MindSpore ``value_and_grad``), None where they accumulate on ``.grad``."""

    @abc.abstractmethod
    def write_grad(self, param: Any, placeholder: Any, local_grad: Any, to_main_grad: bool) -> None:
        """Deliver a reduced gradient shard, as soon as its reduction completes (during
        backward, or when a later drain finishes it): accumulate it into ``param.grad``
        (torch) or fill ``placeholder`` (MindSpore); with ``to_main_grad`` accumulate it in
        float32 into ``param.main_grad`` instead and leave the gradient untouched. Then run
        what the framework runs once a leaf's gradient is accumulated (torch: the
        parameter's post-accumulate-grad hooks)."""

    def attach_tensor(self, module: Any, attr_name: str, tensor: Any) -> None:
        """Make ``module.<attr_name>`` read ``tensor``, the full parameter, after
        ``register_param`` registered the sharded one there; ``capabilities.registers_full_tensors``
        says whether the full tensor is also what the module's parameters yield.

        By default an instance attribute shadows the registered parameter in both
        frameworks' attribute lookup, so the module computes with the full tensor while
        ``parameters()`` keeps seeing the sharded one.

        For a tensor-parallel parameter (``param_local_values``) ``tensor`` is this rank's
        tensor-parallel part, and the module reads it as the tensor-parallel parameter
        (torch: a DTensor over the tensor-parallel mesh, differentiable to ``tensor``).
        """
        object.__setattr__(module, attr_name, tensor)

    def detach_tensor(self, module: Any, attr_name: str) -> None:
        """Undo ``attach_tensor``: ``module.<attr_name>`` and the module's parameters are
        the sharded parameter again (detaching twice is harmless)."""
        module.__dict__.pop(attr_name, None)

    # ------------------------------------------------------------------ autograd and hooks
    @abc.abstractmethod
    def differentiable_call(self, inputs: Sequence[Any], forward_fn: Callable,
                            backward_fn: Callable, grads_to_inputs: bool = True) -> list:
        """Run ``forward_fn(inputs) -> outputs`` (a list of tensors) so that autograd calls
        ``backward_fn(output_grads) -> input_grads`` exactly once per backward, after the
        gradients of *all* outputs (every use) have been summed. Whatever the node saves
        for backward bypasses the user's saved-tensor hooks (activation checkpointing
        matches saved tensors by position, and a recomputation that finds the parameters
        there makes no node). ``grads_to_inputs=False``: the node still runs when any input
        requires a gradient, but what ``backward_fn`` returns is dropped and the inputs
        receive no gradient from it (the caller delivers gradients itself, and autograd
        must not touch the inputs: on torch it would run their post-accumulate-grad
        hooks)."""

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

    # ------------------------------------------------------------------ state dicts
    #: the file extension ``save_tensors`` writes (the framework's own checkpoint format)
    checkpoint_extension: str = "ckpt"

    @abc.abstractmethod
    def optimizer_state(self, optimizer: Any) -> list:
        """Every state tensor of ``optimizer`` as ``(state name, parameter or None, local
        tensor)``: per-parameter state (moments) with the parameter object it belongs to, the
        optimizer's own values (step counters) with None. The tensor is the live one a load
        writes with ``copy_into`` (on torch a DTensor's local part). State an optimizer has
        not created yet (torch before its first step) is not listed."""

    def create_optimizer_state(self, optimizer: Any) -> Callable[[], None] | None:
        """Make ``optimizer`` create its state (zeros) if it has none yet, so that a load can
        write it; return what undoes that, or None where nothing was created (the default:
        a framework whose optimizers create their state on construction)."""
        return None

    @abc.abstractmethod
    def save_tensors(self, tensors: dict, path: str) -> None:
        """Write ``{name: tensor or numpy array}`` to ``path`` in the framework's own format."""

    @abc.abstractmethod
    def load_tensors(self, path: str) -> dict:
        """Read a file ``save_tensors`` wrote: ``{name: tensor}``."""

    # ------------------------------------------------------------------ optimizer state
    @abc.abstractmethod
    def adam_params(self, optimizer: Any) -> list:
        """The parameters an Adam/AdamW ``optimizer`` updates; TypeError for another kind."""

    @abc.abstractmethod
    def adam_state(self, optimizer: Any, param: Any) -> tuple | None:
        """``(step, {"exp_avg": t, "exp_avg_sq": t[, "max_exp_avg_sq": t]})`` of ``param``,
        each moment shaped like ``local_tensor(param)``; None before it has any."""

    @abc.abstractmethod
    def set_adam_state(self, optimizer: Any, param: Any, step: int, moments: dict) -> None:
        """Replace ``param``'s state with ``step`` and ``moments`` (as ``adam_state`` gives)."""
