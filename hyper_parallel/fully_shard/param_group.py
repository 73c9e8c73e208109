"""One fully_shard unit's parameters and their flat communication buffers.

[Note: legs: which parameters share a collective]
A unit's parameters travel in "legs"; each leg has one all-gather (sharded legs), one
flat gradient buffer and one all-reduce bucket (``ReplicateBucket``, gradients.py).

- The fused leg: the all-gather input is the concatenation of every parameter's padded
  flat shard (``total`` elements per rank, in the rank's gather order, below); each full
  parameter is concatenated from its columns of the per-rank pieces of the output
  (``Platform.all_gather``'s ``Gathered``), except the one whose pieces abut. The
  reduce-scatter input is rank-major: rank r's padded pieces of every parameter's gradient
  in order (``Platform.reduce_scatter``, one concatenation); the output is one flat
  buffer, the leg's bucket.
- Own legs: a sharded parameter of at least ``own_collective_bytes`` (all-gather piece in
  the compute dtype) travels alone. Then nothing is concatenated: its shard is the
  all-gather input as it is, the output buffer is the full parameter (a view on torch,
  sharding on dim 0), its gradient is the reduce-scatter input (per-rank views of it, on
  gloo read where they are) and the output its gradient shard. One more call per such
  parameter buys three full-size copies fewer per step (FSDP2 always fuses and always
  copies). With a shard group of one rank there is no
  collective, and the full tensors are private copies (they must never alias the shards).
- The small leg: unsharded (below ``shard_threshold_bytes``) parameters skip the gather and
  reduce-scatter: each rank holds them whole and their gradients form one bucket
  all-reduced over the whole data-parallel group, one all-reduce per unit.

[Note: gather layout: which parameter is read in place]
A parameter whose pieces abut in the all-gather output is one contiguous stretch of it,
which ``full_from_whole`` reads as a view (dim-0 shards): no concatenation, no copy. With
a leg of one parameter that is always so. Over two ranks, rank 1 lays out its piece in
the reverse of rank 0's order, so rank 0's last parameter and rank 1's first abut: the
leg's largest parameter goes there (the "junction"). Its view keeps the whole gather
buffer alive as long as the full parameter lives, while the other parameters are copied
out of it too, so a junction is only made where the rest of the leg is at most
1/``JUNCTION_MAX_REST`` of it (a weight and its bias, not a block of similar matrices). On
MindSpore CPU that concatenation was most of the cost of building the full parameters
(docs/platforms.md). From three ranks on, a middle rank's piece cannot abut both
neighbours with the same parameter, so a leg of several parameters keeps one order and
copies. The reduce-scatter keeps the ``params`` order on every rank (``offsets``): its
layout is independent. A re-gather into a released junction (``refill``) writes the
whole buffer into the junction's own memory, as for a lone parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hyper_parallel.fully_shard.gradients import ReplicateBucket
from hyper_parallel.fully_shard.mesh import MeshInfo
from hyper_parallel.fully_shard.param import FSDPParam
from hyper_parallel.platform import Gathered, Handle, Platform

if TYPE_CHECKING:
    from hyper_parallel.fully_shard.post_forward import PostForwardShards

# A junction read in place keeps the whole gather buffer alive with it (the rest of the leg
# is copied out of it as well): allowed where the rest is at most 1/JUNCTION_MAX_REST of it,
# so the unit holds at most that much more than with copies (see the note "gather layout").
JUNCTION_MAX_REST = 8


class Leg:
    """Parameters that share a collective and a flat gradient buffer, with their offsets."""

    def __init__(self, params: list, bucket: ReplicateBucket, sharded: bool):
        self.params = params
        self.bucket = bucket
        self.sharded = sharded  # gathered and reduce-scattered over the shard group
        self.offsets = []  # in the reduce-scatter's and the bucket's flat buffers
        total = 0
        for fsdp_param in params:
            self.offsets.append(total)
            total += fsdp_param.padded_numel
        self.total_numel = total
        size = params[0].shard_size if sharded else 1
        # see the note "gather layout"; one rank: the params order, each read in place
        self.junction = None
        order = list(params)
        largest = max(params, key=lambda fp: fp.padded_numel)
        if (size == 2 or (size > 2 and len(params) == 1)) and \
                (total - largest.padded_numel) * JUNCTION_MAX_REST <= largest.padded_numel:
            self.junction = largest
            order = [fp for fp in params if fp is not largest] + [largest]
        self.gather_orders = [order[::-1] if rank % 2 and self.junction is not None else order
                              for rank in range(size)]
        self.gather_offsets = [_offsets_in(order, params) for order in self.gather_orders]
        self._gather_offsets_by_param = {
            id(fp): [offsets[i] for offsets in self.gather_offsets] for i, fp in enumerate(params)}

    def gather_offsets_of(self, fsdp_param: FSDPParam) -> list:
        """Where ``fsdp_param`` sits in each rank's all-gather piece."""
        return self._gather_offsets_by_param[id(fsdp_param)]


