"""Suite-wide hygiene: every test gets back the environment it started with.

Lightning run in the test process (the CLI's in-process commands, a plain ``Trainer``) writes its state into
``os.environ`` (``PL_GLOBAL_SEED`` from ``seed_everything``, ...), and :func:`tests.launch.launch` hands the environment
to every process it starts: a seed left behind reseeds the ranks of every later multi-process test, which then no
longer start from the state their single-process reference assumes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
