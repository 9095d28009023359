"""``last.ckpt`` holds the final step of a fit whose last validation is not the best, and the last step after the last
``every_n_train_steps`` multiple (Lightning's ``ModelCheckpoint`` kept an older step in both); the CLI runs this
class where a config names Lightning's, and UlyssesStrategy runs Lightning's own as this one in a Python script."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_ulysses import ModelCheckpoint, UlyssesStrategy
from lightning_ulysses.runtime.directory import saved_global_step
from tests.launch import REPO_ROOT, launch
from tests.tiny import TinyCausalLM, collate, cpu_trainer, make_samples

pytestmark = pytest.mark.cli


class WorseningModule(L.LightningModule):
    """A linear layer whose ``val_loss`` is the global step: the first validation is the best, every later one worse."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", float(self.global_step))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(64, 2), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(4, 2), batch_size=4)


def saved_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"monitor": "val_loss", "save_last": True},  # as the quickstart configs: step 6's val_loss is not the best
        {"monitor": "val_loss", "save_last": "link"},
        {"every_n_train_steps": 4, "save_last": True},  # as the GPU configs: the fit ends between two multiples
    ],
    ids=["monitor", "monitor-link", "every_n_train_steps"],
)
def test_last_checkpoint_is_the_final_step(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    callback = ModelCheckpoint(dirpath=tmp_path, **kwargs)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(WorseningModule())
    assert trainer.global_step == 6
    assert saved_step(tmp_path / "last.ckpt") == 6, sorted(p.name for p in tmp_path.iterdir())
    if "monitor" in kwargs:
        assert saved_step(Path(callback.best_model_path)) == 2  # the top-k checkpoint is still the best one


def test_the_cli_runs_lightnings_model_checkpoint_as_this_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shipped config names Lightning's class; what the CLI builds keeps ``last.ckpt`` current."""
    from lightning_ulysses.cli import UlyssesCLI

    monkeypatch.setattr(sys, "argv", ["lightning-ulysses"])
    cli = UlyssesCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
        run=False,
        args=[
            "--config",
            str(REPO_ROOT / "configs/dpo_quickstart.yaml"),
            "--model.model",
            "unused",
            "--data.tokenizer",
            "byte",
        ],
    )
    assert type(cli.trainer.checkpoint_callback) is ModelCheckpoint and cli.trainer.checkpoint_callback.save_last


class WorseningCausalLM(TinyCausalLM):
    """``val_loss`` is the global step: the first validation is the best, every later one worse."""

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", float(self.global_step))


def lightnings_checkpoint_under_ulysses_worker(args: dict[str, Any]) -> dict[str, Any]:
    callback = L.pytorch.callbacks.ModelCheckpoint(dirpath=args["dirpath"], monitor="val_loss", save_last=True)
    trainer = cpu_trainer(
        1,
        UlyssesStrategy(sp_size=1, stage=2, attn_implementation="sdpa"),
        max_steps=5,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        callbacks=[callback],
        enable_checkpointing=True,
    )
    loader = DataLoader(make_samples(12, 8), batch_size=1, collate_fn=collate)
    trainer.fit(WorseningCausalLM(), loader, DataLoader(make_samples(1, 8), batch_size=1, collate_fn=collate))
    return {"same_callback": trainer.checkpoint_callback is callback, "best": callback.best_model_path}


def test_lightnings_model_checkpoint_under_the_strategy_keeps_last_at_the_final_step(tmp_path: Path) -> None:
    """A Python script with Lightning's own ``ModelCheckpoint(save_last=True)`` under UlyssesStrategy: ``last.ckpt``
    holds step 5 of 5 (Lightning's held step 4), the best checkpoint is still step 2's, and the callback is the
    user's object."""
    result = launch(
        "tests.test_model_checkpoint:lightnings_checkpoint_under_ulysses_worker", 1, {"dirpath": str(tmp_path)}
    )[0]
    assert saved_global_step(tmp_path / "last.ckpt") == 5, sorted(p.name for p in tmp_path.iterdir())
    assert saved_global_step(result["best"]) == 2 and result["same_callback"]
