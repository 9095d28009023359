"""The forward of a patched transformers model: what it takes from the batch before any layer runs.

* It requires ``position_ids``, the global positions of the token shard (transformers would otherwise
  build local positions ``0 .. N/sp - 1`` on every rank, and RoPE would be silently wrong on every
  rank but the first), and keeps them for the attention layers: documents (packed samples, padding
  runs) are read from them, whether or not a layer's call site passes them on;
* it folds a 2-D ``attention_mask`` into that document layout when it marks whole documents (padding that
  :func:`~lightning_ulysses.sharding.prepare_batch` made separate documents), and refuses any other mask;
* it reads bidirectional spans from ``token_type_ids`` where the set-up check found the masks make image tokens
  attend to each other both ways (Gemma 3), and refuses ``token_type_ids`` that the masks read otherwise;
* it switches the KV cache off (it would hold one shard of the sequence);
* in training it draws its random numbers (dropout) from this SP rank's stream (:mod:`lightning_ulysses.hf.dropout`);
* called with ``labels=`` (this rank's shard of unshifted labels) or ``shift_labels=``, it returns the loss of
  ``PatchState.labels_loss`` (``UlyssesStrategy``'s SP-exact token mean, labels shifted over the whole sequence) in
  place of transformers' loss function, which would shift the labels inside the shard; a model that computes its
  loss otherwise, or adds to it (a router's auxiliary loss, from this shard only), is refused;
* once per batch it builds what every layer reuses: the documents, the attention backend's plans for each layer
  pattern, the token mixers' document rows and the tiled MLP's token agreement. Under ``UlyssesStrategy`` the
  documents are those of the whole position ids of the strategy's :class:`~lightning_ulysses.batch.ShardedBatch`
  (found before the batch was cut, ``PatchState.batches``); a model called on other position ids, or without the
  strategy, all-gathers its shard's once per forward.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from lightning_ulysses.attention import documents_of, gather_sequence, plan_batch, plan_spans
from lightning_ulysses.attention.documents import use_whole_rows
from lightning_ulysses.batch import ShardedBatch
from lightning_ulysses.engines import transformers as transformers_engine
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf.dropout import forward_draws
from lightning_ulysses.hf.mixers import plan_document_rows
from lightning_ulysses.hf.state import ForwardBatch, LabelsLoss, PatchState
from lightning_ulysses.sharding import IGNORE_INDEX


def guarded_forward(model: PreTrainedModel, state: PatchState) -> Any:
    """``model``'s forward under sequence parallelism (see the module docstring)."""
    forward = model.forward
    takes_position_ids = "position_ids" in inspect.signature(forward).parameters

    @functools.wraps(forward)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if not state.enabled:
            if state.forward is not None:
                state.forward = replace(state.forward, tokens=None)  # agreed for another batch
            return forward(*args, **kwargs)
        kwargs["use_cache"] = False
        if state.depth == 0:
            _read_batch_layout(kwargs, state, model)
        elif (
            takes_position_ids
            and kwargs.get("position_ids") is None
            and state.forward is not None
            and _tokens(args, kwargs) == _tokens((), {"input_ids": state.forward.position_ids})
        ):
            kwargs["position_ids"] = state.forward.position_ids  # an outer model that does not pass them on
            # (transformers would number this shard's tokens from 0)
        if not takes_position_ids:
            kwargs.pop("position_ids", None)
        positions = None if state.forward is None else state.forward.position_ids
        draws = forward_draws(state.rng, model, state.depth == 0, positions)
        labels_loss = state.labels_loss if state.depth == 0 and _has_labels(kwargs) else None
        state.depth += 1
        try:
            with draws:
                if labels_loss is not None:
                    return _forward_with_labels_loss(forward, args, kwargs, model, labels_loss)
                return forward(*args, **kwargs)
        finally:
            state.depth -= 1

    return guarded


def _has_labels(kwargs: dict[str, Any]) -> bool:
    return kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None


