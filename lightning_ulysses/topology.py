"""The 2-D process grid: ``world = dp x sp``.

Ranks are laid out row-major on a ``[dp, sp]`` grid, so every sequence-parallel (SP) group is a
block of ``sp_size`` consecutive ranks. Launchers number ranks node by node, so an SP group stays
inside a node (on NVLink) whenever ``sp_size`` divides the number of processes per node; the
data-parallel (DP) group joins the ranks that hold the same shard position in every block::

    world_size=8, sp_size=4        sp_rank ->   0  1  2  3
                                   dp_rank 0:  [0, 1, 2, 3]   <- one SP group (one sequence)
                                   dp_rank 1:  [4, 5, 6, 7]
                                                ^ a DP group: ranks 0 and 4

Ulysses x Ring (``ring_size > 1``): each SP group is itself a ``[ring, ulysses]`` grid, with
``ulysses_size = sp_size / ring_size`` consecutive ranks per Ulysses group (inside a node: the
all-to-alls run on NVLink) and the ring joining the ranks with the same Ulysses rank (K/V blocks travel
between nodes point to point)::

    sp_size=4, ring_size=2      ulysses_rank ->  0  1
                                ring_rank 0:    [0, 1]   <- a Ulysses group (all-to-alls)
                                ring_rank 1:    [2, 3]
                                                 ^ a ring group: ranks 0 and 2

so ``world = dp x ring x ulysses`` and ``sp_rank = ring_rank * ulysses_size + ulysses_rank``.

Everything here is pure arithmetic, testable without processes.
"""

from __future__ import annotations

from dataclasses import dataclass


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_ring_size(ring_size: object, sp_size: int | None, *, auto: bool = False) -> None:
    """The one check of a ring degree: a positive integer (or ``"auto"`` where ``auto``) that divides ``sp_size``
    (``None``: not known yet); raises ``ValueError`` naming the valid values."""
    if auto and ring_size == "auto":
        return
    if isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 1:
        accepted = "a positive integer or 'auto'" if auto else "a positive integer"
        raise ValueError(f"ring_size must be {accepted}, got {ring_size!r}.")
    if sp_size is not None and sp_size % ring_size:
        raise ValueError(
            f"ring_size={ring_size} does not divide sp_size={sp_size}: every SP group is split into ring_size Ulysses "
            f"groups of sp_size / ring_size ranks. Valid ring_size values for sp_size={sp_size}: {divisors(sp_size)}."
        )


@dataclass(frozen=True)
class SequenceParallelTopology:
    """Where one rank sits on the ``[dp, ring, ulysses]`` grid (``sp = ring x ulysses``).

    Invariants: ``world_size == dp_size * sp_size``, ``rank == dp_rank * sp_size + sp_rank`` and
    ``sp_rank == ring_rank * ulysses_size + ulysses_rank``.
    """

    world_size: int
    sp_size: int
    rank: int
    ring_size: int = 1

    def __post_init__(self) -> None:
        if self.sp_size < 1:
            raise ValueError(f"sp_size must be a positive integer, got {self.sp_size}.")
        if self.world_size % self.sp_size != 0:
            raise ValueError(
                f"The world size ({self.world_size} processes = devices x num_nodes) is not divisible by "
                f"sp_size={self.sp_size}. Valid sp_size values for this world size: {divisors(self.world_size)}; "
                f"or change devices/num_nodes so that the world size is a multiple of {self.sp_size}."
            )
        check_ring_size(self.ring_size, self.sp_size)
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
    def ulysses_size(self) -> int:
        return self.sp_size // self.ring_size

    @property
    def ring_rank(self) -> int:
        return self.sp_rank // self.ulysses_size

    @property
    def ulysses_rank(self) -> int:
        return self.sp_rank % self.ulysses_size

    @property
    def ulysses_group_ranks(self) -> list[list[int]]:
        """Every Ulysses group: blocks of ``ulysses_size`` consecutive ranks (the whole SP group without a ring)."""
        u = self.ulysses_size
        return [list(range(g * u, (g + 1) * u)) for g in range(self.world_size // u)]

    @property
    def ring_group_ranks(self) -> list[list[int]]:
        """Every ring group: inside each SP group, the ranks with the same Ulysses rank, in ring order."""
        u, sp = self.ulysses_size, self.sp_size
        return [list(range(d * sp + i, (d + 1) * sp, u)) for d in range(self.dp_size) for i in range(u)]

    @property
    def sp_group_ranks(self) -> list[list[int]]:
        """Every SP group (one per DP rank), each a block of consecutive ranks."""
        return [list(range(d * self.sp_size, (d + 1) * self.sp_size)) for d in range(self.dp_size)]

    @property
    def dp_group_ranks(self) -> list[list[int]]:
        """Every DP group (one per SP rank): the same shard position across the SP groups."""
        return [list(range(s, self.world_size, self.sp_size)) for s in range(self.sp_size)]

    def sp_groups_span_nodes(self, num_nodes: int) -> bool:
        """Whether some all-to-all group (the Ulysses groups: the SP groups without a ring) would hold ranks of two
        nodes (its all-to-alls then cross the network)."""
        if num_nodes <= 1:
            return False
        per_node = self.world_size // num_nodes
        return any(ranks[0] // per_node != ranks[-1] // per_node for ranks in self.ulysses_group_ranks)


def auto_ring_size(sp_size: int, processes_per_node: int) -> int:
    """``ring_size="auto"``: the Ulysses degree is the largest divisor of ``sp_size`` that fits in one node, and the
    ring joins the nodes (1 when an SP group fits in a node)."""
    ulysses = max(d for d in divisors(sp_size) if processes_per_node % d == 0)
    return sp_size // ulysses
