"""Progress that reads right: optimizer steps out of ``max_steps``, and plain lines where stdout is not a terminal.

Lightning's bar counts the batches of the current epoch against ``max_epochs - 1`` (``Epoch 0/-2`` in a run that
``max_steps`` ends) and, after a resume, the epoch's batch index against the steps left (``400/199``). In a
step-limited run (``max_epochs=-1``, ``max_steps > 0``) :class:`StepProgressBar` shows ``Step`` and the global
optimizer step out of ``max_steps``. Where stdout is a file or a pipe (``| tee``, nohup, SLURM logs) a live bar
shows nothing until the end, so :func:`progress_bar` picks :class:`LogLines` there: one plain line every
``log_every_n_steps`` optimizer steps and one per validation, with the bar's metrics (``train_loss``,
``sp/tokens_per_sec`` of :class:`~lightning_ulysses.SequenceParallelMonitor`, ...).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from lightning.pytorch.trainer.states import TrainerFn


def counts_steps(trainer: L.Trainer) -> bool:
    """Whether ``max_steps`` (not ``max_epochs``) ends this fit."""
    return trainer.max_epochs == -1 and trainer.max_steps > 0


def _without_version(metrics: dict[str, Any]) -> dict[str, Any]:
    metrics.pop("v_num", None)  # the logger's version number, already in the run folder's name
    return metrics


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar counting optimizer steps out of ``max_steps`` in a step-limited run (also
    after a resume), epochs otherwise, without ``v_num``."""

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if counts_steps(self.trainer) else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        if not counts_steps(self.trainer):
            return super()._get_train_description(current_epoch)
        return f"{'Step':{len(self.validation_description)}}"

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not counts_steps(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self.is_disabled and self.train_progress_bar_id is None:  # resumed inside an epoch
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))


class LogLines(ProgressBar):
    """Progress as plain lines on stdout (rank 0): ``step 20/200 | 12s | train_loss 3.214 | sp/tokens_per_sec 5,430``
    every ``every_n_steps`` optimizer steps (default: the Trainer's ``log_every_n_steps``) and at the last one, and
    the metrics of each validation and test."""

    def __init__(self, every_n_steps: int | None = None) -> None:
        super().__init__()
        self.every_n_steps = every_n_steps
        self._enabled = True
        self._start = time.monotonic()
        self._printed_step = -1

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.monotonic()
        self._printed_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # Lightning's connectors set it on the Trainer, whose class does not declare it (mypy: attr-defined)
        every = self.every_n_steps or trainer.log_every_n_steps or 1  # type: ignore[attr-defined]
        last = counts_steps(trainer) and step >= trainer.max_steps
        if step != self._printed_step and (step % every == 0 or last):
            self._printed_step = step
            total = f"/{trainer.max_steps}" if counts_steps(trainer) else ""
            self._print(
                f"step {step}{total} | epoch {trainer.current_epoch} | {time.monotonic() - self._start:.0f}s",
                self.get_metrics(trainer, pl_module),
                exclude=("val_",),
            )

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        where = f"validation at step {trainer.global_step}" if trainer.state.fn == TrainerFn.FITTING else "validation"
        self._print(where, trainer.callback_metrics, include=("val_",))

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._print("test", trainer.callback_metrics, include=("test_",))

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))

    def _print(
        self, head: str, metrics: dict[str, Any], include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()
    ) -> None:
        if not self.is_enabled:
            return
        shown = {
            key: value
            for key, value in metrics.items()
            if (not include or key.startswith(include)) and not any(key.startswith(p) for p in exclude)
        }
        print(" | ".join([head, *(f"{key} {_format(value)}" for key, value in shown.items())]), flush=True)


def _format(value: Any) -> str:
    value = float(value)
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def progress_bar() -> ProgressBar:
    """:class:`StepProgressBar` on a terminal, :class:`LogLines` where stdout is a file or a pipe."""
    return StepProgressBar() if sys.stdout.isatty() else LogLines()