def _forward_with_labels_loss(
    forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any], model: PreTrainedModel, labels_loss: LabelsLoss
) -> Any:
    """``forward(*args, **kwargs)`` of a model given ``labels`` or ``shift_labels``, its loss function replaced by
    ``labels_loss`` for the call; refused where the returned loss is not exactly what ``labels_loss`` returned."""
    name = type(model).__name__
    instead = (
        "Call it without labels and reduce the loss with UlyssesLossMixin (forward_causal_lm_loss(model, batch), or "
        "causal_lm_loss(logits, batch['shift_labels']))."
    )
    if transformers_engine.LOSS_FUNCTION_ATTRIBUTE in model.__dict__:
        raise ValueError(
            f"{name} was given labels with a loss function of your own (model.loss_function), which under sequence "
            f"parallelism would see one shard of the sequence. {instead}"
        )
    if kwargs.get("num_items_in_batch") is not None:
        raise ValueError(
            f"{name} was given num_items_in_batch: under sequence parallelism the loss of a call with labels is the "
            "token mean over the SP group's whole sequences (UlyssesStrategy(loss_normalization='global') for one "
            "token mean over the optimizer step); leave num_items_in_batch out."
        )
    given_shift_labels = kwargs.get("shift_labels")  # taken from here: a model may not pass them on to its loss
    if kwargs.get("labels") is None:  # transformers computes a loss only when given labels (so does the HF Trainer)
        kwargs["labels"] = given_shift_labels
    returned: list[Tensor] = []
    versions: list[int] = []  # of each returned loss: a model may add to it in place (Mixtral's router loss)

    def loss_function(
        logits: Tensor,
        labels: Tensor,
        vocab_size: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        shift_labels: Tensor | None = None,
        **_: Any,
    ) -> Tensor:
        shift_labels = given_shift_labels if shift_labels is None else shift_labels
        returned.append(labels_loss(logits, labels, shift_labels, ignore_index))
        versions.append(returned[-1]._version)
        return returned[-1]

    model.loss_function = loss_function
    try:
        output = forward(*args, **kwargs)
    finally:
        del model.__dict__[transformers_engine.LOSS_FUNCTION_ATTRIBUTE]
    loss = output.get("loss") if isinstance(output, Mapping) else output[0]
    if not returned:
        raise ValueError(
            f"{name} computes its loss from labels without transformers' loss_function, shifting the labels inside "
            f"this rank's shard of the sequence. {instead}"
        )
    if len(returned) > 1 or loss is not returned[0] or loss._version != versions[0]:
        raise ValueError(
            f"{name} returns a loss other than that of its loss function (e.g. plus a router's auxiliary loss), "
            f"which under sequence parallelism is computed from this rank's shard only. {instead}"
        )
    return output


def _tokens(args: tuple, kwargs: dict[str, Any]) -> int | None:
    """The sequence length of a model call's ``input_ids`` / ``inputs_embeds`` (``[B, N, ...]``), if it has them."""
    inputs = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
    return inputs.shape[1] if isinstance(inputs, Tensor) and inputs.dim() >= 2 else None


def _read_batch_layout(kwargs: dict[str, Any], state: PatchState, model: PreTrainedModel) -> None:
    """Build, once per batch, what every layer reuses: the documents and the attention backend's plans for each layer
    pattern, the MLP tile agreement, and the :class:`ForwardBatch` the layers read (``state.forward``)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError(
            "Under sequence parallelism the model must be called with the global position ids of its token shard, "
            "e.g. model(input_ids=batch['input_ids'], position_ids=batch['position_ids']) with the batch that "
            "UlyssesStrategy sharded. Without them transformers builds local positions 0..N/sp-1 and RoPE is wrong on "
            "every rank but the first."
        )
    position_ids = text_position_ids(position_ids)
    batch = state.batches() if state.batches is not None else None
    if batch is not None and _is_shard_of(position_ids, batch):
        use_whole_rows(position_ids, batch.position_ids, batch.documents_by_chunk, state.group)
    mask = kwargs.pop("attention_mask", None)
    if mask is not None:
        check_foldable_attention_mask(mask, position_ids, state.group)
    spans = _spans_of_batch(kwargs.get("token_type_ids"), state, model)
    plan_batch(position_ids, state.group, state.core, _layer_patterns(model))
    if spans is not None:
        plan_spans(spans, position_ids, state.group)
    if state.sharded_mixers:
        plan_document_rows(position_ids, state.group)
    agreed = None
    if state.agree_tokens is not None:
        tokens = position_ids.shape[-2:].numel()  # [B, N/sp], or [sections, B, N/sp] (multimodal RoPE)
        agreed = (tokens, state.agree_tokens(tokens, position_ids.device))
    state.forward = ForwardBatch(position_ids, spans, agreed)


def _is_shard_of(position_ids: Tensor, batch: ShardedBatch) -> bool:
    """Whether ``position_ids [B, N/sp]`` are ``batch``'s shard: the tensor the strategy delivered, or equal to it (a
    multimodal model's text positions, sliced from the ``[4, B, N/sp]`` that its step built; one host sync)."""
    shard = batch.inputs.get("position_ids")
    if position_ids is shard:
        return True
    return isinstance(shard, Tensor) and shard.shape == position_ids.shape and torch.equal(shard, position_ids)


