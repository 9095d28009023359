"""The [dp, sp] grid: pure arithmetic."""

import pytest

from lightning_ulysses import SequenceParallelTopology


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
    with pytest.raises(ValueError, match=r"world size \(6 processes.*sp_size=4.*Valid sp_size values .*: \[1, 2, 3, 6\]"):
        SequenceParallelTopology(world_size=6, sp_size=4, rank=0)
    with pytest.raises(ValueError, match="positive"):
        SequenceParallelTopology(world_size=4, sp_size=0, rank=0)
