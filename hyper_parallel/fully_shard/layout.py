"""How a unit's parameters are laid out for their collectives: the one place the layout
optimisations live, behind one strategy object.

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
- The codec leg: parameters with a gather codec (gather_codec.py) are all-gathered
  together as their codecs' bytes (codec_leg.py) and decoded; their gradients are laid out
  and reduced as the fused leg's.
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

[Note: views]
Where the platform's kernels copy a view before reading it (``Capabilities.
kernels_read_views`` False: MindSpore, whose autograd then keeps that copy until backward,
beside the gather output the view keeps alive), nothing is read in place: every full
parameter is copied out of the gather output into memory of its own, which is what autograd
then keeps and what resharding releases.

[Note: the strategy]
``LayoutStrategy`` makes a unit's legs. ``LayoutStrategy(None, junctions=False)`` is
FSDP2's layout: one fused leg in ``params`` order, every full parameter copied out of the
gather output (only a one-rank shard group's, a private copy already, is read in place).
``fully_shard`` uses ``LayoutStrategy(own_collective_bytes)``, which adds the two
optimisations that measured a gain larger than the spread of alternated rounds on some
configuration (benchmarks/README.md, "Layout optimisations"): own legs for large
parameters (``own_collective_bytes``; less memory on torch CPU) and the junction (faster
where parameters share a leg over two ranks). FSDPParamGroup reads only the legs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from hyper_parallel.fully_shard.gradients import ReplicateBucket

if TYPE_CHECKING:
    from hyper_parallel.fully_shard.mesh import MeshInfo
    from hyper_parallel.fully_shard.param import FSDPParam
    from hyper_parallel.platform import Platform

# A in_place read in place keeps the whole gather buffer alive with it (the rest of the leg
# is copied out of it as well): allowed where the rest is at most 1/JUNCTION_MAX_REST of it,
# so the unit holds at most that much more than with copies (see the note "gather layout").
JUNCTION_MAX_REST = 8


class Leg:
    """Parameters that share a collective and a flat gradient buffer, with their offsets."""

    def __init__(self, params: list, bucket: ReplicateBucket, sharded: bool, junctions: bool,
                 reads_views: bool = True, codec: bool = False):
        self.params = params
        self.bucket = bucket
        self.sharded = sharded  # gathered and reduce-scattered over the shard group
        self.codec = codec  # gathered as their gather codecs' bytes (codec_leg.py)
        self.offsets = []  # in the reduce-scatter's and the bucket's flat buffers
        total = 0
        for fsdp_param in params:
            self.offsets.append(total)
            total += fsdp_param.padded_numel
        self.total_numel = total
        size = params[0].shard_size if sharded else 1
        # see the notes "gather layout" and "views"; one rank: the params order, each read
        # in place
        self.in_place: FSDPParam | None = None
        self._all_in_place = reads_views and size == 1
        order = list(params)
        largest = max(params, key=lambda fp: fp.padded_numel)
        if reads_views and junctions and (size == 2 or (size > 2 and len(params) == 1)) and \
                (total - largest.padded_numel) * JUNCTION_MAX_REST <= largest.padded_numel:
            self.in_place = largest
            order = [fp for fp in params if fp is not largest] + [largest]
        self.gather_orders = [order[::-1] if rank % 2 and self.in_place is not None else order
                              for rank in range(size)]
        self.gather_offsets = [_offsets_in(order, params) for order in self.gather_orders]
        self._gather_offsets_by_param = {
            id(fp): [offsets[i] for offsets in self.gather_offsets] for i, fp in enumerate(params)}

    def read_in_place(self, fsdp_param: FSDPParam) -> bool:
        """Whether ``fsdp_param``'s full tensor is read from the gather output as a view
        (``full_from_whole``) rather than copied out of it (``full_from_pieces``)."""
        return self._all_in_place or fsdp_param is self.in_place

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


@dataclass(frozen=True)
class LayoutStrategy:
    """Which parameters share a collective, and whether a leg reads one in place."""

    #: a sharded parameter whose all-gather piece (in its compute dtype) has at least this
    #: many bytes travels alone (None: every sharded parameter in one fused leg)
    own_collective_bytes: int | None = None
    #: lay out a two-rank leg so that its largest parameter is read in place (the junction)
    junctions: bool = True

    def legs(self, platform: Platform, params: list, mesh_info: MeshInfo,
             compute_dtype: Callable[[FSDPParam], Any]) -> list:
        """The unit's legs: the fused one, one per parameter alone, the codec leg, the small
        one."""
        info, limit = mesh_info, self.own_collective_bytes
        views = platform.capabilities.kernels_read_views

        def bucket():
            return ReplicateBucket(platform, info.replicate_group, info.replicate_size, "replicate")

        coded = [fp for fp in params if fp.gather_codec is not None]
        sharded = [fp for fp in params if fp.is_sharded and fp.gather_codec is None]
        alone = [fp for fp in sharded if limit is not None and
                 fp.padded_numel * platform.element_size(compute_dtype(fp)) >= limit]
        fused = [fp for fp in sharded if all(fp is not a for a in alone)]
        legs = [Leg(fused, bucket(), True, self.junctions, views)] if fused else []
        legs += [Leg([fp], bucket(), True, self.junctions, views) for fp in alone]
        if coded:
            legs.append(Leg(coded, bucket(), True, False, views, codec=True))
        small = [fp for fp in params if not fp.is_sharded]
        if small:
            legs.append(Leg(small, ReplicateBucket(platform, info.data_parallel_group,
                                                   info.data_parallel_size, "data_parallel"),
                            False, self.junctions, views))
        return legs
