"""Direct preference optimisation (DPO, Rafailov et al. 2023) under sequence parallelism, exact.

For a pair with prompt ``x``, chosen ``y_c`` and rejected ``y_r``::

    loss = -log sigmoid(beta * ((log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))))

averaged over the pairs of a micro-batch. Each ``log pi(y|x)`` is a sum of token log-probabilities over the
completion, whose tokens lie on every rank of the SP group. Each rank sums its own tokens per sequence (``[B, 2]``)
and the sums are all-reduced over the group, so every rank holds the whole sequences' log-probabilities and the same
loss; the gradient flows only through the rank's own sums, scaled by the strategy's ``loss_gradient_scale`` as in
:class:`~lightning_ulysses.UlyssesLossMixin`, so DeepSpeed's average over ranks gives one process's gradient.

The reference model is frozen and runs under the same strategy (patched, and partitioned under ZeRO-3) on the same
shards, with no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoModelForCausalLM

from lightning_ulysses.finetune.dpo_data import CHOSEN, REJECTED
from lightning_ulysses.hf import apply_ulysses_attention
from lightning_ulysses.model import CausalLM, _local_folder, _transformers_zero3
from lightning_ulysses.prediction import token_log_probs


def dpo_loss(policy: Tensor, reference: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """Per-pair loss ``[B]`` and rewards ``[B, 2]`` (``beta * (policy - reference)``, chosen then rejected) from the
    sequence log-probabilities ``[B, 2]`` of the policy and of the reference."""
    rewards = beta * (policy - reference)
    return -F.logsigmoid(rewards[:, CHOSEN] - rewards[:, REJECTED]), rewards.detach()


class DPO(CausalLM):
    """DPO of a causal LM on :class:`~lightning_ulysses.finetune.PreferenceDataModule` batches.

    Args:
        model: the local folder of the model to train (usually the SFT result), with ``pretrained=True``; or a config
            dict, then ``reference`` is required.
        reference: local folder of the frozen reference model; ``None``: the same folder as ``model``.
        beta: the DPO temperature (larger: stay closer to the reference).
        **kwargs: the other arguments of :class:`~lightning_ulysses.CausalLM` (optimizer, schedule, ...).

    Logs per step (``train_``) and per validation (``val_``): ``loss``, ``rewards_chosen`` and ``rewards_rejected``
    (means of ``beta * (log pi - log ref)`` of the sequences), ``rewards_margin`` (their difference) and
    ``rewards_accuracy`` (share of pairs whose chosen reward is the larger), over the pairs of every DP group: in
    evaluation each pair once, as one process counts them (the pairs repeated to even out the DP ranks weigh 0).
    """

    def __init__(
        self,
        model: dict[str, Any] | str,
        pretrained: bool = False,
        reference: str | None = None,
        beta: float = 0.1,
        vocab_size: int | None = None,
        learning_rate: float = 5e-7,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        gradient_checkpointing: bool = False,
        lr_schedule_steps: int | None = None,
    ) -> None:
        super().__init__(
            model,
            pretrained,
            vocab_size,
            learning_rate,
            weight_decay,
            betas,
            warmup_steps,
            min_lr_ratio,
            gradient_checkpointing,
            lr_schedule_steps,
        )
        if reference is None and not pretrained:
            raise ValueError(
                "DPO needs a reference model: a pretrained model.model folder (the reference is then the same folder) "
                "or model.reference=<local model folder>."
            )
        self.reference: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.reference is not None:
            return
        super().configure_model()
        # hparams: an AttributeDict of the constructor's arguments, typed as any mutable mapping
        folder = _local_folder(self.hparams.reference or self.hparams.model)  # type: ignore[attr-defined]
        with _transformers_zero3(self._trainer.strategy if self._trainer is not None else None):
            self.reference = AutoModelForCausalLM.from_pretrained(
                folder, attn_implementation="sdpa", dtype=torch.get_default_dtype()
            )
        self.reference.requires_grad_(False)
        self.reference.eval()  # as from_pretrained returns it; the policy trains in train mode (CausalLM)

    def _prepared(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        if "shift_labels" not in batch:  # not under UlyssesStrategy: the reference runs the local attention too
            assert self.reference is not None  # configure_model has run
            apply_ulysses_attention(self.reference, group=None, attn_implementation="sdpa")
        return super()._prepared(batch)

    def sequence_log_probs(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
        """``[B, 2]`` log-probabilities of the chosen and rejected completions, summed over the whole sequences."""
        log_probs = token_log_probs(self._logits_of(model, batch), batch["shift_labels"])  # [B, N/sp], 0 off-label
        local = torch.stack([(log_probs * (batch["sequence_ids"] == s)).sum(-1) for s in (CHOSEN, REJECTED)], dim=-1)
        group, gradient_scale = self._sp_reduction()
        if group is None:
            return local
        total = local.detach().clone()
        dist.all_reduce(total, group=group)  # not autograd: each rank's gradient comes from its own tokens
        self._record_exact_reduction()
        scaled = local * gradient_scale
        return scaled + (total - scaled).detach()

    @staticmethod
    def _logits_of(model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits

    def _step(self, batch: dict[str, Tensor], prefix: str) -> Tensor:
        context = self._loss_context()
        if context is not None and context.normalization == "global":
            raise ValueError("DPO averages pairs, not tokens: use UlyssesStrategy(loss_normalization='sp_group').")
        batch = self._prepared(batch)
        assert self.model is not None and self.reference is not None  # configure_model has run
        policy = self.sequence_log_probs(self.model, batch)
        self.reference.eval()  # an on_validation_model_train hook may put the whole module in train mode
        with torch.no_grad():
            reference = self.sequence_log_probs(self.reference, batch)
        losses, rewards = dpo_loss(policy, reference, self.hparams.beta)  # type: ignore[attr-defined]  # as above
        chosen, rejected = rewards[:, CHOSEN], rewards[:, REJECTED]
        per_pair = {
            "loss": losses.detach(),
            "rewards_chosen": chosen,
            "rewards_rejected": rejected,
            "rewards_margin": chosen - rejected,
            "rewards_accuracy": (chosen > rejected).float(),
        }
        counted = self._counted_pairs(len(losses))
        pairs = int(counted.sum())
        # every SP rank holds the same values; Lightning averages the batches of all DP groups weighted by batch_size:
        # the mean over every counted pair (a batch of repeats logs 0 with weight 0)
        for key, value in per_pair.items():  # the loss also on the console's progress lines, as CausalLM's
            mean = (value * counted.to(value.device)).sum() / max(pairs, 1)
            self.log(f"{prefix}_{key}", mean, prog_bar=key == "loss", sync_dist=True, batch_size=pairs)
        return losses.mean()

    def _counted_pairs(self, batch_size: int) -> Tensor:
        """``[B]`` bool: the pairs of the batch that count in the metrics, all but the repeats that the distributed
        sampler adds to even out the DP ranks in evaluation (``UlyssesStrategy.repeated_rows``)."""
        context = self._loss_context()
        repeated = context.repeated_rows if context is not None else None
        return torch.ones(batch_size, dtype=torch.bool) if repeated is None else ~repeated

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def on_validation_epoch_end(self) -> None:
        """The metrics are logged by the steps (``CausalLM``'s token loss is not computed)."""

    def on_test_epoch_end(self) -> None:
        """The metrics are logged by the steps."""
