"""Where a ``lightning-ulysses fit`` writes: one line at its start and one at its end (rank zero).

Every fit, a resumed one too, gets a new run folder (``runs/<name>/version_N``, numbered by the logger), so the
commands that follow a resume must name that folder; these lines say which it is.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class RunFolderReport(Callback):
    """``Run folder <log_dir>: config.yaml, metrics.csv; checkpoints in <dirpath>`` when fit starts, and
    ``Run folder <log_dir>: ended at global step N; latest checkpoint <last.ckpt>`` when it ends (after the last
    save)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        folder = trainer.log_dir  # a collective: every rank asks
        callback = trainer.checkpoint_callback
        checkpoints = f"; checkpoints in {callback.dirpath}" if callback is not None and callback.dirpath else ""
        rank_zero_info(f"Run folder {folder}: config.yaml, metrics.csv{checkpoints}")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        folder = trainer.log_dir
        callback = trainer.checkpoint_callback
        path = callback.last_model_path or callback.best_model_path if callback is not None else ""
        saved = f"latest checkpoint {path}" if path else "no checkpoint saved"
        rank_zero_info(f"Run folder {folder}: ended at global step {trainer.global_step}; {saved}")
