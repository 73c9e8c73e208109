"""What a unit keeps after forward with ``reshard_after_forward=k`` (an int between 1 and
the shard group size): its post-forward shards.

[Note: post-forward shards]
With ``reshard_after_forward=k`` the shard group of ``n`` ranks is cut into contiguous
blocks of ``k`` ranks (``MeshInfo.post_forward_group``), as FSDP2 does. After forward a
unit frees its full parameters but keeps, per sharded leg, one ``k``-th of the leg's
all-gather output: the member with group rank ``j`` of a block keeps the pieces of shard
ranks ``j*m`` to ``j*m + m - 1`` (``m = n / k``), each laid out as that rank lays out its
all-gather piece (its gather order and padding). Gathering these over the block, in
group order, rebuilds the leg's whole all-gather output, from which the released full
parameters are refilled as after any all-gather: the re-gather before backward crosses
only the ``k`` ranks of the block, for ``n / k`` times the memory of a shard. Gradients
are still reduce-scattered over the whole shard group.

Only where the platform can release memory autograd holds (``can_release_storage``):
elsewhere the full parameters would stay until backward (as with True) and nothing is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hyper_parallel.fully_shard.mesh import MeshInfo
    from hyper_parallel.fully_shard.param_group import FSDPParamGroup, Leg


def post_forward_size(value, mesh_info: MeshInfo) -> int | None:
    """The size of the group a parameter group on ``mesh_info`` reshards to after forward
    with the resolved ``reshard_after_forward=value``, or None where that is its whole
    shard group (True) or no group (False)."""
    if isinstance(value, bool) or not isinstance(value, int) or value >= mesh_info.shard_size:
        return None
    return value


class PostForwardShards:
    """One unit's post-forward shards (one flat tensor per sharded leg), cut from its full
    parameters, and their all-gather over the post-forward group."""

    def __init__(self, group: FSDPParamGroup, fulls: list, size: int):
        coded = [fp.fqn for leg in group.sharded_legs if leg.codec for fp in leg.params]
        if coded:
            raise NotImplementedError(
                f"reshard_after_forward={size} keeps part of the full parameters, which a "
                f"gather codec's parameters ({', '.join(coded)}) do not have in gathered form "
                f"(as FSDP2's all-gather extensions); use reshard_after_forward=True or False")
        p = self.platform = group.platform
        info = group.mesh_info
        self.size = size
        self.group = info.post_forward_group(size)
        self.ranks_per_member = info.shard_size // size
        first = p.group_rank(self.group) * self.ranks_per_member
        mine = range(first, first + self.ranks_per_member)
        full_of = {id(fp): full for fp, full in zip(group.params, fulls)}
        self.shards = []
        with p.no_grad():
            for leg in group.sharded_legs:
                # the same cut as a gradient's for the reduce-scatter: rank r's padded rows
                cut = {id(fp): fp.gradient_pieces(full_of[id(fp)], group.compute_dtype(fp))
                       for fp in leg.params}
                self.shards.append(p.cat([part for rank in mine for fp in leg.gather_orders[rank]
                                          for part in cut[id(fp)][rank]], 0))

    def issue_gather(self, leg_index: int, async_op: bool) -> tuple:
        """The all-gather of leg ``leg_index``'s post-forward shards over the post-forward
        group (its result's pieces: one per member)."""
        return self.platform.all_gather(self.shards[leg_index], self.group, async_op=async_op,
                                        dim="post_forward")

    def shard_rank_pieces(self, leg: Leg, member_pieces: list) -> list:
        """The gathered members' pieces cut into the pieces of every shard rank, as a
        shard-group all-gather of ``leg`` delivers them."""
        numel = leg.total_numel
        return [self.platform.narrow(piece, 0, i * numel, numel)
                for piece in member_pieces for i in range(self.ranks_per_member)]