def _offsets_in(order: list, params: list) -> list:
    """Each of ``params``' offset in a flat piece laid out in ``order``."""
    start, total = {}, 0
    for fsdp_param in order:
        start[id(fsdp_param)] = total
        total += fsdp_param.padded_numel
    return [start[id(fp)] for fp in params]


class FSDPParamGroup:
    """Gather shards into full parameters; lay gradients out for their reduction."""

    def __init__(self, platform: Platform, params: list[FSDPParam], mesh_info: MeshInfo,
                 param_dtype: Any, reduce_dtype: Any, own_collective_bytes: int | None):
        self.platform = platform
        self.params = params
        self.mesh_info = mesh_info
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        info = mesh_info

        def replicate_bucket():
            return ReplicateBucket(platform, info.replicate_group, info.replicate_size, "replicate")

        sharded = [p for p in params if p.is_sharded]
        alone = [p for p in sharded if own_collective_bytes is not None and
                 p.padded_numel * platform.element_size(self.compute_dtype(p)) >= own_collective_bytes]
        fused = [p for p in sharded if all(p is not a for a in alone)]
        self.sharded_legs = [Leg(fused, replicate_bucket(), sharded=True)] if fused else []
        self.sharded_legs += [Leg([p], replicate_bucket(), sharded=True) for p in alone]
        small = [p for p in params if not p.is_sharded]
        self.legs = list(self.sharded_legs)
        if small:
            self.legs.append(Leg(small, ReplicateBucket(
                platform, info.data_parallel_group, info.data_parallel_size, "data_parallel"),
                sharded=False))
        self._pending_gather = None  # [(leg, handle, full)] in flight
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
        """What the unit's full parameters take in their compute dtypes now (see
        IterationContext.keep_working_set)."""
        return sum(fp.shard_size * fp.padded_numel * self.platform.element_size(self.compute_dtype(fp))
                   for fp in self.params)

    # ---------------------------------------------------------------- all-gather
    def issue_gather(self, async_op: bool, released: list | None = None,
                     post_forward: PostForwardShards | None = None) -> None:
        """Start the all-gathers of the current shards (no-op if they are already in flight).

        ``released``: this unit's full parameters (``params`` order) whose memory was
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
                self._pending_gather = [(leg, post_forward.issue_gather(i, async_op), None)
                                        for i, leg in enumerate(self.sharded_legs)]
                return
            self._pending_gather = [self._issue_leg_gather(leg, async_op, into)
                                    for leg in self.sharded_legs]

    def _issue_leg_gather(self, leg: Leg, async_op: bool, into: dict) -> tuple:
        """``(leg, handle, full)``: the handle's result is the leg's ``Gathered`` (None: no
        collective, one rank); ``full`` is the released full tensor the gather writes into,
        or None when it gathers into new memory."""
        p, size = self.platform, self.mesh_info.shard_size
        order = leg.gather_orders[self.mesh_info.shard_rank if size > 1 else 0]
        pieces = [fp.padded_flat_shard(p.local_tensor(fp.sharded_param), self.compute_dtype(fp))
                  for fp in order]
        if size == 1:
            whole = p.cat(pieces, 0)  # cat copies: the fulls must not alias the shards
            return leg, Handle(result=Gathered([whole], whole)), None
        flat = pieces[0] if len(pieces) == 1 else p.cat(pieces, 0)
        junction = leg.junction
        full = into.get(id(junction)) if junction is not None else None
        out = None
        if full is not None and junction.gathers_in_place:
            out = p.restored_flat(full, size * leg.total_numel, leg.gather_offsets_of(junction)[0])
        else:
            full = None
        handle = p.all_gather(flat, self.mesh_info.shard_group, async_op=async_op, dim="shard",
                              out=out)
        return leg, handle, full

    def has_pending_gather(self) -> bool:
        return self._pending_gather is not None

    def discard_gather(self) -> None:
        """Drop all-gathers nobody consumed (their values may be stale by the next use);
        a full tensor one was writing into is released again."""
        pending, self._pending_gather, self._pending_into = self._pending_gather, None, None
        self._pending_post_forward = None
        for _, handle, full in pending or ():
            handle.wait()
            if full is not None:
                self.platform.release_storage(full)

    def wait_gather(self) -> list:
        """Finish the all-gathers; return new full tensors in ``params`` order."""
        p = self.platform
        fulls = {}
        for leg, pieces, whole, _ in self._finish_gather():
            for fp in leg.params:
                offsets = leg.gather_offsets_of(fp)
                # read in place where it is one contiguous stretch of ``whole`` (see the
                # note "gather layout"; with one rank, every parameter), else concatenated
                in_place = whole is not None and (fp is leg.junction or self.mesh_info.shard_size == 1)
                fulls[id(fp)] = (fp.full_from_whole(whole, offsets[0]) if in_place
                                 else fp.full_from_pieces(pieces, offsets))
        return [fulls[id(fp)] if fp.is_sharded else
                fp.full_from_local(p.local_tensor(fp.sharded_param), self.compute_dtype(fp))
                for fp in self.params]

    def refill(self, fulls: list, post_forward: PostForwardShards | None = None) -> None:
        """Finish the all-gathers into ``fulls`` (``params`` order), whose memory was
        released (of ``post_forward``, if kept): the parameter gathered in place needs
        nothing more, the others are copied from the gathered pieces, one rank's rows at
        a time."""
        p = self.platform
        sources = {}
        for leg, pieces, _, into in self._finish_gather(released=fulls, post_forward=post_forward):
            for fp in leg.params:
                if into is None or fp is not leg.junction:
                    sources[id(fp)] = (pieces, leg.gather_offsets_of(fp))
        for fp, full in zip(self.params, fulls):
            p.restore_storage(full)
            if id(fp) in sources:
                fp.refill_from_gathered(full, *sources[id(fp)])
            elif not fp.is_sharded:
                p.copy_into(full, p.cast(p.local_tensor(fp.sharded_param), self.compute_dtype(fp)))

    def _finish_gather(self, released: list | None = None,
                       post_forward: PostForwardShards | None = None) -> list:
        """[(leg, per-rank pieces, whole buffer or None, full gathered into or None)] of
        finished all-gathers, issued synchronously if nobody prefetched them."""
        if self._pending_into is not None and self._pending_into is not released:
            # in flight into other released fulls (a prefetch for another forward's): those
            # go back to released, and this gather starts over
            self.discard_gather()
        if self._pending_gather is None:
            self.issue_gather(async_op=False, released=released, post_forward=post_forward)
        pending, self._pending_gather, self._pending_into = self._pending_gather or [], None, None
        gathered_post_forward, self._pending_post_forward = self._pending_post_forward, None
        finished = []
        for leg, handle, into in pending:
            gathered = handle.wait()
            pieces, whole = gathered.pieces, gathered.flat
            if gathered_post_forward is not None:
                pieces, whole = gathered_post_forward.shard_rank_pieces(leg, pieces), None
            finished.append((leg, pieces, whole, into))
        return finished
