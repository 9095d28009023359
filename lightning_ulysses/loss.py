"""Token-weighted loss reduction for LightningModules: exact under sequence parallelism.

Each rank of an SP group holds a shard of the same sequences, with its own number of valid
(label != -100) tokens, possibly zero. The loss of the group is the mean over all its valid tokens::

    mean_g = (sum over ranks r in g of S_r) / T_g,    S_r = local sum of token losses,
                                                      T_g = valid tokens of the whole group

A per-rank mean averaged over ranks is wrong (ranks carry different token counts) and NaN on a rank
with no valid tokens; sums and the group's count are exact. How the gradient must be scaled depends on
how the strategy reduces gradients; :class:`UlyssesStrategy` states its contract as
``loss_gradient_scale`` (see the derivation in :mod:`lightning_ulysses.strategy`). The strategy publishes what the
reduction needs for the current batch as a :class:`LossContext` (``strategy.loss_context``); this module reads that
and knows nothing else of the strategy.

``UlyssesStrategy(loss_normalization="global")`` instead weighs every valid token of an optimizer step
equally, across all DP groups and all ``k`` gradient-accumulation micro-batches (torchtitan's and
Megatron's per-token loss). Its denominator ``T_step`` includes micro-batches that have not run yet, so
the training loader is wrapped (:class:`StepTokenCounts`) to read each step's ``k`` batches ahead and
count their valid tokens on the host, before any forward. Rank ``r`` then returns
``L_r = W * k * S_r / T_step`` (``W = dp * sp``): DeepSpeed averages gradients over ``W`` ranks and
Lightning divides by ``k``, so the update is ``sum of all token-loss gradients of the step / T_step``.
The loss *value* is the exact token mean of the current micro-batch over all ranks.

The tiled loss (:mod:`lightning_ulysses.logits`) plugs into the same reduction: it returns a sum, never a
mean of tiles, so the loss stays the exact token mean.

A transformers causal LM called with ``labels=`` (or ``shift_labels=``) under the strategy returns the same reduction
(:func:`labels_loss`, which the strategy hands the patched model): the labels of this rank's shard are shifted over
the whole sequence, as transformers shifts a whole row. Every exact reduction tells the strategy that it ran
(``LossContext.record_exact_reduction``), so that a training step whose loss went through none is refused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_ulysses.attention import gather_sequence
from lightning_ulysses.batch import ShardedBatch
from lightning_ulysses.engines import lightning as lightning_engine
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf import apply_ulysses_attention, remove_ulysses_attention
from lightning_ulysses.hf.check.logits import tiled_logit_map
from lightning_ulysses.liger import liger_loss_sum
from lightning_ulysses.logits import Logits, TiledLogits, cross_entropy_sum, fused_loss_sum, resolve_loss_tiles
from lightning_ulysses.sharding import IGNORE_INDEX, prepare_batch, shard_index
from lightning_ulysses.tiling import TileSetting

if TYPE_CHECKING:
    from lightning.pytorch import Trainer
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class LossContext:
    """What a sequence-parallel strategy publishes for the loss of the current batch (``UlyssesStrategy.loss_context``,
    read per batch).

    ``groups``: the SP groups (the reduction runs over ``groups.sp``); ``normalization``: ``"sp_group"`` or
    ``"global"`` (see the module docstring); ``gradient_scale``: the factor on ``local_sum / group_tokens`` that makes
    gradients exact (``sp_size`` under DeepSpeed's average over all ranks); ``tiled_loss``: the strategy's
    ``tiled_loss`` setting; ``batch``: the running :class:`~lightning_ulysses.batch.ShardedBatch` (``None`` before
    the first), whose padding :func:`labels_loss` never counts, whose repeated rows of evaluation count nowhere and
    whose step token count ``"global"`` divides by; ``accumulate_grad_batches``: the trainer's;
    ``record_exact_reduction``: called by every SP-exact reduction (the strategy refuses a training step whose loss
    went through none); ``liger_loss``: the tiled loss runs Liger's fused linear cross entropy (the strategy's
    ``liger_kernels`` ``"cross_entropy"``).
    """

    groups: SequenceParallelGroups
    normalization: Literal["sp_group", "global"]
    gradient_scale: float
    tiled_loss: TileSetting
    batch: ShardedBatch | None
    accumulate_grad_batches: int
    record_exact_reduction: Callable[[], None]
    liger_loss: bool = False

    @property
    def repeated_rows(self) -> Tensor | None:
        """``[B]`` bool: the running batch's rows repeated to even out the DP ranks (``None``: none)."""
        return None if self.batch is None else self.batch.repeated_rows

    @property
    def padding(self) -> Tensor | None:
        """``[B, N/sp]`` bool: this rank's padding tokens of the running batch (``None``: no batch)."""
        return None if self.batch is None else self.batch.padding


