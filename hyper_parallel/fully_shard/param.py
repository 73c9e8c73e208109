"""One managed parameter: its shard layout and the per-parameter pieces of gather/scatter.

[Note: shard layout]
A parameter of shape ``S`` sharded on dim ``d`` over ``n`` ranks is seen with ``d`` moved to
the front ("moved" shape ``M``). Its ``M[0]`` rows are split like ``torch.chunk``: every rank
owns up to ``chunk_rows = ceil(M[0] / n)`` rows, rank ``r`` rows ``[r*chunk_rows, ...)``, so
trailing ranks may own fewer rows or none. In communication buffers every rank's piece is
padded to ``chunk_rows`` rows (``padded_numel`` elements), which makes all pieces equal and
lets one flat all-gather / reduce-scatter serve the whole unit. The padding is always zero
going in and is dropped coming out, so it never reaches a gradient a user reads.

Where the platform ``pads_local_shards`` (MindSpore: its optimizers reject empty
parameters, and a trailing rank may own no rows), the sharded parameter itself keeps the
padding rows: they start at zero, receive zero gradients and so stay zero under the usual
optimizers (weight decay of zero is zero); gathering drops them.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

from hyper_parallel.fully_shard.gather_codec import GATHER_CODEC_ATTR
from hyper_parallel.fully_shard.mesh import MeshInfo
from hyper_parallel.platform import Platform
from hyper_parallel.tensor_parallel.layout import LAYOUT_ATTR, record_layout, tensor_parallel_layout
from hyper_parallel.unit_marks import SHARDED_BY



#: the attribute of a sharded parameter naming its FSDPParam (a weak reference: the unit's
#: state owns the FSDPParam), read by ``fsdp_param_of``
FSDP_PARAM_ATTR = "_hp_fsdp_param"

#: the prefix of the attributes a platform puts on the sharded parameters it makes
PLATFORM_ATTR_PREFIX = "_hp_"


def library_attrs(param: Any) -> dict:
    """The library's attributes on a sharded parameter (``SHARDED_BY``, ``FSDP_PARAM_ATTR``,
    a tensor-parallel ``LAYOUT_ATTR``, and a platform's own, whose names start with
    ``PLATFORM_ATTR_PREFIX``, such as torch's tensor-parallel spec of a DTensor): a framework
    conversion that swaps the tensor's contents (torch's ``Module._apply``, as in
    ``model.to_empty()`` after a meta-device build) drops them, so they are read before and
    put back after (``restore_library_attrs``)."""
    names = {SHARDED_BY, FSDP_PARAM_ATTR, LAYOUT_ATTR}
    names.update(name for name in vars(param) if name.startswith(PLATFORM_ATTR_PREFIX))
    return {name: getattr(param, name) for name in sorted(names) if hasattr(param, name)}


def restore_library_attrs(param: Any, attrs: dict) -> None:
    for name, value in attrs.items():
        object.__setattr__(param, name, value)


def fsdp_param_of(param: Any) -> FSDPParam | None:
    """The FSDPParam whose sharded parameter ``param`` is, or None (a parameter no unit
    manages, or a full tensor registered while a unit is unsharded)."""
    ref = getattr(param, FSDP_PARAM_ATTR, None)
    return None if ref is None else ref()


class FSDPParam:
    """Shard one parameter on creation (``register`` puts the shard in the module); then
    translate between its shard and the flat buffers."""

    def __init__(self, platform: Platform, fqn: str, param: Any, slots: list, shard_dim: int,
                 mesh_info: MeshInfo, is_sharded: bool = True):
        self.platform = platform
        self.fqn = fqn
        self.slots = slots  # [(module, attr_name)] where the parameter is registered
        orig_param = param
        # a tensor-parallel parameter: this rank's part is what is sharded and gathered
        param = platform.param_local_values(param)
        self.is_tensor_parallel = param is not orig_param
        self.full_shape = platform.shape(param)
        self.shard_dim = shard_dim
        self.mesh_info = mesh_info
        # An unsharded (small) parameter is laid out as one shard of the whole tensor.
        self.is_sharded = is_sharded
        self.shard_size = shard_size = mesh_info.shard_size if is_sharded else 1
        shard_rank = mesh_info.shard_rank if is_sharded else 0
        shape = platform.shape(param)  # read without touching values (meta, lazy init)
        moved = (shape[shard_dim], *shape[:shard_dim], *shape[shard_dim + 1:])
        self.rows, self.row_shape = moved[0], tuple(moved[1:])
        self.row_numel = math.prod(self.row_shape)
        self.chunk_rows = -(-self.rows // shard_size)
        self.padded_numel = self.chunk_rows * self.row_numel
        self.start = min(shard_rank * self.chunk_rows, self.rows)
        self.local_rows = min(self.chunk_rows, self.rows - self.start)
        pads = platform.capabilities.pads_local_shards
        self.stored_rows = self.chunk_rows if pads else self.local_rows
        self._padding_zeros = {}  # (numel, dtype) -> zeros, see gradient_pieces
        with platform.no_grad():
            local, self.padded_shard = self._local_piece(orig_param)
            self.sharded_param = platform.make_sharded_param(
                orig_param, local, mesh_info.mesh.native, mesh_info.shard_mesh_dim,
                shard_dim if is_sharded else None, self.full_shape, backing=self.padded_shard)
        setattr(self.sharded_param, FSDP_PARAM_ATTR, weakref.ref(self))
        #: what is gathered for it and how the full parameter is rebuilt (gather_codec.py):
        #: set on the parameter before fully_shard, or asked for by its local tensor's type;
        #: an unsharded parameter is never gathered
        codec = getattr(orig_param, GATHER_CODEC_ATTR, None) or platform.gather_codec_of(
            platform.local_tensor(self.sharded_param))
        self.gather_codec = codec if is_sharded else None
        #: the core's tensor parallelism split ``param``: its full parameter is this rank's
        #: tensor-parallel block, and the shard keeps the block's layout for later readers
        self.tensor_parallel_layout = tensor_parallel_layout(orig_param)
        if self.tensor_parallel_layout is not None:
            record_layout(self.sharded_param, self.tensor_parallel_layout)

    @property
    def _padded_at_end(self) -> bool:
        """Whether the shard lives at the start of its padded piece, which the all-gather
        then reads as it is (as FSDP2 keeps its padded shard): dim-0 shards with missing
        rows, where the sharded parameter itself is not padded."""
        return (not self.platform.capabilities.pads_local_shards and self.shard_dim == 0
                and 0 < self.local_rows < self.chunk_rows)

    def _local_piece(self, param: Any) -> tuple:
        """``(local, padded)``: this rank's shard of ``param`` as stored, and the padded
        piece it is a leading view of (None where there is none). A deferred parameter
        (meta, MindSpore lazy init) gives ``Platform.deferred_part``: no full tensor is
        ever made."""
        p = self.platform
        values = p.param_local_values(param)  # a tensor-parallel parameter: this rank's part
        if p.is_deferred(values):
            local = p.movedim(p.deferred_part(values, self.shard_dim, self.start, self.local_rows),
                              self.shard_dim, 0)
        else:
            local = p.narrow(p.movedim(values, self.shard_dim, 0), 0, self.start, self.local_rows)
        padded = None
        padding = (self.chunk_rows - self.local_rows, *self.row_shape)
        dtype = p.dtype_of(values)
        if p.is_deferred(local):
            pass  # no values yet (meta): padded once materialised (reset_sharded_param)
        elif self.stored_rows > self.local_rows:
            local = p.cat([local, p.zeros(padding, dtype)], 0)
        elif self._padded_at_end:
            padded = p.cat([local, p.zeros(padding, dtype)], 0)
            local = p.narrow(padded, 0, 0, self.local_rows)
        return p.contiguous(p.movedim(local, 0, self.shard_dim)), padded

    # ---------------------------------------------------------------- replaced parameters
    def reset_sharded_param(self, pick_up: bool = True) -> None:
        """At the root's lazy init, as FSDP2's: take a parameter that replaced the sharded
        one (``pick_up_replacement``; not while the unit's full parameters are attached,
        ``pick_up`` False), insist that it holds values now, and give a shard materialised
        since ``fully_shard`` (``to_empty`` after a meta build) its padded piece back, so
        the all-gather reads it in place."""
        p = self.platform
        if pick_up:
            self.pick_up_replacement()
        if p.is_deferred(p.local_tensor(self.sharded_param)):
            raise RuntimeError(
                f"parameter {self.fqn!r} has no values at the first forward (built on the meta "
                f"device or lazily): after fully_shard, materialise it (torch: "
                f"model.to_empty(device=...) then reset_parameters() or your init_weights()) "
                f"or load weights into it (docs/api.md, Deferred initialisation)")
        if not self._padded_at_end:
            return
        with p.no_grad():
            local = p.local_tensor(self.sharded_param)
            if self.padded_shard is not None and p.starts_with(self.padded_shard, local):
                return
            padding = (self.chunk_rows - self.local_rows, *self.row_shape)
            padded = p.cat([local, p.zeros(padding, p.dtype_of(local))], 0)
            if p.replace_local(self.sharded_param, p.narrow(padded, 0, 0, self.local_rows)):
                self.padded_shard = padded

    def pick_up_replacement(self) -> None:
        """Adopt a parameter registered in place of the sharded one since fully_shard
        (``load_state_dict(assign=True)``, torch's ``set_model_state_dict``, a user's
        ``setattr``), keeping that object (an optimizer made after the load holds it):
        one laid out as the shard is taken as it is; one of the full shape is cut to this
        rank's shard in place where the framework can (``Platform.replace_local``).
        Anything else is an error naming the parameter and the fix, with nothing changed.
        A tied parameter takes its first slot's replacement in every slot."""
        p = self.platform
        registered = [p.registered_param(module, name) for module, name in self.slots]
        new = next((r for r in registered if r is not self.sharded_param), self.sharded_param)
        if new is self.sharded_param:
            return
        where = ", ".join(f"{type(m).__name__}.{n}" for m, n in self.slots)
        if new is None:
            raise ValueError(f"parameter {self.fqn!r} ({where}) was removed after fully_shard; "
                             f"a fully_shard unit needs every parameter it manages: replace it "
                             f"with a parameter of shape {self.full_shape} instead")
        padded = None
        if not p.is_shard_like(new, self.sharded_param):
            shape = tuple(p.shape(p.param_local_values(new)))
            if shape != tuple(self.full_shape):
                raise ValueError(
                    f"parameter {self.fqn!r} ({where}) was replaced after fully_shard by one of "
                    f"shape {shape}; it must have the parameter's full shape "
                    f"{tuple(self.full_shape)} (or be laid out as its shard)")
            with p.no_grad():
                local, padded = self._local_piece(new)
                if not p.replace_local(new, local):
                    raise ValueError(
                        f"parameter {self.fqn!r} ({where}) was replaced after fully_shard by a "
                        f"full tensor, which cannot become this rank's shard in place (an "
                        f"optimizer may hold it): load full weights through the state-dict path "
                        f"instead (torch: torch.distributed.checkpoint.state_dict."
                        f"set_model_state_dict(model, sd, options=StateDictOptions("
                        f"full_state_dict=True)); see docs/api.md, Deferred initialisation), or "
                        f"replace it by a parameter laid out as its shard")
        self.padded_shard = padded  # a shard-like replacement: padded by reset_sharded_param
        kept = library_attrs(self.sharded_param)
        self.sharded_param = new
        restore_library_attrs(new, dict(kept, **{FSDP_PARAM_ATTR: weakref.ref(self)}))
        self.register()

    def register(self) -> None:
        """Put the sharded parameter where the original was registered (every slot). Apart
        from construction, so that a unit's parameters are all made before any module
        changes (api.py, "validate everything, then change anything")."""
        for module, name in self.slots:
            self.platform.register_param(module, name, self.sharded_param)

    @property
    def orig_dtype(self) -> Any:
        """The sharded parameter's own dtype, read when needed: a user's ``module.to(dtype)``
        replaces the parameter's memory in another dtype (keeping the parameter object), and
        the gathers, the computation and the delivered gradients follow it."""
        return self.platform.dtype_of(self.sharded_param)

    @property
    def gathers_in_place(self) -> bool:
        """Whether the full parameter, read in place from the all-gather output where its
        pieces abut (``full_from_whole``), is a view of that output's memory: dim-0
        shards, where the padding is only ever at the end. A re-gather can then write
        straight into its memory."""
        return self.shard_dim == 0 and self.shard_size > 1

    # ---------------------------------------------------------------- unshard pieces
    def padded_flat_shard(self, local: Any, dtype: Any) -> Any:
        """This rank's piece of the all-gather input: the shard, padded, flat, in ``dtype``.
        A shard kept at the start of its padded piece (``make_sharded_param(backing=...)``)
        is read in place, unless something replaced the parameter's memory since
        (``module.to(dtype)``): that piece is then stale for good and is let go."""
        p = self.platform
        if self.stored_rows == 0:
            return p.zeros((self.padded_numel,), dtype)
        if self.padded_shard is not None and not p.starts_with(self.padded_shard, local):
            self.padded_shard = None
        if self.padded_shard is not None and dtype == p.dtype_of(self.padded_shard):
            return p.reshape(self.padded_shard, (self.padded_numel,))  # no copy
        moved = p.movedim(p.cast(local, dtype), self.shard_dim, 0)
        missing = self.chunk_rows - self.stored_rows
        if missing:
            moved = p.cat([moved, p.zeros((missing, *self.row_shape), dtype)], 0)
        return p.reshape(moved, (self.padded_numel,))

    def full_from_whole(self, whole: Any, offset: int) -> Any:
        """The full parameter read in place from a flat all-gather output where it is one
        contiguous stretch at ``offset`` (alone in the buffer, its pieces abutting, or one
        rank; see param_group.py, "gather layout"): a view of it where the layout allows
        (dim-0 shards), no copy."""
        p = self.platform
        stretch = p.narrow(whole, 0, offset, self.rows * self.row_numel)  # padding at the end
        return self._rows_to_param(p.reshape(stretch, (self.rows, *self.row_shape)))

    def full_from_pieces(self, pieces: list, offsets: list) -> Any:
        """The full parameter out of a fused all-gather's per-rank pieces, where it sits at
        ``offsets[r]`` of rank r's piece: one concatenation of contiguous reads (reading
        columns of ``[shard_size, total]`` would be a strided copy)."""
        p = self.platform
        parts = []
        for rank, (piece, offset) in enumerate(zip(pieces, offsets)):
            rows = max(0, min(self.chunk_rows, self.rows - rank * self.chunk_rows))
            if rows or not parts:  # the padding rows are left out: no view of the result
                parts.append(p.reshape(p.narrow(piece, 0, offset, rows * self.row_numel),
                                       (rows, *self.row_shape)))
        return self._rows_to_param(p.cat(parts, 0))

    def _rows_to_param(self, rows: Any) -> Any:
        """``[rows, *row_shape]`` to the parameter's shape. Nothing is done that is not
        needed: on MindSpore even asking ``contiguous()`` waits for the asynchronous
        pipeline."""
        p = self.platform
        if self.shard_dim == 0:
            return rows
        return p.contiguous(p.movedim(rows, 0, self.shard_dim))

    def refill_from_gathered(self, full: Any, pieces: list, offsets: list) -> None:
        """Write the all-gather's pieces (this parameter at ``offsets[r]`` of rank r's)
        back into ``full`` (whose memory was restored), one rank's rows at a time straight
        from the buffer: a single copy, no temporary. Where full parameters own their
        memory (not ``kernels_read_views``, layout.py "views"), it is assembled as the first
        gather assembled it and copied in whole."""
        p = self.platform
        if not p.capabilities.kernels_read_views:
            p.copy_into(full, self.full_from_pieces(pieces, offsets))
            return
        for rank, (piece, offset) in enumerate(zip(pieces, offsets)):
            first = rank * self.chunk_rows
            rows = min(self.chunk_rows, self.rows - first)
            if rows <= 0:
                break
            flat = p.narrow(piece, 0, offset, rows * self.row_numel)
            part = p.movedim(p.reshape(flat, (rows, *self.row_shape)), 0, self.shard_dim)
            p.copy_into_slice(full, self.shard_dim, first, part)

    def full_from_local(self, local: Any, dtype: Any) -> Any:
        """An unsharded parameter's full tensor: a private copy of the local one in ``dtype``."""
        p = self.platform
        cast = p.cast(local, dtype)
        return cast if cast is not local else p.clone(local)

    # ---------------------------------------------------------------- reduce pieces
    def gradient_pieces(self, full_grad: Any, dtype: Any) -> list:
        """The gradient in ``dtype`` cut for a reduce-scatter: one list of flat parts per
        rank, whose concatenation is that rank's ``padded_numel`` elements. Nothing is
        copied: the parts are views of the gradient, plus zeros where a rank's rows need
        padding (or it has none); whoever needs one tensor per rank concatenates. The zeros
        are made once and reused every step (the parts are read-only to the collectives):
        on MindSpore each ``zeros`` is an op launch per parameter and step. They exist only
        for parameters whose rows do not divide evenly, and hold less than two padded
        pieces (two shards) per such parameter. ``full_grad`` None (a parameter this
        rank's backward did not reach) takes part as zeros, one padded piece made once."""
        p = self.platform
        if full_grad is None:
            return [[self._zeros(self.padded_numel, dtype)] for _ in range(self.shard_size)]
        moved = p.movedim(p.cast(full_grad, dtype), self.shard_dim, 0)
        if self.shard_dim != 0:  # dim 0 is contiguous already (and asking waits on MindSpore)
            moved = p.contiguous(moved)
        flat = p.reshape(moved, (self.rows * self.row_numel,))
        pieces = []
        for rank in range(self.shard_size):
            first = rank * self.chunk_rows
            rows = max(0, min(self.chunk_rows, self.rows - first))
            parts = [p.narrow(flat, 0, first * self.row_numel, rows * self.row_numel)] if rows else []
            if rows < self.chunk_rows:
                parts.append(self._zeros((self.chunk_rows - rows) * self.row_numel, dtype))
            pieces.append(parts)
        return pieces

    def _zeros(self, numel: int, dtype: Any) -> Any:
        key = (numel, dtype)
        if key not in self._padding_zeros:
            self._padding_zeros[key] = self.platform.zeros((numel,), dtype)
        return self._padding_zeros[key]

    def sharded_grad_from(self, reduced: Any, offset: int) -> Any:
        """This rank's gradient shard out of the flat reduce-scatter output."""
        p = self.platform
        local = p.reshape(p.narrow(reduced, 0, offset, self.padded_numel),
                          (self.chunk_rows, *self.row_shape))
        if self.stored_rows != self.chunk_rows:
            local = p.narrow(local, 0, 0, self.stored_rows)
        if self.shard_dim != 0:  # dim 0: already contiguous (and asking waits on MindSpore)
            local = p.contiguous(p.movedim(local, 0, self.shard_dim))
        return p.cast(local, self.orig_dtype)

    def grad_placeholder(self) -> Any:
        """What backward returns for the sharded parameter while its reduced gradient is
        still on the wire: zeros that ``Platform.write_grad`` fills later where backward's
        return value is the user's gradient (``returns_grads_from_backward``), else None."""
        p = self.platform
        if not p.capabilities.returns_grads_from_backward:
            return None
        local = p.local_tensor(self.sharded_param)
        return p.zeros(p.shape(local), p.dtype_of(local))

    # ---------------------------------------------------------------- module attributes
    def attach(self, full: Any) -> None:
        for module, name in self.slots:
            self.platform.attach_tensor(module, name, full)

    def detach(self) -> None:
        for module, name in self.slots:
            self.platform.detach_tensor(module, name)
