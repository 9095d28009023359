"""The [dp, sp] grid: pure arithmetic."""

import pytest

from lightning_ulysses.topology import SequenceParallelTopology, auto_ring_size


def test_ranks_on_the_grid() -> None:
    grid = [SequenceParallelTopology(world_size=8, sp_size=4, rank=r) for r in range(8)]
    assert [(t.dp_rank, t.sp_rank) for t in grid] == [(d, s) for d in range(2) for s in range(4)]
    assert all(t.dp_size == 2 for t in grid)
    assert grid[0].sp_group_ranks == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid[0].dp_group_ranks == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for t in grid:  # each rank sits in exactly one SP group and one DP group, at its own coordinates
        assert t.sp_group_ranks[t.dp_rank][t.sp_rank] == t.rank
        assert t.dp_group_ranks[t.sp_rank][t.dp_rank] == t.rank


def test_sp_groups_stay_inside_nodes() -> None:
    assert not SequenceParallelTopology(16, 8, 0).sp_groups_span_nodes(num_nodes=2)
    assert not SequenceParallelTopology(16, 4, 0).sp_groups_span_nodes(num_nodes=2)
    assert SequenceParallelTopology(16, 16, 0).sp_groups_span_nodes(num_nodes=2)
    assert SequenceParallelTopology(12, 4, 0).sp_groups_span_nodes(num_nodes=2)  # 6 per node: [4..7] spans


def test_world_size_not_divisible_lists_valid_sizes() -> None:
    with pytest.raises(
        ValueError, match=r"world size \(6 processes.*sp_size=4.*Valid sp_size values .*: \[1, 2, 3, 6\]"
    ):
        SequenceParallelTopology(world_size=6, sp_size=4, rank=0)
    with pytest.raises(ValueError, match="positive"):
        SequenceParallelTopology(world_size=4, sp_size=0, rank=0)


def test_ulysses_x_ring_grid() -> None:
    """dp x ring x ulysses = world: Ulysses groups of consecutive ranks, the ring across them, inside each SP group."""
    grid = [SequenceParallelTopology(world_size=16, sp_size=8, rank=r, ring_size=2) for r in range(16)]
    assert grid[0].ulysses_group_ranks == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert grid[0].ring_group_ranks == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    for t in grid:
        assert t.sp_rank == t.ring_rank * t.ulysses_size + t.ulysses_rank
        assert (
            t.rank in t.ulysses_group_ranks[t.rank // 4]
            and t.ulysses_group_ranks[t.rank // 4][t.ulysses_rank] == t.rank
        )
        ring = next(r for r in t.ring_group_ranks if t.rank in r)
        assert ring[t.ring_rank] == t.rank and set(ring) <= set(t.sp_group_ranks[t.dp_rank])
    # a ring across nodes keeps the all-to-alls inside them: sp=16 on 2 nodes of 8
    assert SequenceParallelTopology(16, 16, 0, ring_size=2).sp_groups_span_nodes(num_nodes=2) is False
    assert SequenceParallelTopology(16, 16, 0).sp_groups_span_nodes(num_nodes=2)


def test_auto_ring_size() -> None:
    assert auto_ring_size(sp_size=16, processes_per_node=8) == 2
    assert auto_ring_size(sp_size=32, processes_per_node=8) == 4
    assert auto_ring_size(sp_size=4, processes_per_node=8) == 1
    assert auto_ring_size(sp_size=12, processes_per_node=8) == 3  # Ulysses 4 divides the node


def test_impossible_ring_layouts_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"ring_size=3 does not divide sp_size=4.*Valid ring_size values .*\[1, 2, 4\]"
    ):
        SequenceParallelTopology(world_size=8, sp_size=4, rank=0, ring_size=3)
    with pytest.raises(ValueError, match="ring_size must be a positive integer"):
        SequenceParallelTopology(world_size=8, sp_size=4, rank=0, ring_size=0)
