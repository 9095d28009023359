"""Two "nodes" on one machine: node ranks 0 and 1, two CPU processes each, gloo over loopback.

``Trainer(num_nodes=2, devices=2)`` under two launchers, each numbering ranks node by node:

* torchrun: two ``torchrun --node-rank {0,1} --nproc-per-node 2`` launcher processes (Lightning's
  ``TorchElasticEnvironment``). ``sp=2``: each SP group is the two processes of one node, each DP group
  joins the nodes, no warning; training (ZeRO-3, DP across the nodes) equals one process;
* plain ``MASTER_ADDR``/``NODE_RANK``/``LOCAL_RANK`` variables (``LightningEnvironment``). ``sp=4``: the SP
  group spans both nodes, rank 0 warns with the reason, and training is still exact; with ``ring_size="auto"``
  the same SP group runs Ulysses inside each node and the ring across them (2 x 2), without the warning, exactly.

"Equals one process" as in :mod:`tests.test_equivalence`: every loss ``rtol=1e-5``, weight update
``< 1e-4`` relative.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest

from tests.launch import launch
from tests.test_equivalence import _check, _fit

pytestmark = pytest.mark.distributed

NUM_NODES, DEVICES_PER_NODE = 2, 2
SP_INSIDE_NODES = {"sp_inside_nodes_dp_across": dict(sp=2, stage=3)}
SP_ACROSS_NODES = {
    "sp_across_nodes": dict(sp=4, stage=1),
    "ring_across_nodes": dict(sp=4, stage=2, strategy=dict(ring_size="auto")),
}


def two_node_worker(args: dict[str, Any]) -> dict[str, Any]:
    # read first (Lightning's teardown deletes launcher variables): torchrun says GROUP_RANK, plain launchers NODE_RANK
    node_rank = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", -1)))
    results = {}
    for name, case in args["cases"].items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = _fit(case, devices=DEVICES_PER_NODE, num_nodes=NUM_NODES, strategy_kwargs=case.get("strategy"))
        result["node_rank"] = node_rank
        result["warnings"] = [str(w.message) for w in caught]
        results[name] = result
    return results


def _launch(cases: dict[str, dict[str, Any]], launcher: str) -> list[dict[str, Any]]:
    return launch(
        "tests.test_multinode:two_node_worker",
        NUM_NODES * DEVICES_PER_NODE,
        {"cases": cases},
        num_nodes=NUM_NODES,
        launcher=launcher,
    )


@pytest.fixture(scope="module")
def torchrun_results() -> list[dict[str, Any]]:
    return _launch(SP_INSIDE_NODES, "torchrun")


@pytest.fixture(scope="module")
def plain_env_results() -> list[dict[str, Any]]:
    return _launch(SP_ACROSS_NODES, "env")


def _span_warnings(result: dict[str, Any]) -> list[str]:
    return [message for message in result["warnings"] if "span nodes" in message]


def test_sp_groups_stay_inside_nodes(torchrun_results: list[dict[str, Any]]) -> None:
    results = [r["sp_inside_nodes_dp_across"] for r in torchrun_results]
    assert {r["cluster_environment"] for r in results} == {"TorchElasticEnvironment"}
    assert [r["node_rank"] for r in results] == [0, 0, 1, 1]
    assert [r["sp_group_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_group_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for result in results:
        assert {results[rank]["node_rank"] for rank in result["sp_group_ranks"]} == {result["node_rank"]}
        assert {results[rank]["node_rank"] for rank in result["dp_group_ranks"]} == {0, 1}
    assert not any(_span_warnings(r) for r in results)


def test_sp_inside_nodes_equals_single_process(torchrun_results: list[dict[str, Any]]) -> None:
    name = "sp_inside_nodes_dp_across"
    _check(torchrun_results, name, SP_INSIDE_NODES[name])


def test_sp_groups_spanning_nodes_warn(plain_env_results: list[dict[str, Any]]) -> None:
    results = [r["sp_across_nodes"] for r in plain_env_results]
    assert {r["cluster_environment"] for r in results} == {"LightningEnvironment"}
    assert [r["node_rank"] for r in results] == [0, 0, 1, 1]
    assert [r["sp_group_ranks"] for r in results] == [[0, 1, 2, 3]] * 4
    (message,) = _span_warnings(results[0])  # rank_zero_warn: once, on global rank 0
    assert "ranks [0, 1, 2, 3] are on 2 nodes" in message and "sp_size to one of [1, 2]" in message
    assert not any(_span_warnings(r) for r in results[1:])


@pytest.mark.parametrize("name", SP_ACROSS_NODES)
def test_sp_spanning_nodes_equals_single_process(plain_env_results: list[dict[str, Any]], name: str) -> None:
    _check(plain_env_results, name, SP_ACROSS_NODES[name])


def test_ring_across_nodes_keeps_the_all_to_alls_inside_them(plain_env_results: list[dict[str, Any]]) -> None:
    """ring_size="auto": the Ulysses degree is the processes of a node (2), the ring joins the nodes; no warning."""
    results = [r["ring_across_nodes"] for r in plain_env_results]
    assert [r["ring_size"] for r in results] == [2] * 4
    assert not any(_span_warnings(r) for r in results)
