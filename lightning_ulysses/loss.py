"""Token-weighted loss reduction for LightningModules: exact under sequence parallelism.

Each rank of an SP group holds a shard of the same sequences, with its own number of valid
(label != -100) tokens, possibly zero. The loss of the group is the mean over all its valid tokens::

    mean_g = (sum over ranks r in g of S_r) / T_g,    S_r = local sum of token losses,
                                                      T_g = valid tokens of the whole group

A per-rank mean averaged over ranks is wrong (ranks carry different token counts) and NaN on a rank
with no valid tokens; sums and the group's count are exact. How the gradient must be scaled depends on
how the strategy reduces gradients; :class:`UlyssesStrategy` states its contract as
``loss_gradient_scale`` (see the derivation in :mod:`lightning_ulysses.strategy`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_ulysses.sharding import IGNORE_INDEX


def token_cross_entropy(logits: Tensor, shift_labels: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """Sum of the next-token cross entropies of ``logits [B, n, V]`` against ``shift_labels [B, n]``, in fp32,
    and the number of valid (``!= ignore_index``) tokens in it: the two sums every exact reduction starts from."""
    loss_sum = F.cross_entropy(
        logits.flatten(0, -2).float(), shift_labels.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    return loss_sum, (shift_labels != ignore_index).sum()


class UlyssesLossMixin:
    """Mix into a ``LightningModule`` to reduce token losses exactly, with or without sequence parallelism.

    Under :class:`~lightning_ulysses.UlyssesStrategy` the returned loss *value* is the SP group's token
    mean on every rank of the group (so ``self.log("train_loss", loss)`` shows the true loss), and its
    *gradient* is scaled so that training equals one process seeing the whole sequence. Under any other
    strategy it is the plain token mean of the local batch. DP groups are averaged as DDP does: each SP
    group's token mean counts equally.
    """

    def reduce_token_loss(self, loss_sum: Tensor, num_valid_tokens: Tensor | int) -> Tensor:
        """Mean over every valid token of the SP group's sequences.

        Args:
            loss_sum: scalar, the sum of this rank's token losses (differentiable).
            num_valid_tokens: this rank's number of tokens in ``loss_sum`` (may be 0).
        """
        count = torch.as_tensor(num_valid_tokens, dtype=torch.float32, device=loss_sum.device)
        loss_sum = loss_sum.float()
        group, gradient_scale = self._sp_reduction()
        if group is None:
            return loss_sum / count.clamp(min=1)
        totals = torch.stack([loss_sum.detach(), count])
        dist.all_reduce(totals, group=group)  # not autograd: the gradient path stays local
        denominator = totals[1].clamp(min=1)
        group_mean = totals[0] / denominator
        scaled = loss_sum * (gradient_scale / denominator)
        return scaled + (group_mean - scaled).detach()

    def causal_lm_loss(self, logits: Tensor, shift_labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
        """Next-token cross entropy of ``logits [B, n, V]`` against ``shift_labels [B, n]`` (already shifted,
        as ``UlyssesStrategy`` delivers them), reduced with :meth:`reduce_token_loss`."""
        return self.reduce_token_loss(*token_cross_entropy(logits, shift_labels, ignore_index))

    def _sp_reduction(self) -> tuple[dist.ProcessGroup | None, float]:
        from lightning_ulysses.strategy import UlyssesStrategy

        trainer = getattr(self, "_trainer", None)
        strategy = trainer.strategy if trainer is not None else None
        if not isinstance(strategy, UlyssesStrategy) or strategy.sp_size == 1:
            return None, 1.0
        return strategy.sp_group, strategy.loss_gradient_scale
