"""A data module's batches loaded by worker processes that a fork server started, as this package's loaders start
them where a forked worker can hang (:func:`lightning_ulysses.sp_loaders.worker_start_method`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_ulysses import sp_loaders


def check_workers_from_a_fork_server(data: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``data``'s validation loader, set up already, gives with one worker started from a fork server (its dataset
    and collate function pickled into it) the batches it gives in the process itself."""
    monkeypatch.setattr(sp_loaders, "fork_can_deadlock", lambda: True)
    data.num_workers = 0
    in_process = data.val_dataloader()
    assert in_process.multiprocessing_context is None
    expected = list(in_process)
    data.num_workers = 1
    loader = data.val_dataloader()
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    got = list(loader)
    assert len(got) == len(expected) > 0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
