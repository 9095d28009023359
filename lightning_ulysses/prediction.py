"""Prediction under sequence parallelism: per-token outputs back in whole-sequence order.

Each rank of an SP group computes outputs for its ``[B, N/sp]`` shard; :func:`gather_sequence` is the
inverse of :func:`~lightning_ulysses.shard_batch` for one tensor and gives every rank of the group the
``[B, N, ...]`` result in sequence order (``N`` includes the padding that made it a multiple of ``sp``,
always at the end of the rows: slice it off with the original length). DP ranks keep their own samples,
as with DDP: write them with a :class:`~lightning.pytorch.callbacks.BasePredictionWriter`.
"""

from __future__ import annotations

from torch import Tensor

from lightning_ulysses.attention import gather_sequence
from lightning_ulysses.logits import Logits, token_losses
from lightning_ulysses.sharding import IGNORE_INDEX

__all__ = ["gather_sequence", "token_log_probs"]


def token_log_probs(logits: Logits, shift_labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``[B, n]`` fp32 log-probability of each next-token label under ``logits [B, n, V]`` (whole or
    :class:`~lightning_ulysses.TiledLogits`, which never builds them); 0 where ignored."""
    return 0.0 - token_losses(logits, shift_labels, ignore_index)  # 0 - 0 is +0 where ignored