def token_cross_entropy(
    logits: Logits, shift_labels: Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[Tensor, Tensor]:
    """Sum of the next-token cross entropies of ``logits [B, n, V]`` (whole or :class:`TiledLogits`) against
    ``shift_labels [B, n]``, in fp32, and the number of valid (``!= ignore_index``) tokens in it: the two sums
    every exact reduction starts from (the sum by :attr:`TiledLogits.loss_sum` where it is given)."""
    return cross_entropy_sum(logits, shift_labels, ignore_index), (shift_labels != ignore_index).sum()


def token_mean(loss_sum: Tensor, num_valid_tokens: Tensor | int, context: LossContext | None) -> Tensor:
    """The exact token mean of :meth:`UlyssesLossMixin.reduce_token_loss` under ``context`` (``None``: no sequence
    parallelism, the plain mean ``loss_sum / num_valid_tokens``), recorded as an exact reduction."""
    count = torch.as_tensor(num_valid_tokens, dtype=torch.float32, device=loss_sum.device)
    loss_sum = loss_sum.float()
    if context is None:
        return loss_sum / count.clamp(min=1)
    context.record_exact_reduction()
    if context.normalization == "global":
        return _global_token_mean(loss_sum, count, context)
    if context.groups.topology.sp_size == 1:
        return loss_sum / count.clamp(min=1)
    totals = torch.stack([loss_sum.detach(), count])
    dist.all_reduce(totals, group=context.groups.sp)  # not autograd: the gradient path stays local
    denominator = totals[1].clamp(min=1)
    group_mean = totals[0] / denominator
    scaled = loss_sum * (context.gradient_scale / denominator)
    return scaled + (group_mean - scaled).detach()


def labels_loss(
    context: LossContext, logits: Tensor, labels: Tensor | None, shift_labels: Tensor | None, ignore_index: int
) -> Tensor:
    """The loss of a transformers causal LM called with ``labels=`` or ``shift_labels=`` under the strategy: the
    :func:`token_mean` of the next-token cross entropy of ``logits [B, N/sp, V]``, which equals the plain
    model's ``labels=`` loss on one process on the whole sequence (and trains as it does).

    ``shift_labels [B, N/sp]`` (the batch's, already shifted) are taken as they are; else ``labels [B, N/sp]``, this
    rank's shard of unshifted labels (``labels=batch["input_ids"]``), are shifted over the whole sequence
    (:func:`next_token_labels`). Collective over the SP group.
    """
    if shift_labels is None:
        assert labels is not None  # the patched forward routes a call with labels or shift_labels here
        shift_labels = next_token_labels(labels, context, ignore_index)
    if shift_labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"The model was given labels of shape {tuple(shift_labels.shape)} for logits of shape "
            f"{tuple(logits.shape)}: under sequence parallelism pass this rank's shard of the labels, shaped like its "
            "input_ids (e.g. labels=batch['input_ids'] or shift_labels=batch['shift_labels'] of the batch "
            "UlyssesStrategy delivers)."
        )
    return token_mean(*token_cross_entropy(logits, shift_labels, ignore_index), context)


