"""One parameter group of a fully_shard unit (its parameters on one mesh, placement.py)
and their flat communication buffers.

[Note: one code path]
The group gathers and lays out gradients leg by leg (layout.py decides the legs, each
rank's gather order and which parameter is read in place); nothing here depends on which
layout strategy made them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hyper_parallel.fully_shard.codec_leg import decode_full, decode_into, issue_codec_gather
from hyper_parallel.fully_shard.gather_codec import GatherContext
from hyper_parallel.fully_shard.layout import Leg, LayoutStrategy
from hyper_parallel.fully_shard.mesh import MeshInfo
from hyper_parallel.fully_shard.param import FSDPParam
from hyper_parallel.platform import Gathered, Handle, Platform

if TYPE_CHECKING:
    from hyper_parallel.fully_shard.post_forward import PostForwardShards

@dataclass
class LegGather:
    """One leg's all-gather: in flight on ``handle``, then, once finished, its per-rank
    ``pieces`` and the ``whole`` flat buffer (None where the pieces are separate tensors)."""

    leg: Leg
    handle: Handle
    into: Any = None  # the released full tensor the gather writes into, or None
    pieces: list | None = None
    whole: Any = None
    encoded: list | None = None  # a codec leg's encodings (codec_leg.Encoded), params order


class FSDPParamGroup:
    """Gather shards into full parameters over one mesh; lay gradients out for their
    reduction."""

    def __init__(self, platform: Platform, params: list[FSDPParam], mesh_info: MeshInfo,
                 param_dtype: Any, reduce_dtype: Any, layout: LayoutStrategy):
        self.platform = platform
        self.params = params
        self.mesh_info = mesh_info
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.legs = layout.legs(platform, params, mesh_info, self.compute_dtype)
        self.sharded_legs = [leg for leg in self.legs if leg.sharded]
        self._pending_gather = None  # [LegGather] in flight
        self._pending_into = None    # the released fulls it gathers into, or None
        self._pending_post_forward = None  # the post-forward shards it gathers, or None

    def local_shards(self) -> list:
        return [self.platform.local_tensor(p.sharded_param) for p in self.params]

    def compute_dtype(self, fsdp_param: FSDPParam) -> Any:
        """The dtype ``fsdp_param`` is gathered and computed in: ``param_dtype``, else the
        sharded parameter's dtype now (``module.to(dtype)`` changes it)."""
        return self.param_dtype if self.param_dtype is not None else fsdp_param.orig_dtype

    @property
    def gathered_bytes(self) -> int:
        """What the group's full parameters take in their compute dtypes now (see
        IterationContext.keep_working_set)."""
        return sum(fp.shard_size * fp.padded_numel * self.platform.element_size(self.compute_dtype(fp))
                   for fp in self.params)

    # ---------------------------------------------------------------- all-gather
    def issue_gather(self, async_op: bool, released: list | None = None,
                     post_forward: PostForwardShards | None = None) -> None:
        """Start the all-gathers of the current shards (no-op if they are already in flight).

        ``released``: this group's full parameters (``params`` order) whose memory was
        released, for a re-gather before backward: a leg whose parameter ``gathers_in_place``
        is gathered straight into its full tensor (see ``refill``). ``post_forward``: what
        was kept of them after forward, gathered instead of the shards, over its smaller
        group (post_forward.py)."""
        if self._pending_gather is not None or not self.sharded_legs:
            return
        into = {id(fp): full for fp, full in zip(self.params, released or ())}
        with self.platform.no_grad():
            self._pending_into = released
            self._pending_post_forward = post_forward
            if post_forward is not None:
                self._pending_gather = [LegGather(leg, post_forward.issue_gather(i, async_op))
                                        for i, leg in enumerate(self.sharded_legs)]
                return
            self._pending_gather = [self._issue_codec_gather(leg, async_op) if leg.codec else
                                    self._issue_leg_gather(leg, async_op, into)
                                    for leg in self.sharded_legs]

    def codec_context(self, fsdp_param: FSDPParam) -> GatherContext:
        return GatherContext(self.platform, fsdp_param.fqn, tuple(fsdp_param.full_shape),
                             fsdp_param.slots[0][0], self.mesh_info, self.param_dtype,
                             self.reduce_dtype)

    def _issue_codec_gather(self, leg: Leg, async_op: bool) -> LegGather:
        """The codec leg's gather (codec_leg.py); never into released memory: a re-gather
        is decoded into its full parameters (``refill``)."""
        handle, encoded = issue_codec_gather(
            self.platform, leg.params, [self.codec_context(fp) for fp in leg.params],
            self.mesh_info.shard_group, self.mesh_info.shard_size, async_op)
        return LegGather(leg, handle, encoded=encoded)

    def _issue_leg_gather(self, leg: Leg, async_op: bool, into: dict) -> LegGather:
        """The leg's gather: its handle's result is the leg's ``Gathered`` (no collective
        with one rank); ``into`` the released full tensor it writes into, or None when it
        gathers into new memory."""
        p, size = self.platform, self.mesh_info.shard_size
        order = leg.gather_orders[self.mesh_info.shard_rank if size > 1 else 0]
        pieces = [fp.padded_flat_shard(p.local_tensor(fp.sharded_param), self.compute_dtype(fp))
                  for fp in order]
        if size == 1:
            whole = p.cat(pieces, 0)  # cat copies: the fulls must not alias the shards
            return LegGather(leg, Handle(result=Gathered([whole], whole)))
        flat = pieces[0] if len(pieces) == 1 else p.cat(pieces, 0)
        in_place = leg.in_place
        full = into.get(id(in_place)) if in_place is not None else None
        out = None
        if full is not None and in_place.gathers_in_place:
            out = p.restored_flat(full, size * leg.total_numel, leg.gather_offsets_of(in_place)[0])
        else:
            full = None
        handle = p.all_gather(flat, self.mesh_info.shard_group, async_op=async_op, dim="shard",
                              out=out)
        return LegGather(leg, handle, full)

    def has_pending_gather(self) -> bool:
        return self._pending_gather is not None

    def discard_gather(self) -> None:
        """Drop all-gathers nobody consumed (their values may be stale by the next use);
        a full tensor one was writing into is released again."""
        pending, self._pending_gather, self._pending_into = self._pending_gather, None, None
        self._pending_post_forward = None
        for gather in pending or ():
            gather.handle.wait()
            if gather.into is not None:
                self.platform.release_storage(gather.into)

    def wait_gather(self) -> list:
        """Finish the all-gathers; return new full tensors in ``params`` order."""
        p = self.platform
        fulls = {}
        for gather in self._finish_gather():
            leg, whole = gather.leg, gather.whole
            for encoded in gather.encoded or ():
                fulls[id(encoded.fsdp_param)] = decode_full(
                    p, encoded, gather.pieces, self.compute_dtype(encoded.fsdp_param))
            for fp in () if leg.codec else leg.params:
                offsets = leg.gather_offsets_of(fp)
                # read in place where it is one contiguous stretch of ``whole`` (see the
                # note "gather layout"; with one rank, every parameter), else concatenated
                in_place = whole is not None and leg.read_in_place(fp)
                fulls[id(fp)] = (fp.full_from_whole(whole, offsets[0]) if in_place
                                 else fp.full_from_pieces(gather.pieces, offsets))
        return [fulls[id(fp)] if fp.is_sharded else
                fp.full_from_local(p.local_tensor(fp.sharded_param), self.compute_dtype(fp))
                for fp in self.params]

    def refill(self, fulls: list, post_forward: PostForwardShards | None = None) -> None:
        """Finish the all-gathers into ``fulls`` (``params`` order), whose memory was
        released (of ``post_forward``, if kept): the parameter gathered in place needs
        nothing more, the others are copied from the gathered pieces, one rank's rows at
        a time."""
        p = self.platform
        sources, decoded = {}, {}
        for gather in self._finish_gather(released=fulls, post_forward=post_forward):
            leg = gather.leg
            for encoded in gather.encoded or ():
                decoded[id(encoded.fsdp_param)] = (encoded, gather.pieces)
            for fp in () if leg.codec else leg.params:
                if gather.into is None or fp is not leg.in_place:
                    sources[id(fp)] = (gather.pieces, leg.gather_offsets_of(fp))
        for fp, full in zip(self.params, fulls):
            for tensor in self.memory_of(fp, full):
                p.restore_storage(tensor)
            if id(fp) in decoded:
                decode_into(p, *decoded[id(fp)], self.compute_dtype(fp), full)
            elif id(fp) in sources:
                fp.refill_from_gathered(full, *sources[id(fp)])
            elif not fp.is_sharded:
                p.copy_into(full, p.cast(p.local_tensor(fp.sharded_param), self.compute_dtype(fp)))

    @staticmethod
    def memory_of(fsdp_param: FSDPParam, full: Any) -> list:
        """The tensors whose memory holds ``full``, ``fsdp_param``'s full parameter: itself,
        or what its gather codec names (a tensor subclass holds its values in others)."""
        codec = fsdp_param.gather_codec
        return [full] if codec is None else list(codec.storage_of(full))

    def _finish_gather(self, released: list | None = None,
                       post_forward: PostForwardShards | None = None) -> list[LegGather]:
        """The finished all-gathers (``pieces`` and ``whole`` filled in), issued
        synchronously if nobody prefetched them."""
        if self._pending_into is not None and self._pending_into is not released:
            # in flight into other released fulls (a prefetch for another forward's): those
            # go back to released, and this gather starts over
            self.discard_gather()
        if self._pending_gather is None:
            self.issue_gather(async_op=False, released=released, post_forward=post_forward)
        pending, self._pending_gather, self._pending_into = self._pending_gather or [], None, None
        gathered_post_forward, self._pending_post_forward = self._pending_post_forward, None
        for gather in pending:
            gathered = gather.handle.wait()
            gather.pieces, gather.whole = gathered.pieces, gathered.flat
            if gathered_post_forward is not None:
                gather.pieces = gathered_post_forward.shard_rank_pieces(gather.leg, gather.pieces)
                gather.whole = None
        return pending
