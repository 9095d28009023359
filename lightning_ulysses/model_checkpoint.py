"""``ModelCheckpoint`` whose ``last.ckpt`` is the latest step, whatever the monitored metric did.

Lightning 2.6's :class:`~lightning.pytorch.callbacks.ModelCheckpoint` with ``save_last`` rewrites ``last.ckpt`` only
at a step where it also saves a top-k checkpoint, and at the end of fit only if it never saved one. With
``monitor: val_loss`` a validation that is not the best therefore leaves ``last.ckpt`` at an older step (the DPO
quickstart's held step 30 of 60), and with ``every_n_train_steps`` the steps after the last multiple are never saved:
a resume or an export from ``last.ckpt`` silently took an older model. :class:`~lightning_ulysses.UlyssesStrategy` runs
Lightning's own ``ModelCheckpoint`` as this class (:func:`keep_last_checkpoint_current`, at set-up), and the
``lightning-ulysses`` CLI builds this class wherever a config names Lightning's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same arguments) whose ``save_last`` writes ``last.ckpt`` at every step where
    it considers a top-k save (each validation when it monitors a metric or saves per epoch, every
    ``every_n_train_steps``, ...), kept or not, and at the end of fit: ``last.ckpt`` always holds the latest of those
    steps, the final step after a fit that ends. Each step is written once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last_saved_at_step: int | None = None

    def _save_topk_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, Any]) -> None:
        super()._save_topk_checkpoint(trainer, monitor_candidates)
        self._save_last_checkpoint(trainer, monitor_candidates)  # whether or not the top k kept this step

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, Any]) -> None:
        if not self.save_last or self._last_saved_at_step == trainer.global_step:
            return  # Lightning also calls this after a top-k save of the step
        if self.save_last == "link" and self._last_global_step_saved != trainer.global_step:
            self._last_checkpoint_saved = ""  # no file of this step to link to: write last.ckpt itself
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_saved_at_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning's connectors set it on the Trainer, whose class does not declare it (mypy: attr-defined)
        fast_dev_run = trainer.fast_dev_run  # type: ignore[attr-defined]
        if fast_dev_run or trainer.state.fn != TrainerFn.FITTING:
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def keep_last_checkpoint_current(callbacks: Iterable[Callback]) -> None:
    """Turn each of Lightning's own ``ModelCheckpoint`` callbacks into :class:`ModelCheckpoint` in place: the same
    object, arguments and state, whose ``last.ckpt`` then holds the latest step. Subclasses are left alone (they may
    decide differently what to save)."""
    for callback in callbacks:
        if type(callback) is LightningModelCheckpoint:
            callback.__class__ = ModelCheckpoint
            assert isinstance(callback, ModelCheckpoint)
            callback._last_saved_at_step = None
