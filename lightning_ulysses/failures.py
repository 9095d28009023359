"""Failing loudly and together: a check that every rank runs, so that all ranks stop at the same step.

A rank that stops alone leaves the others blocked in their next collective until the process-group
timeout (``UlyssesStrategy(timeout=...)``, which also bounds the SP and DP subgroups' collectives).
A non-finite loss on one rank would otherwise spread NaN weights to every rank through the gradient
reduction without a word; :func:`check_finite_loss` turns it into the same error on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def nonfinite_ranks(loss: Tensor) -> list[int]:
    """The global ranks whose ``loss`` has a NaN or inf (a collective: every rank must call it)."""
    flags = torch.zeros(dist.get_world_size(), device=loss.device)
    flags[dist.get_rank()] = (~torch.isfinite(loss.detach())).any().float()
    dist.all_reduce(flags)
    return flags.nonzero().flatten().tolist()


def check_finite_loss(loss: Tensor, global_step: int, batch_idx: int) -> None:
    """Raise the same :class:`FloatingPointError` on every rank if ``loss`` is not finite on some rank."""
    ranks = nonfinite_ranks(loss)
    if ranks:
        raise FloatingPointError(
            f"Non-finite training loss at global step {global_step} (batch {batch_idx} of the epoch) on ranks {ranks}. "
            "Every rank stops here, before the optimizer step would spread it to the weights. Look for overflow "
            "(lower the learning rate, clip gradients, use bf16 instead of fp16) or bad samples in that batch."
        )
