"""The process grid as one ``DeviceMesh`` (:func:`~lightning_ulysses.groups.build_mesh`): its axes hold exactly the
topology's groups, on CPU over gloo, and :class:`~lightning_ulysses.groups.SequenceParallelGroups` is a view of it."""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_ulysses.groups import MESH_AXES, SequenceParallelGroups
from lightning_ulysses.hf import apply_ulysses_attention
from lightning_ulysses.topology import SequenceParallelTopology
from tests.launch import launch
from tests.tiny import tiny_llama

WORLD = 4
LAYOUTS = [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 4)]  # (sp_size, ring_size)
TIMEOUT = timedelta(seconds=123)


def _ranks(group: dist.ProcessGroup | None) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def mesh_worker(args: dict[str, Any]) -> dict[Any, Any]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[Any, Any] = {}
    for sp, ring in LAYOUTS:
        topology = SequenceParallelTopology(WORLD, sp, rank, ring)
        groups = SequenceParallelGroups.create(topology, "cpu", TIMEOUT)
        mesh = groups.mesh
        assert mesh is not None
        results[sp, ring] = {
            "grid": mesh.mesh.tolist(),
            "names": mesh.mesh_dim_names,
            "sp": _ranks(groups.sp),
            "dp": _ranks(groups.dp),
            "ulysses": _ranks(groups.ulysses),
            "ring": _ranks(groups.ring),
            "submeshes": {axis: mesh[axis].mesh.tolist() for axis in MESH_AXES},
            "view": SequenceParallelGroups.of(mesh).topology,
            "timeouts": [g._get_backend(torch.device("cpu")).options._timeout for g in (groups.sp, groups.dp)],
        }
    with pytest.raises(ValueError, match="is not the process grid"):
        SequenceParallelGroups(SequenceParallelTopology(WORLD, 2, rank), mesh)  # the last mesh is of sp=4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = SequenceParallelGroups.of(dist.group.WORLD)
    results["plain"] = (
        plain.topology,
        _ranks(plain.sp),
        plain.dp,
        plain.ring,
        [type(w.message) for w in caught],
    )
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def meshes() -> list[dict[Any, Any]]:
    return launch("tests.test_mesh:mesh_worker", WORLD)


def _own(groups: list[list[int]], rank: int) -> list[int]:
    return next(g for g in groups if rank in g)


def test_mesh_axes_hold_the_topology_groups(meshes: list[dict[Any, Any]]) -> None:
    """Every rank, every layout: the mesh is the row-major [dp, ring, ulysses] grid, and its sp, dp, ulysses and ring
    groups are this rank's groups of the topology (the rank layout of SequenceParallelTopology, unchanged)."""
    for rank, got in enumerate(meshes):
        for sp, ring in LAYOUTS:
            topology = SequenceParallelTopology(WORLD, sp, rank, ring)
            layout = got[sp, ring]
            shape = (topology.dp_size, ring, topology.ulysses_size)
            assert layout["names"] == ("dp", "ring", "ulysses")
            assert layout["grid"] == torch.arange(WORLD).view(shape).tolist()
            assert layout["sp"] == _own(topology.sp_group_ranks, rank)
            assert layout["dp"] == _own(topology.dp_group_ranks, rank)
            assert layout["ulysses"] == _own(topology.ulysses_group_ranks, rank)
            assert layout["ring"] == (None if ring == 1 else _own(topology.ring_group_ranks, rank))
            assert layout["submeshes"] == {
                "dp": layout["dp"],
                "ring": _own(topology.ring_group_ranks, rank),
                "ulysses": layout["ulysses"],
            }
            assert layout["view"] == topology
            assert layout["timeouts"] == [TIMEOUT, TIMEOUT]


def test_a_process_group_is_deprecated_and_runs_plain_ulysses(meshes: list[dict[Any, Any]]) -> None:
    for rank, got in enumerate(meshes):
        topology, sp, dp, ring, warned = got["plain"]
        assert topology == SequenceParallelTopology(WORLD, WORLD, rank)
        assert sp == list(range(WORLD)) and dp is None and ring is None
        assert warned == [DeprecationWarning]


def test_apply_ulysses_attention_takes_no_size() -> None:
    """The group carries its size: a call of the old signature (a size before the core) fails with what to do; the
    deprecated keyword is checked against the group's."""
    with pytest.raises(TypeError, match="takes no sp_size"):
        apply_ulysses_attention(tiny_llama(), None, 1, "sdpa")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sp_size=2 is not the group's size, 1"), pytest.warns(DeprecationWarning):
        apply_ulysses_attention(tiny_llama(), None, "sdpa", sp_size=2)
