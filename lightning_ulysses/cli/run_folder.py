"""Where a ``lightning-ulysses fit`` writes: one line at its start and one at its end (rank zero).

Every fit, a resumed one too, gets a new run folder (``runs/<name>/version_N``, numbered by the logger), so the
commands that follow a resume must name that folder; these lines say which it is.
"""

from __future__ import annotations

from typing import cast

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class RunFolderReport(Callback):
    """``Run folder <log_dir>: config.yaml, metrics.csv; checkpoints in <dirpath>`` when fit starts, and
    ``Run folder <log_dir>: ended at global step N; latest checkpoint <last.ckpt>`` when it ends (after the last
    save). Without a logger there is no run folder, and the lines say so."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        folder = _run_folder(trainer)
        callback = cast("ModelCheckpoint | None", trainer.checkpoint_callback)  # typed as any Checkpoint
        checkpoints = f"; checkpoints in {callback.dirpath}" if callback is not None and callback.dirpath else ""
        head = f"Run folder {folder}: config.yaml, metrics.csv" if folder else "No run folder (no logger)"
        rank_zero_info(head + checkpoints)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        folder = _run_folder(trainer)
        callback = cast("ModelCheckpoint | None", trainer.checkpoint_callback)  # typed as any Checkpoint
        path = callback.last_model_path or callback.best_model_path if callback is not None else ""
        saved = f"latest checkpoint {path}" if path else "no checkpoint saved"
        head = f"Run folder {folder}: ended" if folder else "Fit ended"
        rank_zero_info(f"{head} at global step {trainer.global_step}; {saved}")


def _run_folder(trainer: L.Trainer) -> str | None:
    """The logger's folder (``trainer.log_dir``, a collective: every rank asks); ``None`` without a logger."""
    return trainer.log_dir if trainer.logger is not None else None
