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
from tests.launch import RankExit, launch_to_exit
from tests.tiny import TinyCausalLM, collate, make_samples

PG_TIMEOUT_S = 30  # also bounds start-up collectives: leave room for ranks that start unevenly on a loaded machine
STALL_S = 2 * PG_TIMEOUT_S
START_UP_S = 120  # process start-up, imports and DeepSpeed set-up on a loaded 2-core machine
NONFINITE_REPORTED = "non-finite loss reported: "


class FailingCausalLM(TinyCausalLM):
    """At batch 1, on rank ``fail_rank``: returns a NaN loss (``"nan"``), or stalls ``STALL_S`` seconds
    (its peers block in a collective) and then raises (``"stall_then_raise"``)."""

    def __init__(self, mode: str, fail_rank: int) -> None:
        super().__init__()
        self.mode, self.fail_rank = mode, fail_rank

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        failing = self.global_rank == self.fail_rank and batch_idx == 1
        if failing and self.mode == "stall_then_raise":
            time.sleep(STALL_S)
            raise RuntimeError(f"rank {self.global_rank} fails on purpose at batch {batch_idx}")
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if failing else loss


def _fit(mode: str, sp: int, world_size: int) -> None:
    strategy = UlyssesStrategy(sp_size=sp, stage=2, attn_implementation="sdpa", timeout=timedelta(seconds=PG_TIMEOUT_S))
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    loader = DataLoader(make_samples(num=16, seq_len=16), batch_size=2, collate_fn=collate)
    trainer.fit(FailingCausalLM(mode, fail_rank=1), loader)


def failing_worker(args: dict[str, Any]) -> None:
    """A NaN loss on rank 1 under dp=2 (caught, so the processes go on), then a stall and a raise on rank 1 under sp=2."""
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown deletes it
    try:
        _fit("nan", sp=1, world_size=world_size)
    except FloatingPointError as error:
        print(NONFINITE_REPORTED + str(error), flush=True)
    _fit("stall_then_raise", sp=2, world_size=world_size)


@pytest.fixture(scope="module")
def exits() -> list[RankExit]:
    return launch_to_exit("tests.test_failures:failing_worker", 2, timeout=START_UP_S + STALL_S + 2 * PG_TIMEOUT_S)


def test_nonfinite_loss_stops_every_rank_naming_step_and_ranks(exits: list[RankExit]) -> None:
    for rank, exit in enumerate(exits):
        assert NONFINITE_REPORTED + "Non-finite training loss at global step 1 (batch 1 of the epoch) on ranks [1]." in (
            exit.output
        ), f"rank {rank}:\n{exit.output[-3000:]}"


def test_rank_stalling_then_raising_ends_every_rank_with_an_error(exits: list[RankExit]) -> None:
    for rank, exit in enumerate(exits):
        assert exit.returncode is not None, f"rank {rank} was still running at the launcher's timeout:\n{exit.output[-3000:]}"
        assert exit.returncode != 0, f"rank {rank} exited cleanly after its peer failed:\n{exit.output[-3000:]}"
    assert "RuntimeError: rank 1 fails on purpose at batch 1" in exits[1].output
    # rank 0 must not wait for rank 1's exit: its SP collective gives up after the strategy's timeout
    assert "Timed out" in exits[0].output and "Connection closed by peer" not in exits[0].output, exits[0].output[-3000:]


def test_batch_that_cannot_be_sharded_is_refused_with_its_shape() -> None:
    batch = {"input_ids": torch.ones(2, 16, dtype=torch.long), "pixel_values": torch.ones(3, 16)}
    with pytest.raises(ValueError, match=r"'pixel_values' with shape \(3, 16\).*\[batch=2, seq=16"):
        prepare_batch(batch, sp_size=2)
