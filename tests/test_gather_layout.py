"""The all-gather layout of a leg (layout.py, note "gather layout"): which parameter is
read in place, and where every parameter sits in each rank's piece.

Pure arithmetic over the parameters' padded sizes, so the parameters here are stand-ins
with only those sizes; the parity tests run the layout through real collectives on both
backends (their models' fused legs are a weight and its bias: junctions)."""

from types import SimpleNamespace

import pytest

from hyper_parallel.fully_shard.layout import JUNCTION_MAX_REST, Leg


def _leg(sizes: list[int], shard_size: int, junctions: bool = True) -> Leg:
    params = [SimpleNamespace(padded_numel=n, shard_size=shard_size) for n in sizes]
    return Leg(params, bucket=None, sharded=True, junctions=junctions)


def _check_tiling(leg: Leg) -> None:
    """Every rank's piece holds each parameter once, without overlap or gap."""
    for offsets in leg.gather_offsets:
        spans = sorted(zip(offsets, (fp.padded_numel for fp in leg.params)))
        ends = [start + n for start, n in spans]
        assert [start for start, _ in spans] == [0] + ends[:-1]
        assert ends[-1] == leg.total_numel


@pytest.mark.parametrize("sizes", [[96, 8], [8, 96], [8, 96, 4], [50]])
def test_two_ranks_largest_parameter_abuts(sizes):
    leg = _leg(sizes, shard_size=2)
    _check_tiling(leg)
    largest = max(leg.params, key=lambda fp: fp.padded_numel)
    assert leg.in_place is largest
    first, second = leg.gather_offsets_of(largest)
    # rank 0's piece ends with it and rank 1's starts with it: one contiguous stretch
    assert first + largest.padded_numel == leg.total_numel and second == 0
    # every other parameter keeps its place relative to the others on rank 0
    others = [fp for fp in leg.params if fp is not largest]
    assert sorted(others, key=lambda fp: leg.gather_offsets_of(fp)[0]) == others
    # the reduce-scatter's layout stays in the params order
    assert leg.offsets == [sum(sizes[:i]) for i in range(len(sizes))]


def test_no_junction_where_it_would_hold_much_more_memory():
    # the rest of the leg is more than 1/JUNCTION_MAX_REST of the largest parameter
    leg = _leg([64, 64 // JUNCTION_MAX_REST + 1], shard_size=2)
    assert leg.in_place is None
    _check_tiling(leg)
    assert leg.gather_offsets[0] == leg.gather_offsets[1] == leg.offsets
    assert _leg([64, 64 // JUNCTION_MAX_REST], shard_size=2).in_place is not None


@pytest.mark.parametrize("shard_size", [3, 4])
def test_more_ranks_only_a_lone_parameter_is_read_in_place(shard_size):
    assert _leg([40], shard_size).in_place is not None
    leg = _leg([96, 8], shard_size)
    assert leg.in_place is None
    assert all(offsets == leg.offsets for offsets in leg.gather_offsets)


@pytest.mark.parametrize("shard_size", [2, 4])
def test_without_junctions_every_rank_keeps_the_params_order(shard_size):
    for sizes in ([96, 8], [50]):
        leg = _leg(sizes, shard_size, junctions=False)
        assert leg.in_place is None
        assert all(offsets == leg.offsets for offsets in leg.gather_offsets)
