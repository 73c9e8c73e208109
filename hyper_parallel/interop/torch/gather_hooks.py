"""FSDP2's all-gather extension on torch: a tensor subclass's ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` as the core's ``GatherCodec``.

[Note: FSDP2's hooks as a codec]
FSDP2 calls ``local.fsdp_pre_all_gather(mesh)`` or, for the five-argument signature,
``(mesh, outer_size, outer_stride, module, mp_policy)`` on the shard's local tensor; the
tensors it returns are gathered along dim 0, and ``local.fsdp_post_all_gather(outputs,
metadata, param_dtype)`` returns ``(full, inner_tensors)``: ``inner_tensors`` hold the full
parameter's memory, which FSDP2 frees when it reshards and allocates again before the next
gather into the same outputs, after which it calls ``fsdp_post_all_gather(..., out=full)``.
This adapter does the same: it keeps each full parameter's gather outputs and inner
tensors, copies a re-gather's outputs into the kept ones and calls the hook with ``out``.
``mesh`` is the shard dim's torch ``DeviceMesh`` (torchao's float8 all-reduces its amax
over it), ``mp_policy`` torch's ``MixedPrecisionPolicy`` with the unit's dtypes.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from hyper_parallel.fully_shard.gather_codec import GatherCodec

PRE, POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"


def hooks_codec(local) -> SubclassHooks | None:
    """The codec of a local tensor that defines either hook (a missing one is reported at
    the first all-gather, as every other codec error), else None."""
    if hasattr(local, PRE) or hasattr(local, POST):
        return SubclassHooks(type(local).__name__)
    return None


def _shard_mesh(context):
    """The torch DeviceMesh of the unit's shard dim (FSDP2's ``shard_mesh_from_root``)."""
    native = context.mesh_info.mesh.native
    if native is None or native.ndim == 1:
        return native
    names = native.mesh_dim_names
    if not names:
        raise ValueError(f"parameter {context.fqn!r}: its FSDP2 all-gather hooks get the shard "
                         f"dim's mesh, which a {native.ndim}-D mesh without dim names cannot "
                         f"give; name the mesh's dims (init_device_mesh(..., mesh_dim_names=...))")
    return native[names[context.mesh_info.shard_mesh_dim]]


class SubclassHooks(GatherCodec):
    """FSDP2's two hooks of one parameter's local tensor, called as FSDP2 calls them."""

    def __init__(self, type_name: str):
        self.type_name = type_name
        # id(full) -> (weak full, gather outputs, inner tensors); by id: a subclass's
        # ``==`` is elementwise (or refused), so no weak-key dictionary
        self._kept = {}

    def __repr__(self) -> str:
        return f"{self.type_name}.{PRE}/{POST}"

    def encode(self, shard, context):
        missing = [name for name in (PRE, POST) if not hasattr(shard, name)]
        if missing:
            has = [name for name in (PRE, POST) if name not in missing]
            what = f"defines {has[0]} but not {missing[0]}" if has else \
                f"no longer defines {PRE} or {POST} (replaced by a {type(shard).__name__})"
            raise TypeError(
                f"parameter {context.fqn!r}: its local tensor ({self.type_name}) {what}; "
                f"FSDP2's all-gather extension needs both (define both, or neither to gather "
                f"it as a plain tensor)")
        hook = getattr(shard, PRE)
        count = len(inspect.signature(hook).parameters)
        mesh = _shard_mesh(context)
        if count == 1:
            inputs, metadata = hook(mesh)
        elif count == 5:
            from torch.distributed.fsdp._fully_shard._fsdp_api import MixedPrecisionPolicy
            full = torch.empty(context.full_shape, device="meta")
            policy = MixedPrecisionPolicy(param_dtype=context.param_dtype,
                                          reduce_dtype=context.reduce_dtype)
            inputs, metadata = hook(mesh, full.shape, full.stride(), context.module, policy)
        else:
            raise TypeError(
                f"parameter {context.fqn!r}: {self.type_name}.{PRE} takes {count} arguments; "
                f"FSDP2's signatures are {PRE}(self, mesh) and {PRE}(self, mesh, outer_size, "
                f"outer_stride, module, mp_policy)")
        return list(inputs), (shard, metadata)

    def decode(self, outputs, metadata, dtype, context, out=None):
        shard, hook_metadata = metadata
        post = getattr(shard, POST)
        if out is None:
            made = post(tuple(outputs), hook_metadata, dtype)
            if not (isinstance(made, tuple) and len(made) == 2):
                raise TypeError(f"parameter {context.fqn!r}: {self.type_name}.{POST} returned "
                                f"{type(made).__name__}; FSDP2's hook returns (full tensor, "
                                f"inner tensors)")
            full, inner = made
            self._kept = {key: entry for key, entry in self._kept.items() if entry[0]() is not None}
            self._kept[id(full)] = (weakref.ref(full), list(outputs), list(inner))
            return full
        _, kept, _ = self._entry(out)
        for into, new in zip(kept, outputs):  # autograd may hold them: values it had
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(into):
                into.copy_(new)
        post(tuple(kept), hook_metadata, dtype, out=out)
        return None

    def aliased(self, full, alias):
        _, outputs, inner = self._entry(full)
        self._kept[id(alias)] = (weakref.ref(alias), outputs, inner)

    def storage_of(self, full):
        return self._entry(full)[2]

    def _entry(self, full) -> tuple:
        entry = self._kept.get(id(full))
        if entry is None or entry[0]() is not full:
            raise RuntimeError(f"{self!r}: a full parameter this codec did not decode reached "
                               f"it (the unit's full parameters were replaced)")
        return entry
