"""Suite-wide hygiene: every test gets back the environment it started with; the pooled process worlds
(:mod:`tests.pool`) stop at the session's end; CUDA-only tests (marked ``cuda``) skip without a GPU.

Lightning run in the test process (the CLI's in-process commands, a plain ``Trainer``) writes its state into
``os.environ`` (``PL_GLOBAL_SEED`` from ``seed_everything``, ...), and :func:`tests.launch.launch` hands the environment
to every process it starts: a seed left behind reseeds the ranks of every later multi-process test, which then no
longer start from the state their single-process reference assumes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

import tests.launch
from tests import pool
from tests.launch import WORLD_STARTS


def pytest_configure(config: pytest.Config) -> None:
    tests.launch.POOLED = not os.environ.get("LAUNCH_FRESH")


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def _pooled_worlds() -> Iterator[None]:
    yield
    pool.shutdown()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if any(WORLD_STARTS.values()):
        counts = ", ".join(f"{count} {kind}" for kind, count in WORLD_STARTS.items())
        terminalreporter.write_line(f"process worlds (tests/launch.py): {counts}")