def next_token_labels(labels: Tensor, context: LossContext, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``[B, N/sp]``: the target of each token of this rank's shard of ``labels [B, N/sp]``: the label of the next
    token of the whole sequence (across shard borders, the zigzag of a ring included), as transformers shifts a whole
    row; ``ignore_index`` after a row's last token, on repeated rows, and where the token or the next one is padding
    (``context.padding``: padding neither predicts nor is predicted). Collective over the SP group (one all-gather
    of the labels)."""
    if context.padding is not None:
        labels = labels.masked_fill(context.padding, ignore_index)
    whole = gather_sequence(labels.long(), context.groups)  # [B, N] in sequence order
    shifted = F.pad(whole[:, 1:], (0, 1), value=ignore_index)
    topology = context.groups.topology
    columns = shard_index(whole.shape[1], topology.sp_rank, topology.sp_size, topology.ring_size)
    local = shifted.index_select(1, columns.to(shifted.device))
    if context.padding is not None:
        local = local.masked_fill(context.padding, ignore_index)
    if context.repeated_rows is not None:
        local = local.masked_fill(context.repeated_rows.to(local.device)[:, None], ignore_index)
    return local


class UlyssesLossMixin:
    """Mix into a ``LightningModule`` to reduce token losses exactly, with or without sequence parallelism.

    Under :class:`~lightning_ulysses.UlyssesStrategy` the returned loss *value* is the SP group's token
    mean on every rank of the group (so ``self.log("train_loss", loss)`` shows the true loss), and its
    *gradient* is scaled so that training equals one process seeing the whole sequence. Under any other
    strategy it is the plain token mean of the local batch, and :meth:`forward_causal_lm_loss` and
    :meth:`causal_lm_logits` take the batch as the loader yields it (:meth:`prepared_batch`), so that switching
    strategies to debug runs the same step. DP groups are averaged as DDP does: each SP group's token mean counts
    equally.
    """

    _trainer: Trainer | None
    """The LightningModule's (this mixes into one)."""

    def reduce_token_loss(self, loss_sum: Tensor, num_valid_tokens: Tensor | int) -> Tensor:
        """Mean over every valid token of the SP group's sequences.

        Args:
            loss_sum: scalar, the sum of this rank's token losses (differentiable).
            num_valid_tokens: this rank's number of tokens in ``loss_sum`` (may be 0).
        """
        return token_mean(loss_sum, num_valid_tokens, self._loss_context())

    def causal_lm_loss(self, logits: Logits, shift_labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
        """Next-token cross entropy of ``logits [B, n, V]`` (whole or :class:`TiledLogits`) against
        ``shift_labels [B, n]`` (already shifted, as ``UlyssesStrategy`` delivers them), reduced with
        :meth:`reduce_token_loss`."""
        return self.reduce_token_loss(*token_cross_entropy(logits, shift_labels, ignore_index))

    def tiled_causal_lm_loss(
        self,
        hidden_states: Tensor,
        lm_head: Callable[[Tensor], Tensor],
        shift_labels: Tensor,
        num_tiles: TileSetting | None = None,
        ignore_index: int = IGNORE_INDEX,
        vocab_size: int | None = None,
    ) -> Tensor:
        """:meth:`causal_lm_loss` of ``lm_head(hidden_states [B, n, hidden])``, computed in token tiles so that
        the ``[B * n, vocab]`` logits never exist. Where ``lm_head`` is a module (or ``LogitMap.head`` of one) whose
        parameters are whole on the rank (plain PyTorch, ZeRO 0-2) each tile's backward runs inside the forward
        (:func:`~lightning_ulysses.logits.fused_loss_sum`); else (ZeRO-3, FSDP2, a plain function) each tile's
        logits are recomputed in the backward. ``lm_head`` must make the model's logits: for a transformers model
        that scales or soft-caps them outside its output embeddings,
        ``tiled_logit_map(model).head(model.get_output_embeddings())``.

        ``num_tiles``: an int, or ``True`` for tiles sized by bytes, agreed over ranks
        (:func:`~lightning_ulysses.logits.resolve_loss_tiles`); ``None`` takes the strategy's ``tiled_loss``
        (``True`` when it is off). ``vocab_size``: the logits' last dimension, which ``True`` needs; ``None`` reads it
        from ``lm_head``'s ``[vocab, hidden]`` weight (``lm_head`` a module such as ``nn.Linear``).
        """
        if num_tiles is None:
            context = self._loss_context()
            num_tiles = (context.tiled_loss if context is not None else False) or True
        tiles = resolve_loss_tiles(num_tiles, hidden_states, lm_head, vocab_size)
        logits = TiledLogits(hidden_states, lm_head, tiles, fused_loss_sum(lm_head, tiles))
        return self.causal_lm_loss(logits, shift_labels, ignore_index)

    def forward_causal_lm_loss(self, model: PreTrainedModel, batch: Mapping[str, Tensor]) -> Tensor:
        """Run a transformers causal LM on a batch from ``UlyssesStrategy`` (``input_ids``, ``position_ids``,
        ``shift_labels``, all ``[B, N/sp]``; from another strategy, the loader's batch: :meth:`prepared_batch`) and
        return the exact token-mean loss: :meth:`causal_lm_loss` of :meth:`causal_lm_logits`, tiled when the
        strategy's ``tiled_loss`` is on."""
        batch = self.prepared_batch(model, batch)
        return self.causal_lm_loss(self.causal_lm_logits(model, batch), batch["shift_labels"])

    def prepared_batch(self, model: PreTrainedModel, batch: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """The batch as ``UlyssesStrategy`` delivers it. A batch without ``shift_labels`` (from any other strategy)
        is prepared here, whole (:func:`~lightning_ulysses.sharding.prepare_batch` with ``sp_size=1``), and ``model`` is
        patched to run the same document-masked attention locally (plain SDPA would let packed documents attend to
        each other); :meth:`teardown` removes that patch."""
        if "shift_labels" in batch:
            return batch
        # the first call runs the set-up check, which validate's inference mode breaks
        with torch.inference_mode(False):
            apply_ulysses_attention(model, group=None, attn_implementation="sdpa")  # idempotent
        return prepare_batch(batch, sp_size=1)

    def teardown(self, stage: str) -> None:
        """Remove the local patch of :meth:`prepared_batch` (``UlyssesStrategy`` removes its own at its teardown)."""
        remove_ulysses_attention(cast(torch.nn.Module, self))
        super().teardown(stage)  # type: ignore[misc]  # LightningModule's, which this mixes into

    def causal_lm_logits(self, model: PreTrainedModel, batch: Mapping[str, Tensor]) -> Logits:
        """The logits ``[B, N/sp, V]`` of a transformers causal LM on a batch from ``UlyssesStrategy`` (from another
        strategy, the loader's batch: :meth:`prepared_batch`), for the loss, the evaluation metrics and
        :func:`~lightning_ulysses.prediction.token_log_probs`.

        With the strategy's ``tiled_loss`` on they are :class:`~lightning_ulysses.logits.TiledLogits` of the decoder's
        hidden states and ``model.get_output_embeddings()`` followed by the map from its output to the model's logits
        that the set-up check found (a constant factor, a tanh soft-cap: see
        :mod:`lightning_ulysses.hf.check.logits`), with the tile count of ``tiled_loss`` (``True``: sized by bytes
        and agreed over ranks, :func:`~lightning_ulysses.logits.resolve_loss_tiles`): the ``[tokens, vocab]`` logits
        never exist. Their loss sum is Liger's fused kernel where the strategy's ``liger_kernels`` asks for it, else
        fused tiles where ``lm_head``'s parameters are whole on the rank
        (:func:`~lightning_ulysses.logits.fused_loss_sum`). Otherwise the model's own logits.
        """
        inputs = self.model_inputs(model, self.prepared_batch(model, batch))
        context = self._loss_context()
        if context is None or not context.tiled_loss:
            return model(**inputs).logits
        logit_map, output_embeddings = tiled_logit_map(model), model.get_output_embeddings()
        hidden_states = model.get_decoder()(**inputs).last_hidden_state
        tiles = resolve_loss_tiles(context.tiled_loss, hidden_states, output_embeddings)
        head = logit_map.head(output_embeddings)
        loss_sum = liger_loss_sum(output_embeddings, logit_map) if context.liger_loss else fused_loss_sum(head, tiles)
        return TiledLogits(hidden_states, head, tiles, loss_sum)

    def model_inputs(self, model: PreTrainedModel, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The keyword inputs of the model's (and its decoder's) forward: ``input_ids`` and ``position_ids``."""
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}

    def _loss_context(self) -> LossContext | None:
        """The :class:`LossContext` the trainer's strategy publishes (``None``: a strategy without sequence
        parallelism, or no trainer)."""
        trainer = lightning_engine.attached_trainer(self)
        context = getattr(trainer.strategy, "loss_context", None) if trainer is not None else None
        return context if isinstance(context, LossContext) else None

    def _sp_reduction(self) -> tuple[dist.ProcessGroup | None, float]:
        """The SP process group the token sums are reduced over and the gradient scale (``None, 1.0``: no SP)."""
        context = self._loss_context()
        if context is None or context.groups.topology.sp_size == 1:
            return None, 1.0
        return context.groups.sp, context.gradient_scale

    def _record_exact_reduction(self) -> None:
        """Tell the strategy that this step's loss went through an SP-exact reduction (one of its own, e.g. DPO's)."""
        context = self._loss_context()
        if context is not None:
            context.record_exact_reduction()


def _global_token_mean(loss_sum: Tensor, count: Tensor, context: LossContext) -> Tensor:
    """``loss_normalization="global"``: the gradient of ``sum(all token losses of the step) / T_step``."""
    step_valid_tokens = None if context.batch is None else context.batch.step_valid_tokens
    if step_valid_tokens is None and loss_sum.requires_grad:
        raise RuntimeError(
            "loss_normalization='global' needs each training batch's step token count, which UlyssesStrategy adds "
            "by wrapping the training loader of Trainer.fit; this loss was computed outside that loop."
        )
    topology = context.groups.topology
    group_step_tokens = (step_valid_tokens or 0) if topology.sp_rank == 0 else 0  # one contribution per SP group
    # fp64: a step's token count can pass fp32's exact integers (2**24)
    totals = torch.tensor([0.0, 0.0, group_step_tokens], dtype=torch.float64, device=loss_sum.device)
    totals[0], totals[1] = loss_sum.detach(), count
    dist.all_reduce(totals)  # over every rank: this micro-batch's sums and the step's tokens of all DP groups
    micro_batch_mean = (totals[0] / totals[1].clamp(min=1)).float()
    if step_valid_tokens is None:  # evaluation (no gradient): the value alone, which needs no step count
        return micro_batch_mean
    scaled = loss_sum * (topology.world_size * context.accumulate_grad_batches / totals[2].clamp(min=1)).float()
    return scaled + (micro_batch_mean - scaled).detach()


class StepTokenCounts:
    """Wraps a training loader: reads each optimizer step's ``accumulate`` batches ahead, counts their valid
    next-token labels (as :func:`~lightning_ulysses.sharding.prepare_batch` sets them) and yields the batches as they
    are, queueing the step's count once per batch, in order: the strategy :meth:`take` s the count of each batch it
    transfers (Lightning transfers the batches in the order the loader yields them) into its
    :class:`~lightning_ulysses.batch.ShardedBatch`. Everything else is the wrapped loader's (sampler, length), so
    Lightning still sets the sampler's epoch.

    Steps are grouped from where the epoch's iteration starts (its first batch, or the step boundary a
    checkpoint resumes at), as Lightning groups micro-batches, and never reach past the batches that the epoch
    trains: ``remaining_batches()``, read when the loop fetches the iteration's first batch, caps them
    (``limit_train_batches``; the epoch's last step is shorter when its length is not a multiple of ``accumulate``)."""

    def __init__(self, loader: Any, accumulate: int, remaining_batches: Callable[[], float]) -> None:
        self.loader = loader
        self.accumulate = accumulate
        self.remaining_batches = remaining_batches
        self._counts: deque[int] = deque()  # of the batches yielded and not yet taken
        # a resumable loader's state as attributes, not through __getattr__: from Python 3.12 isinstance against a
        # runtime protocol (Lightning's _Stateful, which decides whether a loader's state is saved and restored)
        # looks attributes up statically, and a mid-epoch resume would restart the epoch's sampler
        if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
            self.state_dict, self.load_state_dict = loader.state_dict, loader.load_state_dict

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def take(self) -> int:
        """The step token count of the oldest batch yielded and not yet taken."""
        if not self._counts:
            raise RuntimeError("A training batch was transferred that StepTokenCounts did not yield.")
        return self._counts.popleft()

    def __iter__(self) -> Iterator[Any]:
        self._counts.clear()  # what an interrupted iteration (a fit stopped inside an epoch) left
        remaining = self.remaining_batches()
        batches = islice(self.loader, None if remaining == float("inf") else int(remaining))
        while step := list(islice(batches, self.accumulate)):
            tokens = sum(int((prepare_batch(batch, 1)["shift_labels"] != IGNORE_INDEX).sum()) for batch in step)
            for batch in step:
                self._counts.append(tokens)
                yield batch
