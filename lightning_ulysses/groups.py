"""The process groups of one rank's place on the grid, in one object: :class:`SequenceParallelGroups`.

``UlyssesStrategy`` builds it once at set-up (:meth:`SequenceParallelGroups.create`) from its
:class:`~lightning_ulysses.topology.SequenceParallelTopology` and hands it to everything that needs more than one
process group: the attention (Ulysses inside ``ulysses``, ring attention across ``ring``), the sequence gather (the
zigzag order of a ring undone), the patched models. What it holds besides the groups is per rank and mutable, and it
is the groups' own, never a module's:

* ``cache``: the per-batch cache of gathered position ids and their documents
  (:func:`~lightning_ulysses.attention.documents.documents_of`);
* ``observer``: what the all-to-alls report to while a measurement is on
  (``SequenceParallelMonitor(time_all_to_all=True)`` sets it and clears it when the fit ends).

Functions that take an SP ``group`` accept a plain ``ProcessGroup`` (plain Ulysses over it, nothing cached, nothing
observed), ``None`` (no sequence parallelism) or this object (:data:`SequenceParallelGroup`); the helpers below read
either alike. A patched transformers model holds groups whatever it was given (:meth:`SequenceParallelGroups.of` a
plain process group), so its layers always find the batch's documents in a cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar, Union

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_ulysses.topology import SequenceParallelTopology

ValueT = TypeVar("ValueT")

AllToAllObserver = Callable[[Callable[[], Tensor]], Tensor]
"""``observer(run) -> run()``: wraps one all-to-all (``run`` performs it and returns its output)."""


class CollectiveObserver:
    """What the all-to-alls of an SP group report to (:func:`~lightning_ulysses.attention.collectives.all_to_all`):
    ``all_to_all`` wraps every call while it is set, ``None`` (the default) observes nothing."""

    def __init__(self) -> None:
        self.all_to_all: AllToAllObserver | None = None


class ShardCache:
    """One value derived from one shard tensor, kept while the same tensor object comes back at the same version:
    every attention layer of a forward (and its recomputation under activation checkpointing) receives the same
    ``position_ids`` tensor, so what is derived from it (an all-gather, a host sync) runs once per batch. Only the
    latest tensor is kept, and only weakly."""

    def __init__(self) -> None:
        self._entry: tuple[weakref.ref[Tensor], int, Any] | None = None

    def get(self, tensor: Tensor, compute: Callable[[], ValueT]) -> ValueT:
        """The value kept for ``tensor``, else ``compute()``, then kept."""
        if self._entry is not None:
            ref, version, value = self._entry
            if ref() is tensor and version == _version(tensor):
                return value
        value = compute()
        self._entry = (weakref.ref(tensor), _version(tensor), value)
        return value


def _version(tensor: Tensor) -> int:
    """The in-place edit counter of ``tensor``; an inference tensor (evaluation under ``torch.inference_mode``) has
    none, and is edited by no layer of the forward that reads it."""
    return -1 if tensor.is_inference() else tensor._version


@dataclass(frozen=True)
class SequenceParallelGroups:
    """This rank's process groups on the ``[dp, ring, ulysses]`` grid of ``topology``.

    ``sp``: the ranks that share this rank's sequences (``None``: no sequence parallelism, a topology of one rank);
    ``dp``: the ranks with the same shard position in every SP group (``None`` where none was made: one SP group taken
    alone); ``ulysses``: the ranks of the all-to-alls (the SP group itself without a ring); ``ring``: the ranks that
    pass K/V blocks under Ulysses x Ring, ``None`` for plain Ulysses. Invariant: ``ring is None`` exactly when
    ``topology.ring_size == 1``.
    """

    topology: SequenceParallelTopology
    sp: ProcessGroup | None
    dp: ProcessGroup | None
    ulysses: ProcessGroup | None
    ring: ProcessGroup | None = None
    cache: ShardCache = field(default_factory=ShardCache, compare=False, repr=False)
    observer: CollectiveObserver = field(default_factory=CollectiveObserver, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.ring is None) != (self.topology.ring_size == 1):
            raise ValueError(
                f"A ring group is given exactly when ring_size > 1; ring_size={self.topology.ring_size}, ring group "
                f"{'absent' if self.ring is None else 'given'}."
            )

    @property
    def ring_size(self) -> int:
        """Ring degree of Ulysses x Ring (1: plain Ulysses)."""
        return self.topology.ring_size

    @classmethod
    def create(cls, topology: SequenceParallelTopology, timeout: timedelta | None = None) -> SequenceParallelGroups:
        """Every SP and DP group of ``topology`` (and its Ulysses and ring groups with ``ring_size > 1``), this rank's
        kept. Collective over the world: every rank calls it with the same layout. ``timeout``: the groups' own
        (subgroups do not inherit the default group's; ``None``: torch's default)."""
        sp, _ = dist.new_subgroups_by_enumeration(topology.sp_group_ranks, timeout=timeout)
        dp, _ = dist.new_subgroups_by_enumeration(topology.dp_group_ranks, timeout=timeout)
        if topology.ring_size == 1:
            return cls(topology, sp, dp, sp)
        ulysses, _ = dist.new_subgroups_by_enumeration(topology.ulysses_group_ranks, timeout=timeout)
        ring, _ = dist.new_subgroups_by_enumeration(topology.ring_group_ranks, timeout=timeout)
        return cls(topology, sp, dp, ulysses, ring)

    @classmethod
    def of(cls, group: ProcessGroup | None) -> SequenceParallelGroups:
        """Plain Ulysses over ``group`` taken alone (its ranks a world of one SP group; ``None``: one local rank)."""
        if group is None:
            return cls(SequenceParallelTopology(1, 1, 0), None, None, None)
        size = dist.get_world_size(group)
        return cls(SequenceParallelTopology(size, size, dist.get_rank(group)), group, None, group)


# a runtime alias kept as typing.Union (``X | Y`` would make another object, a types.UnionType)
SequenceParallelGroup = Union[ProcessGroup, SequenceParallelGroups, None]  # noqa: UP007
"""What a function that takes the SP ``group`` accepts (see the module docstring)."""


def as_groups(group: SequenceParallelGroup) -> SequenceParallelGroups:
    """``group`` itself, or :meth:`SequenceParallelGroups.of` a plain process group (or ``None``)."""
    return group if isinstance(group, SequenceParallelGroups) else SequenceParallelGroups.of(group)


def process_group(group: SequenceParallelGroup) -> ProcessGroup | None:
    """The SP process group of ``group`` (``None``: none)."""
    return group.sp if isinstance(group, SequenceParallelGroups) else group


def ring_groups(group: SequenceParallelGroup) -> SequenceParallelGroups | None:
    """``group`` when it runs Ulysses x Ring (``ring_size > 1``); ``None`` for plain Ulysses (a process group,
    ``None``, or groups without a ring)."""
    return group if isinstance(group, SequenceParallelGroups) and group.ring is not None else None


def ring_size_of(group: SequenceParallelGroup) -> int:
    """The ring degree ``group``'s shards are laid out for (1: plain Ulysses, contiguous shards)."""
    return group.ring_size if isinstance(group, SequenceParallelGroups) else 1


def observer_of(group: SequenceParallelGroup) -> CollectiveObserver | None:
    """What ``group``'s all-to-alls report to (``None`` for a plain process group)."""
    return group.observer if isinstance(group, SequenceParallelGroups) else None


def cache_of(group: SequenceParallelGroup) -> ShardCache | None:
    """``group``'s per-batch cache (``None`` for a plain process group or ``None``: nothing is kept)."""
    return group.cache if isinstance(group, SequenceParallelGroups) else None
