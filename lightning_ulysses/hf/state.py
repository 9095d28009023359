"""What the set-up check and the applier share: the state of one patch, the refusal, the models a module holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from lightning_ulysses.attention.head_chunks import HeadChunks
from lightning_ulysses.batch import BatchSource
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf.dropout import SequenceParallelRNG

SequenceMixers = Literal["refuse", "gather"]

ProbeAttention = Callable[..., Tensor]
"""``(module, query, key, value, attention_mask, scaling, kwargs) -> [B, N, H, D_v]``: what every patched attention
layer computes while the set-up check probes the model (:mod:`lightning_ulysses.hf.check`)."""


LabelsLoss = Callable[[Tensor, Tensor | None, Tensor | None, int], Tensor]
"""``(logits [B, N/sp, V], labels [B, N/sp] | None, shift_labels [B, N/sp] | None, ignore_index) -> loss``: what a
patched model called with ``labels=`` or ``shift_labels=`` returns as its loss (``UlyssesStrategy`` sets it: the
SP-exact token mean, :func:`lightning_ulysses.loss.labels_loss`)."""


class UnsupportedModelError(ValueError):
    """A model that sequence parallelism cannot run exactly, refused at set-up (before any data or step).

    The message names each offending layer, the feature and what to do instead.
    """


@dataclass(frozen=True)
class ForwardBatch:
    """What the outermost patched forward read from its call, for every layer of that forward and of its recomputation
    in the backward (the next outermost forward replaces it).

    ``position_ids``: ``[B, N/sp]`` the global text positions of the shard (the documents are found from them, or from
    the strategy's :class:`~lightning_ulysses.batch.ShardedBatch` they belong to); ``spans``: ``[B, N/sp]`` bool, the
    shard's tokens of bidirectional spans (``PatchState.token_types == "spans"`` and the model was given
    ``token_type_ids``), else ``None``; ``tokens``: ``(this rank's tokens, the most tokens of any rank)``, agreed once
    per batch when ``PatchState.agree_tokens`` is set, else ``None``.
    """

    position_ids: Tensor
    spans: Tensor | None = None
    tokens: tuple[int, int] | None = None


@dataclass
class PatchState:
    """Shared by every module that one :func:`~lightning_ulysses.hf.apply_ulysses_attention` call patched: the patch's
    configuration, the switches of its forward (``enabled``, ``depth``, ``probe``) and, as one object, what the latest
    outermost forward read from its batch (``forward``)."""

    group: SequenceParallelGroups
    """The SP groups the patched layers run over (their own view for a model patched without the strategy's:
    :meth:`~lightning_ulysses.groups.SequenceParallelGroups.of`), so that the model keeps each batch's documents in
    their cache whatever it was given."""
    core: str
    sp_size: int
    enabled: bool = True
    """``False`` inside :func:`~lightning_ulysses.hf.apply.unpatched`: the model runs as plain transformers."""
    depth: int = 0
    """Nesting of patched forwards (a vision-language model calls its language model): the outermost one reads the
    batch."""
    sharded_mixers: bool = False
    """Token mixers run head-sharded (:mod:`lightning_ulysses.hf.mixers`): their document rows are planned per batch."""
    gather_mixers: bool = False
    """Run token mixers other than attention on the whole sequence (:mod:`lightning_ulysses.hf.mixers`) instead of
    refusing the model."""
    agree_tokens: Callable[[int, torch.device], int] | None = None
    """Set by ``tiled_mlp=True`` (:mod:`lightning_ulysses.memory`): ``(tokens, device) -> the most tokens of any rank``,
    agreed once per batch, so that every MLP call of the batch finds its tile count without a collective or a host
    sync."""
    probe: ProbeAttention | None = None
    """Set only while the set-up check runs: every patched attention layer computes this instead."""
    token_types: str = ""
    """The plan's verdict on ``token_type_ids`` (:attr:`~lightning_ulysses.hf.plan.ModelPlan.token_types`)."""
    head_chunks: HeadChunks | None = None
    """``UlyssesStrategy(head_chunks=...)``: every layer's ``ulysses_attention(head_chunks=...)``
    (:mod:`lightning_ulysses.attention.head_chunks`)."""
    rng: SequenceParallelRNG | None = None
    """This SP rank's RNG stream, which the model's forward draws from in training (dropout masks of its own,
    :mod:`lightning_ulysses.hf.dropout`); ``None`` without sequence parallelism."""
    labels_loss: LabelsLoss | None = None
    """The loss of a call with ``labels=`` / ``shift_labels=`` (:mod:`lightning_ulysses.hf.forward`); ``None``: the
    model's own (which would shift the labels inside each shard)."""
    batches: BatchSource | None = None
    """Where the running :class:`~lightning_ulysses.batch.ShardedBatch` is (``UlyssesStrategy.sharded_batch``): a
    forward on its shard of position ids reads the documents of its whole rows (:mod:`lightning_ulysses.hf.forward`);
    ``None``: the forward all-gathers the shard's."""
    forward: ForwardBatch | None = None
    """What the latest outermost forward read from its call (kept for the recomputation in the backward); ``None``
    before the first."""


def outermost_models(module: nn.Module) -> list[PreTrainedModel]:
    """The outermost transformers ``PreTrainedModel`` instances inside ``module`` (not the models inside them)."""
    found: list[PreTrainedModel] = []
    inner: set[int] = set()
    for sub in module.modules():  # pre-order: a model comes before the models inside it
        if isinstance(sub, PreTrainedModel) and id(sub) not in inner:
            found.append(sub)
            inner.update(id(m) for m in sub.modules())
    return found


def model_configs(model: PreTrainedModel) -> list[PretrainedConfig]:
    """Every config object of ``model``, its sub-configs (text, vision, ...) included, each once."""
    found: dict[int, PretrainedConfig] = {}
    pending = [sub.config for sub in model.modules() if isinstance(sub, PreTrainedModel)]
    while pending:
        config = pending.pop()
        if id(config) not in found:
            found[id(config)] = config
            pending += [getattr(config, key) for key in config.sub_configs if getattr(config, key, None) is not None]
    return list(found.values())
