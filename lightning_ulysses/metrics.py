"""Token-level evaluation metrics that are exact under sequence and data parallelism.

Under :class:`~lightning_ulysses.UlyssesStrategy` every token of an evaluation batch lives on exactly
one rank: the ``sp`` ranks of an SP group hold disjoint ``[B, N/sp]`` shards of the same sequences and
the DP groups hold different sequences. A metric whose state is *sums* (token losses, correct
predictions, valid tokens), summed over every rank, therefore equals the metric of one process that
saw every sequence whole. Averages of per-rank or per-batch means do not: shards and batches carry
different numbers of valid tokens (padding, masked prompts), possibly none.

The metrics below keep only such sums and let torchmetrics reduce them over the default (world)
process group, i.e. over SP *and* DP ranks, when Lightning computes them at the end of the epoch::

    def validation_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        self.val_loss.update(logits, batch["shift_labels"])
        self.log("val_loss", self.val_loss)

With ``UlyssesStrategy(tiled_loss=...)`` pass the :class:`~lightning_ulysses.logits.TiledLogits` of
:meth:`~lightning_ulysses.UlyssesLossMixin.causal_lm_logits` instead of the logits: the metrics then never
build the ``[tokens, vocab]`` logits (each metric runs ``lm_head`` over its own tiles), with the same values.

torchmetrics' own ``text.Perplexity(ignore_index=-100)`` and ``MulticlassAccuracy(average="micro",
ignore_index=-100)`` keep such sums too and are exact with whole logits (``tests/test_eval.py`` checks them
under SP and DP against one process); use them freely there. These stay because they also take
:class:`~lightning_ulysses.logits.TiledLogits` (``tiled_loss``), where the ``[tokens, vocab]`` logits that torchmetrics
needs never exist, and because the mean token loss itself has no torchmetrics counterpart.

Do not pass an SP or DP ``process_group``: the sum must cover both. The samples that the distributed sampler
repeats to even out the DP ranks (the dataset size not a multiple of ``dp_size``) reach the metrics with masked
labels (:mod:`lightning_ulysses.runtime.eval_data`), so each sample counts once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_ulysses.logits import Logits, token_hits
from lightning_ulysses.loss import token_cross_entropy
from lightning_ulysses.sharding import IGNORE_INDEX


class _TokenSumMetric(Metric):
    """A ratio of two sums over valid tokens: ``total / count``, both summed over all ranks."""

    full_state_update = False
    total: Tensor  # the states that add_state registers
    count: Tensor
    is_differentiable = False
    higher_is_better: bool | None = None

    def __init__(self, ignore_index: int = IGNORE_INDEX, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def _accumulate(self, total: Tensor, count: Tensor) -> None:
        self.total += total.detach().double()
        self.count += count.detach().long()

    def _mean(self) -> Tensor:
        if self.count == 0:
            raise RuntimeError(
                f"{type(self).__name__} saw no valid tokens (labels != {self.ignore_index}) on any rank; "
                "check the evaluation data and its labels."
            )
        return (self.total / self.count).float()


class TokenCrossEntropy(_TokenSumMetric):
    """Mean next-token cross entropy over every valid token of every rank.

    ``update(logits [B, n, V], shift_labels [B, n])`` with this rank's shard (``n = N / sp``; the logits whole
    or as :class:`~lightning_ulysses.logits.TiledLogits`) and the already shifted labels that
    :class:`~lightning_ulysses.UlyssesStrategy` delivers.
    """

    higher_is_better = False

    def update(self, logits: Logits, shift_labels: Tensor) -> None:
        self._accumulate(*token_cross_entropy(logits, shift_labels, self.ignore_index))

    def compute(self) -> Tensor:
        return self._mean()


class Perplexity(TokenCrossEntropy):
    """``exp`` of :class:`TokenCrossEntropy`: the perplexity of one process over the whole sequences."""

    def compute(self) -> Tensor:
        return self._mean().exp()


class TokenAccuracy(_TokenSumMetric):
    """Fraction of valid tokens whose argmax prediction equals the label, over every rank.

    ``update(logits [B, n, V], shift_labels [B, n])`` as for :class:`TokenCrossEntropy`.
    """

    higher_is_better = True

    def update(self, logits: Logits, shift_labels: Tensor) -> None:
        hits = token_hits(logits, shift_labels, self.ignore_index)
        self._accumulate(hits.sum(), (shift_labels != self.ignore_index).sum())

    def compute(self) -> Tensor:
        return self._mean()
