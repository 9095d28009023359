"""The pooled worlds of :func:`tests.launch.launch` (:mod:`tests.pool`): a call starts from a fresh process's state
whatever the previous call in the same processes did; a failing or hanging call fails with every rank's output,
and the next call runs in a new world."""

from __future__ import annotations

import logging
import os
import signal
import warnings
from datetime import timedelta
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

import tests.launch
from tests.launch import launch
from tests.pool import MAX_RANK_THREADS

pytestmark = pytest.mark.distributed


def state_worker(args: dict[str, Any]) -> dict[str, Any]:
    """What a call could inherit from the previous one in the same process (after the imports every worker makes,
    which a pooled rank has made at start-up)."""
    import deepspeed  # noqa: F401
    import lightning  # noqa: F401
    import transformers  # noqa: F401

    return {
        "pid": os.getpid(),
        "cwd": os.getcwd(),
        "left_behind": os.environ.get("LEFT_BEHIND"),
        "rank": os.environ["RANK"],
        "dtype": torch.get_default_dtype(),
        "process_group": dist.is_initialized(),
        "lightning_level": logging.getLogger("lightning").level,
        "warning_filters": len(warnings.filters),
    }


def dirty_worker(args: dict[str, Any]) -> int:
    """Leaves behind what a careless call could: environment, directory, seed, dtype, process group, log level."""
    os.environ["LEFT_BEHIND"] = "1"
    os.chdir("/")
    torch.manual_seed(123)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    dist.new_group(ranks=[0, 1])
    logging.getLogger("lightning").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore")
    return os.getpid()


_KEPT_GROUPS: list[dist.ProcessGroup] = []  # what a finished fit's DeepSpeed engine holds in a pooled rank


def group_keeping_worker(args: dict[str, Any]) -> int:
    """Makes ``args["groups"]`` gloo groups and keeps them past the call: each keeps its threads while it lives."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    _KEPT_GROUPS.extend(dist.new_group(ranks=[0, 1]) for _ in range(args["groups"]))
    return os.getpid()


def failing_worker(args: dict[str, Any]) -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails on purpose")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    dist.barrier()  # rank 0 waits for rank 1, which never comes


def sleeping_worker(args: dict[str, Any]) -> None:
    if os.environ["RANK"] == "1":
        import time

        time.sleep(600)


def _fresh(monkeypatch: pytest.MonkeyPatch, target: str) -> list[Any]:
    monkeypatch.setattr(tests.launch, "POOLED", False)
    return launch(target, 2)


def test_a_call_starts_from_the_state_of_a_fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    pids = launch("tests.test_pool:dirty_worker", 2)
    pooled = launch("tests.test_pool:state_worker", 2)
    assert [result["pid"] for result in pooled] == pids, "the second call ran in other processes: nothing was pooled"
    fresh = _fresh(monkeypatch, "tests.test_pool:state_worker")
    for got, want in zip(pooled, fresh, strict=True):
        assert {**got, "pid": None} == {**want, "pid": None}


def test_a_failing_call_fails_with_every_rank_output_and_the_next_call_runs_in_a_new_world() -> None:
    pids = [result["pid"] for result in launch("tests.test_pool:state_worker", 2)]
    with pytest.raises(
        AssertionError,
        match=r"(?s)\['rank 0 \(pooled\)', 'rank 1 \(pooled\)'\] failed.*"
        r"rank 1 fails on purpose",
    ):
        launch("tests.test_pool:failing_worker", 2)
    after = [result["pid"] for result in launch("tests.test_pool:state_worker", 2)]
    assert not set(after) & set(pids)


def test_a_hanging_call_is_stopped_at_its_timeout_and_the_next_call_runs_in_a_new_world() -> None:
    pids = [result["pid"] for result in launch("tests.test_pool:state_worker", 2)]
    with pytest.raises(AssertionError, match=r"\['rank 1 \(pooled\)'\] failed \(\['rank 1 \(pooled\)'\] were stopped"):
        launch("tests.test_pool:sleeping_worker", 2, timeout=10)
    after = [result["pid"] for result in launch("tests.test_pool:state_worker", 2)]
    assert not set(after) & set(pids)


def test_a_world_whose_ranks_keep_too_many_threads_is_replaced() -> None:
    """Each gloo group holds 3 threads; a call that leaves a rank over ``MAX_RANK_THREADS`` retires its world."""
    few = MAX_RANK_THREADS // 3 // 4
    pids = launch("tests.test_pool:group_keeping_worker", 2, {"groups": few})
    assert launch("tests.test_pool:group_keeping_worker", 2, {"groups": MAX_RANK_THREADS // 3}) == pids
    after = [result["pid"] for result in launch("tests.test_pool:state_worker", 2)]
    assert not set(after) & set(pids), "the world of the ranks that kept their groups' threads was used again"


class _Interrupted(Exception):
    """What pytest-timeout raises in the test's thread."""


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "fresh"])
def test_a_call_interrupted_from_outside_stops_its_ranks(monkeypatch: pytest.MonkeyPatch, pooled: bool) -> None:
    monkeypatch.setattr(tests.launch, "POOLED", pooled)
    world = {result["pid"] for result in launch("tests.test_pool:state_worker", 2)} if pooled else set()
    running = _rank_processes()

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(3)
    try:
        with pytest.raises(_Interrupted):
            launch("tests.test_pool:sleeping_worker", 2, timeout=60)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    left = _rank_processes() - (running - world)
    assert not left, f"ranks of the interrupted call still run: {left}"
    after = {result["pid"] for result in launch("tests.test_pool:state_worker", 2)}
    assert not after & world


def _rank_processes() -> set[int]:
    """This test process's live processes running ``tests.launch`` (ranks, pooled or fresh; not those of other
    sessions on the machine)."""
    ranks = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if "tests.launch" in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                ranks.add(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return ranks
