"""UlyssesStrategy's contract besides the numbers: data placement, step counts and clear errors."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesStrategy
from lightning_ulysses.hf import apply_ulysses_attention, remove_ulysses_attention
from tests.launch import launch
from tests.tiny import TinyCausalLM, collate, make_samples, tiny_llama

pytestmark = pytest.mark.distributed

NUM_SAMPLES, BATCH = 12, 2


class RecordingLM(TinyCausalLM):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[list[int]] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.seen.append(batch["index"].tolist())
        return super().training_step(batch, batch_idx)


class NoPositionsLM(TinyCausalLM):
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch["input_ids"]).logits.sum()


def _trainer(world_size: int, strategy: UlyssesStrategy, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


def strategy_worker(args: dict[str, Any]) -> dict[str, Any]:
    world_size = int(os.environ["WORLD_SIZE"])
    result: dict[str, Any] = {}

    # errors raised at set-up, before any training step, identically on every rank
    def fit(module: L.LightningModule, sp_size: int) -> None:
        loader = DataLoader(make_samples(8, 12), batch_size=BATCH, collate_fn=collate)
        _trainer(world_size, UlyssesStrategy(sp_size=sp_size, attn_implementation="sdpa"), max_steps=1).fit(
            module, loader
        )

    result["world_not_divisible"] = _error(lambda: fit(TinyCausalLM(), sp_size=3))
    result["missing_position_ids"] = _error(lambda: fit(NoPositionsLM(), sp_size=2))

    # data: SP ranks share samples, DP groups split them, one epoch has DDP's step count on dp ranks
    samples = make_samples(NUM_SAMPLES, 12)
    for index, sample in enumerate(samples):
        sample["index"] = torch.tensor(index)
    module = RecordingLM()
    strategy = UlyssesStrategy(sp_size=2, stage=2, attn_implementation="sdpa")
    trainer = _trainer(world_size, strategy, max_epochs=1)
    trainer.fit(module, DataLoader(samples, batch_size=BATCH, collate_fn=collate))
    result["seen"] = module.seen
    result["estimated_stepping_batches"] = trainer.estimated_stepping_batches
    result["global_step"] = trainer.global_step
    result["coordinates"] = (strategy.dp_rank, strategy.sp_rank)
    return result


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch("tests.test_strategy:strategy_worker", 4, {})


def test_sp_ranks_share_samples_and_dp_groups_split_the_epoch(results: list[dict[str, Any]]) -> None:
    by_coordinates = {r["coordinates"]: [i for batch in r["seen"] for i in batch] for r in results}
    assert by_coordinates[(0, 0)] == by_coordinates[(0, 1)]
    assert by_coordinates[(1, 0)] == by_coordinates[(1, 1)]
    group0, group1 = by_coordinates[(0, 0)], by_coordinates[(1, 0)]
    assert sorted(group0 + group1) == list(range(NUM_SAMPLES)), "one epoch visits every sample exactly once"
    for r in results:
        steps = NUM_SAMPLES // (2 * BATCH)  # DDP on dp_size=2 ranks
        assert r["estimated_stepping_batches"] == steps and r["global_step"] == steps


def test_world_size_not_divisible_by_sp_size(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert "world size (4 processes" in r["world_not_divisible"] and "[1, 2, 4]" in r["world_not_divisible"]


def test_model_called_without_position_ids(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["missing_position_ids"].startswith("ValueError: Under sequence parallelism the model must be called")


def test_unsupported_attention_backends_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="Unsupported attn_implementation 'eager'. Eager attention"):
        UlyssesStrategy(sp_size=2, attn_implementation="eager")
    with pytest.raises(ValueError, match="Choose one of: 'auto', 'sdpa', 'flash_attention_2'"):
        UlyssesStrategy(sp_size=2, attn_implementation="flash")
    with pytest.raises(ValueError, match="sp_size must be a positive integer or 'auto', got 0"):
        UlyssesStrategy(sp_size=0)


def test_an_sp_size_that_does_not_divide_the_processes_is_refused_by_the_trainers_constructor() -> None:
    """In the user's process, before a launcher starts the others (it was refused after start-up, once per rank)."""
    with pytest.raises(ValueError, match=r"world size \(3 processes.*not divisible by sp_size=2.*\[1, 3\]"):
        L.Trainer(accelerator="cpu", devices=3, strategy=UlyssesStrategy(sp_size=2), logger=False)
    with pytest.raises(ValueError, match=r"ring_size=.*does not divide sp_size=3|not divisible by sp_size=3"):
        L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=UlyssesStrategy(sp_size=3, ring_size="auto"))


def test_sp_size_before_fit_is_the_configured_value() -> None:
    assert UlyssesStrategy(sp_size=2).sp_size == 2
    with pytest.raises(RuntimeError, match="sp_size='auto' is the number of processes per node, known once a Trainer"):
        UlyssesStrategy().sp_size  # noqa: B018
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=UlyssesStrategy(), logger=False)
    assert trainer.strategy.sp_size == 4


def test_impossible_ring_layouts_are_refused_at_construction() -> None:
    with pytest.raises(
        ValueError, match=r"ring_size=3 does not divide sp_size=4.*Valid ring_size values .*\[1, 2, 4\]"
    ):
        UlyssesStrategy(sp_size=4, ring_size=3)
    with pytest.raises(ValueError, match="ring_size must be a positive integer or 'auto', got 0"):
        UlyssesStrategy(sp_size=4, ring_size=0)
    with pytest.raises(ValueError, match="Ulysses x Ring .* not attn_implementation='flex_attention'"):
        UlyssesStrategy(sp_size=4, ring_size=2, attn_implementation="flex_attention")


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_flash_attention_without_the_package_is_refused() -> None:
    with pytest.raises(ValueError, match="'flash_attn' package, which is not installed"):
        UlyssesStrategy(sp_size=2, attn_implementation="flash_attention_2")


def test_patching_leaves_other_models_alone() -> None:
    patched, other = tiny_llama(), tiny_llama()
    apply_ulysses_attention(patched, group=None, attn_implementation="sdpa")
    ids = torch.randint(0, 50, (1, 8))
    assert other.config._attn_implementation == "sdpa"
    torch.testing.assert_close(patched(input_ids=ids, position_ids=torch.arange(8)[None]).logits, other(ids).logits)
    remove_ulysses_attention(patched)
    assert patched.config._attn_implementation == "sdpa"
    torch.testing.assert_close(patched(ids).logits, other(ids).logits)  # no position ids needed any more