def _spans_of_batch(token_types: Tensor | None, state: PatchState, model: PreTrainedModel) -> Tensor | None:
    """``[B, N/sp]`` bool: the shard's tokens of bidirectional spans (``token_type_ids == 1`` where the set-up check
    found the masks make them so, Gemma 3's images), or ``None``. ``token_type_ids`` that the masks read otherwise
    are refused."""
    if token_types is None or state.token_types == "":
        return None
    if state.token_types != "spans":
        raise ValueError(
            f"{type(model).__name__} was given token_type_ids, which its attention masks read in a way Ulysses "
            f"attention does not run ({state.token_types}). Train it without token_type_ids."
        )
    return token_types == 1


def text_position_ids(position_ids: Tensor) -> Tensor:
    """``[B, N/sp]``: the positions that number the documents. Multimodal RoPE position ids come as
    ``[4, B, N/sp]``, the text positions first (the layout transformers' Qwen-VL models take for packed samples);
    ``[3, B, N/sp]`` (temporal, height, width only) cannot tell where documents start and is refused."""
    if position_ids.dim() == 2:
        return position_ids
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:
        return position_ids[0]
    raise ValueError(
        f"Position ids of shape {tuple(position_ids.shape)}: under sequence parallelism a model takes [B, N/sp] "
        "positions, or multimodal RoPE positions as [4, B, N/sp] with the text positions (restarting at 0 per "
        "document) first; lightning_ulysses.VisionLanguageModel builds them."
    )


def _layer_patterns(model: PreTrainedModel) -> set[tuple[int | None, int | None]]:
    """The ``(chunk, window)`` of every attention layer that the set-up check planned (none before it ran)."""
    return {
        (plan.pattern.chunk, plan.pattern.window)
        for module in model.modules()
        if (plan := module.__dict__.get("_ulysses_plan")) is not None
    }


def check_foldable_attention_mask(mask: Tensor, position_ids: Tensor, group: SequenceParallelGroups) -> None:
    """Accept a 2-D padding mask ``[B, N/sp]`` only when it is constant over every document of the position ids.

    Such a mask marks padding that is already a document of its own (as
    :func:`~lightning_ulysses.sharding.prepare_batch` lays it out), which attention never crosses: dropping it changes
    nothing for the real tokens. Anything else (a 4-D mask, padding inside a document) is refused. Collective over
    ``group`` (one all-gather per forward).
    """
    if mask.dim() != 2 or mask.shape != position_ids.shape:
        raise ValueError(
            f"The model received an attention_mask of shape {tuple(mask.shape)}; under sequence parallelism only a "
            f"2-D padding mask shaped like the position ids {tuple(position_ids.shape)} can be taken (it is "
            "folded into the document layout). Put padding in the batch (attention_mask / position_ids) and let "
            "UlyssesStrategy prepare it."
        )
    whole_mask = gather_sequence(mask.bool(), group)
    starts = documents_of(position_ids, group).starts
    changes = whole_mask[:, 1:] != whole_mask[:, :-1]
    if bool((changes & ~starts[:, 1:]).any()):
        raise ValueError(
            "The attention_mask passed to the model masks tokens inside a document (a run of position ids that does "
            "not restart at 0), which Ulysses attention cannot express without an [N, N] mask. Pass the mask in the "
            "batch so that UlyssesStrategy turns padding into separate documents, or restart position_ids at 0 after "
            "padding."
        )
