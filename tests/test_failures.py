"""Failures end every rank with an error, within a bounded time, never a hang.

The processes run under :func:`tests.launch.launch_to_exit`, which never stops a rank because another
failed: each rank must exit on its own, with an error, before the launcher's timeout.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesStrategy, prepare_batch
from tests.launch import launch_to_exit
from tests.tiny import TinyCausalLM, collate, make_samples

PG_TIMEOUT_S = 20
START_UP_S = 120  # process start-up, imports and DeepSpeed set-up on a loaded 2-core machine


class FailingCausalLM(TinyCausalLM):
    """Raises on one rank, or returns a non-finite loss on one rank, at batch ``fail_at``."""

    def __init__(self, mode: str, fail_rank: int, fail_at: int = 1) -> None:
        super().__init__()
        self.mode, self.fail_rank, self.fail_at = mode, fail_rank, fail_at

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        failing = self.global_rank == self.fail_rank and batch_idx == self.fail_at
        if failing and self.mode == "raise":
            raise RuntimeError(f"rank {self.global_rank} fails on purpose at batch {batch_idx}")
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if failing else loss


def failing_worker(args: dict[str, Any]) -> None:
    strategy = UlyssesStrategy(sp_size=args["sp"], stage=2, attn_implementation="sdpa",
                               timeout=timedelta(seconds=PG_TIMEOUT_S))
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    loader = DataLoader(make_samples(num=16, seq_len=16), batch_size=2, collate_fn=collate)
    trainer.fit(FailingCausalLM(args["mode"], args["fail_rank"]), loader)


def test_rank_raising_mid_step_ends_every_rank() -> None:
    start = time.monotonic()
    exits = launch_to_exit("tests.test_failures:failing_worker", 2, {"mode": "raise", "fail_rank": 1, "sp": 2},
                           timeout=START_UP_S + 2 * PG_TIMEOUT_S)
    elapsed = time.monotonic() - start
    for rank, exit in enumerate(exits):
        assert exit.returncode is not None, f"rank {rank} was still running after {elapsed:.0f} s:\n{exit.output[-3000:]}"
        assert exit.returncode != 0, f"rank {rank} exited cleanly after its peer failed:\n{exit.output[-3000:]}"
    assert "rank 1 fails on purpose at batch 1" in exits[1].output


def test_nonfinite_loss_stops_every_rank_naming_step_and_ranks() -> None:
    exits = launch_to_exit("tests.test_failures:failing_worker", 2, {"mode": "nan", "fail_rank": 1, "sp": 1},
                           timeout=START_UP_S + 2 * PG_TIMEOUT_S)
    for rank, exit in enumerate(exits):
        assert exit.returncode not in (None, 0), f"rank {rank}:\n{exit.output[-3000:]}"
        assert "Non-finite training loss at global step 1 (batch 1 of the epoch) on ranks [1]" in exit.output, (
            f"rank {rank}:\n{exit.output[-3000:]}"
        )


def test_batch_that_cannot_be_sharded_is_refused_with_its_shape() -> None:
    batch = {"input_ids": torch.ones(2, 16, dtype=torch.long), "pixel_values": torch.ones(3, 16)}
    with pytest.raises(ValueError, match=r"'pixel_values' with shape \(3, 16\).*\[batch=2, seq=16"):
        prepare_batch(batch, sp_size=2)
