"""The process grid as one torch ``DeviceMesh``, and this rank's view of it: :class:`SequenceParallelGroups`.

:func:`build_mesh` lays a :class:`~lightning_ulysses.topology.SequenceParallelTopology` out as a ``DeviceMesh`` with
the named axes ``dp``, ``ring`` and ``ulysses`` (row-major, so its ranks are exactly the topology's groups) and
``sp``, the ``ring`` x ``ulysses`` axes flattened (every rank of one sequence). ``UlyssesStrategy`` builds it once at
set-up (:attr:`~lightning_ulysses.UlyssesStrategy.device_mesh`); an engine that shards parameters over the data
parallel ranks takes ``mesh["dp"]`` from it (FSDP2's ``fully_shard(module, mesh=mesh["dp"])``).

:class:`SequenceParallelGroups` is the thin view of a mesh that everything needing more than one process group takes:
the attention (Ulysses inside ``ulysses``, ring attention across ``ring``), the sequence gather (the zigzag order of a
ring undone), the patched models. Besides the mesh it holds what is per rank and mutable, the view's own, never a
module's:

* ``cache``: the per-batch cache of gathered position ids and their documents
  (:func:`~lightning_ulysses.attention.documents.documents_of`);
* ``observer``: what the all-to-alls report to while a measurement is on
  (``SequenceParallelMonitor(time_all_to_all=True)`` sets it and clears it when the fit ends).

The public entry points (:func:`~lightning_ulysses.hf.apply_ulysses_attention`, :func:`~lightning_ulysses.
ulysses_attention`, :func:`~lightning_ulysses.prediction.gather_sequence`) also take a ``DeviceMesh`` (one built by
:func:`build_mesh`, or a 1-D mesh: plain Ulysses over its ranks) or ``None`` (no sequence parallelism), and make the
view of it with :meth:`SequenceParallelGroups.of`; every other function takes the view.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import Any, TypeVar, Union

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_ulysses.engines.fsdp2 import backend_options_with_timeout, flatten_mesh
from lightning_ulysses.topology import SequenceParallelTopology

MESH_AXES = ("dp", "ring", "ulysses")
"""The axes of :func:`build_mesh`'s mesh, outermost first (``rank = (dp * ring_size + ring) * ulysses_size +
ulysses``); ``sp`` is ``ring`` x ``ulysses`` flattened."""

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


def build_mesh(topology: SequenceParallelTopology, device_type: str, timeout: timedelta | None = None) -> DeviceMesh:
    """The process grid of ``topology`` as a ``DeviceMesh`` over ``device_type`` (``"cuda"``, or ``"cpu"`` over gloo)
    with the axes :data:`MESH_AXES` of sizes ``(dp_size, ring_size, ulysses_size)`` and ``sp`` (``ring`` x ``ulysses``
    flattened): ``mesh["dp"]``, ``mesh["ring"]`` and ``mesh["ulysses"]`` hold this rank's groups of
    ``topology.dp_group_ranks``, ``ring_group_ranks`` and ``ulysses_group_ranks``, and ``mesh.get_group("sp")`` its
    group of ``sp_group_ranks``.

    Collective over the world: every rank calls it with the same layout, once the default process group exists (its
    world is ``topology.world_size``). ``timeout``: the groups' own (subgroups do not inherit the default group's;
    ``None``: torch's default).
    """
    if dist.get_world_size() != topology.world_size:
        raise ValueError(f"The topology is of {topology.world_size} ranks, the world of {dist.get_world_size()}.")
    options = None if timeout is None else backend_options_with_timeout(timeout)
    mesh = init_device_mesh(
        device_type,
        (topology.dp_size, topology.ring_size, topology.ulysses_size),
        mesh_dim_names=MESH_AXES,
        backend_override=None if options is None else dict.fromkeys(MESH_AXES, options),
    )
    flatten_mesh(mesh["ring", "ulysses"], "sp", backend_override=options)
    return mesh


@dataclass(frozen=True)
class SequenceParallelGroups:
    """This rank's view of the process grid: the process groups of ``mesh`` on the ``[dp, ring, ulysses]`` grid of
    ``topology``.

    ``mesh``: one built by :func:`build_mesh` for ``topology``, a 1-D mesh (plain Ulysses over its ranks: a world of
    one SP group, ``topology`` its own), or ``None`` (one local rank, no sequence parallelism). The groups:
    ``sp``, the ranks that share this rank's sequences (``None`` without a mesh); ``dp``, the ranks with the same shard
    position in every SP group (``None`` where the mesh has no ``dp`` axis); ``ulysses``, the ranks of the all-to-alls
    (the SP group itself without a ring); ``ring``, the ranks that pass K/V blocks under Ulysses x Ring, ``None`` for
    plain Ulysses (exactly when ``topology.ring_size == 1``).
    """

    topology: SequenceParallelTopology
    mesh: DeviceMesh | None
    cache: ShardCache = field(default_factory=ShardCache, compare=False, repr=False)
    observer: CollectiveObserver = field(default_factory=CollectiveObserver, compare=False, repr=False)

    def __post_init__(self) -> None:
        t, mesh = self.topology, self.mesh
        if mesh is None:
            fits = t.world_size == 1
        elif mesh.ndim == 1:
            fits = t.dp_size == 1 and t.ring_size == 1 and mesh.size() == t.sp_size
        else:
            fits = mesh.mesh_dim_names == MESH_AXES and mesh.shape == (t.dp_size, t.ring_size, t.ulysses_size)
        if not fits:
            raise ValueError(f"{mesh} is not the process grid of {t} (see build_mesh).")

    @classmethod
    def create(
        cls, topology: SequenceParallelTopology, device_type: str, timeout: timedelta | None = None
    ) -> SequenceParallelGroups:
        """The view of :func:`build_mesh` ``(topology, device_type, timeout)`` (collective over the world)."""
        return cls(topology, build_mesh(topology, device_type, timeout))

    @classmethod
    def of(cls, group: SequenceParallelGroups | DeviceMesh | ProcessGroup | None) -> SequenceParallelGroups:
        """The view of what a public entry point was given: the view itself, a mesh of :func:`build_mesh`, a 1-D mesh
        (plain Ulysses over its ranks), or ``None`` (one local rank). A plain ``ProcessGroup`` is deprecated: it runs as
        the 1-D mesh of its ranks."""
        if isinstance(group, SequenceParallelGroups):
            return group
        if isinstance(group, ProcessGroup):
            warnings.warn(
                "Passing a ProcessGroup as the sequence-parallel group is deprecated: pass the strategy's "
                "`strategy.groups`, its `strategy.device_mesh`, or a DeviceMesh (DeviceMesh.from_group(group, "
                "device_type)).",
                DeprecationWarning,
                stacklevel=3,
            )
            device = "cuda" if "nccl" in dist.get_backend(group) else "cpu"
            group = DeviceMesh.from_group(group, device, mesh_dim_names=("sp",))
        if group is None:
            return cls(SequenceParallelTopology(1, 1, 0), None)
        if group.ndim == 1:
            size = group.size()
            return cls(SequenceParallelTopology(size, size, group.get_local_rank()), group)
        if group.mesh_dim_names != MESH_AXES:
            raise ValueError(
                f"A sequence-parallel mesh has the axes {MESH_AXES} or one axis, not {group.mesh_dim_names}."
            )
        dp, ring, ulysses = group.shape
        coordinate = group.get_coordinate()
        if coordinate is None:
            raise ValueError("This rank is not in the mesh.")
        rank = (coordinate[0] * ring + coordinate[1]) * ulysses + coordinate[2]
        return cls(SequenceParallelTopology(group.size(), ring * ulysses, rank, ring), group)

    @property
    def ring_size(self) -> int:
        """Ring degree of Ulysses x Ring (1: plain Ulysses)."""
        return self.topology.ring_size

    @cached_property
    def sp(self) -> ProcessGroup | None:
        """The SP group: the mesh's ``sp`` axis (``None``: no mesh)."""
        if self.mesh is None:
            return None
        return self.mesh.get_group() if self.mesh.ndim == 1 else self.mesh.get_group("sp")

    @cached_property
    def dp(self) -> ProcessGroup | None:
        """The DP group: the mesh's ``dp`` axis (``None``: a mesh without one)."""
        return self.mesh.get_group("dp") if self.mesh is not None and self.mesh.ndim == 3 else None

    @cached_property
    def ulysses(self) -> ProcessGroup | None:
        """The group of the all-to-alls: the mesh's ``ulysses`` axis, the SP group itself without a ring."""
        return self.sp if self.ring is None else self.mesh.get_group("ulysses")  # type: ignore[union-attr]

    @cached_property
    def ring(self) -> ProcessGroup | None:
        """The ring group of Ulysses x Ring: the mesh's ``ring`` axis (``None``: ``ring_size == 1``)."""
        return None if self.ring_size == 1 or self.mesh is None else self.mesh.get_group("ring")


# a runtime alias kept as typing.Union (``X | Y`` would make another object, a types.UnionType)
SequenceParallelGroupLike = Union[SequenceParallelGroups, DeviceMesh, ProcessGroup, None]  # noqa: UP007
"""What a public entry point takes as its SP group (see :meth:`SequenceParallelGroups.of`; a ``ProcessGroup`` is
deprecated)."""
