"""Suite-wide hygiene: every test gets back the environment it started with; the ranks of process worlds are forked
from one warm process (:mod:`tests.forkserver`), stopped at the session's end; the test process computes on one
OpenMP thread; CUDA-only tests (marked ``cuda``) skip without a GPU.

Lightning run in the test process (the CLI's in-process commands, a plain ``Trainer``) writes its state into
``os.environ`` (``PL_GLOBAL_SEED`` from ``seed_everything``, ...), and :func:`tests.launch.launch` hands the environment
to every process it starts: a seed left behind reseeds the ranks of every later multi-process test, which then no
longer start from the state their single-process reference assumes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tests.launch
from tests import forkserver
from tests.launch import WORLD_STARTS, one_rank_world


def pytest_configure(config: pytest.Config) -> None:
    tests.launch.FORKED = not os.environ.get("LAUNCH_FRESH")
    # The test process computes the single-process references while process worlds (its own, the other pytest
    # worker's) hold every core: a second OpenMP thread there only waits for a core, and a spinning OpenMP barrier
    # makes a reference several times slower.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def _fork_server() -> Iterator[None]:
    yield
    forkserver.shutdown()


@pytest.fixture
def one_rank() -> Iterator[None]:
    """The test process as the one rank of a gloo world (:func:`tests.launch.one_rank_world`)."""
    with one_rank_world():
        yield


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: its counts go to the controller's summary
        workeroutput["world_starts"] = dict(WORLD_STARTS)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler
    from tests.scheduling import LongestFilesFirst

    return LongestFilesFirst(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    for kind, count in getattr(node, "workeroutput", {}).get("world_starts", {}).items():
        WORLD_STARTS[kind] += count


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if any(WORLD_STARTS.values()):
        counts = ", ".join(f"{count} {kind}" for kind, count in WORLD_STARTS.items())
        terminalreporter.write_line(f"process worlds (tests/launch.py): {counts}")
