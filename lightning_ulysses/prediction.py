"""Prediction under sequence parallelism: per-token outputs back in whole-sequence order.

Each rank of an SP group computes outputs for its ``[B, N/sp]`` shard; :func:`gather_sequence` is the
inverse of :func:`~lightning_ulysses.sharding.shard_batch` for one tensor and gives every rank of the group the
``[B, N, ...]`` result in sequence order (``N`` includes the padding that made it a multiple of ``sp``,
always at the end of the rows: slice it off with the original length). DP ranks keep their own samples,
as with DDP: :class:`PredictionWriter` (which ``lightning-ulysses predict`` adds) writes each DP group's to a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor

from lightning_ulysses.attention import gather_sequence
from lightning_ulysses.logits import Logits, token_losses
from lightning_ulysses.sharding import IGNORE_INDEX

__all__ = ["PredictionWriter", "gather_sequence", "token_log_probs"]


def token_log_probs(logits: Logits, shift_labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``[B, n]`` fp32 log-probability of each next-token label under ``logits [B, n, V]`` (whole or
    :class:`~lightning_ulysses.logits.TiledLogits`, which never builds them); 0 where ignored."""
    return 0.0 - token_losses(logits, shift_labels, ignore_index)  # 0 - 0 is +0 where ignored


class PredictionWriter(BasePredictionWriter):
    """Writes the outputs of ``trainer.predict`` to ``predictions.pt`` (``predictions-dp{R}.pt`` per DP group when
    ``dp_size > 1``) in ``output_dir`` (default: the Trainer's ``log_dir``), once per epoch.

    The file holds ``{"predictions": [one output per batch], "batch_indices": [per dataloader, the dataset indices of
    each batch]}``
    on the CPU; under :class:`~lightning_ulysses.UlyssesStrategy` each group's SP rank 0 writes it (its peers hold
    the same outputs, gathered in sequence order).
    """

    def __init__(self, output_dir: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.output_dir = output_dir

    def write_on_epoch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Any, batch_indices: Any
    ) -> None:
        strategy = trainer.strategy
        folder = Path(self.output_dir or trainer.log_dir or trainer.default_root_dir)  # log_dir: a collective
        if getattr(strategy, "sp_rank", 0) != 0:
            return
        dp_rank, dp_size = (
            getattr(strategy, "dp_rank", trainer.global_rank),
            getattr(strategy, "dp_size", trainer.world_size),
        )
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / ("predictions.pt" if dp_size == 1 else f"predictions-dp{dp_rank}.pt")
        torch.save({"predictions": move_data_to_device(predictions, "cpu"), "batch_indices": batch_indices}, path)
        print(f"Wrote the predictions of {len(predictions)} batches to {path} (torch.load it).", flush=True)
