"""The 2-D process grid: ``world = dp x sp``.

Ranks are laid out row-major on a ``[dp, sp]`` grid, so every sequence-parallel (SP) group is a
block of ``sp_size`` consecutive ranks. Launchers number ranks node by node, so an SP group stays
inside a node (on NVLink) whenever ``sp_size`` divides the number of processes per node; the
data-parallel (DP) group joins the ranks that hold the same shard position in every block::

    world_size=8, sp_size=4        sp_rank ->   0  1  2  3
                                   dp_rank 0:  [0, 1, 2, 3]   <- one SP group (one sequence)
                                   dp_rank 1:  [4, 5, 6, 7]
                                                ^ a DP group: ranks 0 and 4

Everything here is pure arithmetic, testable without processes.
"""

from __future__ import annotations

from dataclasses import dataclass


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class SequenceParallelTopology:
    """Where one rank sits on the ``[dp, sp]`` grid.

    Invariants: ``world_size == dp_size * sp_size`` and ``rank == dp_rank * sp_size + sp_rank``.
    """

    world_size: int
    sp_size: int
    rank: int

    def __post_init__(self) -> None:
        if self.sp_size < 1:
            raise ValueError(f"sp_size must be a positive integer, got {self.sp_size}.")
        if self.world_size % self.sp_size != 0:
            raise ValueError(
                f"The world size ({self.world_size} processes = devices x num_nodes) is not divisible by "
                f"sp_size={self.sp_size}. Valid sp_size values for this world size: {divisors(self.world_size)}; "
                f"or change devices/num_nodes so that the world size is a multiple of {self.sp_size}."
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of {self.world_size} processes.")

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size

    @property
    def sp_group_ranks(self) -> list[list[int]]:
        """Every SP group (one per DP rank), each a block of consecutive ranks."""
        return [list(range(d * self.sp_size, (d + 1) * self.sp_size)) for d in range(self.dp_size)]

    @property
    def dp_group_ranks(self) -> list[list[int]]:
        """Every DP group (one per SP rank): the same shard position across the SP groups."""
        return [list(range(s, self.world_size, self.sp_size)) for s in range(self.sp_size)]

    def sp_groups_span_nodes(self, num_nodes: int) -> bool:
        """Whether some SP group would hold ranks of two nodes (its all-to-alls then cross the network)."""
        if num_nodes <= 1:
            return False
        per_node = self.world_size // num_nodes
        return any(ranks[0] // per_node != ranks[-1] // per_node for ranks in self.sp_group_ranks)
