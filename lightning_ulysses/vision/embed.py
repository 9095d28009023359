"""A shard's input embeddings with its images merged in, from the vision rows that the whole-sequence step numbered.

Every rank holds all of the batch's pixels and its own ``[B, N/sp]`` shard of ``input_ids`` and ``vision_rows``.
Which items (images, videos) a rank runs the vision tower on:

* ``encode="shard"``: those with at least one placeholder in its shard (an item cut by a shard border is encoded by
  both ranks); no communication;
* ``encode="exchange"``: a share of the batch's items, balanced by embedding rows over the SP group
  (:func:`balanced_owners`, the same on every rank), whose embeddings are then all-gathered; in the backward each
  item's embedding gradient is summed over the ranks and back-propagated by its owner only. Vision compute per rank
  approaches ``1/sp`` of the batch's, at ``(sp - 1) / sp`` of the batch's embedding bytes received per rank;
* ``encode="all"``: every item of the batch.

An item's embeddings do not depend on the other items encoded with it (each is encoded on its own patches), and
each item's gradient reaches the tower once over the SP group (``"shard"``, ``"all"``: each rank back-propagates
only through the rows its shard holds), so the SP group's gradient sums to one process's in every mode.

Every rank runs the vision tower once per modality in every step, whatever its batch holds, since ZeRO-3 gathers
the tower's weights collectively, over DP ranks whose batches differ too: a rank whose shard holds no placeholder of
a modality encodes the batch's smallest item of it, and a batch without any item of a modality encodes a blank one
(:meth:`~lightning_ulysses.vision.families.VisionFamily.blank_vision`); either is added times zero.

DeepStack families (Qwen3-VL) encode each row as ``[(1 + layers) * hidden]``: the input embedding, then the rows
that the first decoder layers add to their output at the placeholders. They are selected, gathered and
back-propagated with the embedding; :class:`MergedInputs` hands the shard's part to the language model.

The vision tower runs unpatched (:func:`~lightning_ulysses.hf.patching.unpatched`): its own attention
implementation on whole images, never sequence-sharded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from transformers import PreTrainedModel

from lightning_ulysses.hf.apply import unpatched
from lightning_ulysses.vision.batch import ROWS_KEY, VISION_KEY
from lightning_ulysses.vision.families import VisionFamily

VisionEncoding = Literal["shard", "exchange", "all"]
VISION_ENCODINGS = ("shard", "exchange", "all")


def balanced_owners(feature_rows: Sequence[int], ranks: int) -> list[int]:
    """The rank that encodes each item: largest item first, each onto the rank with the fewest rows so far (ties: the
    lowest rank). A pure function of the batch, so every rank of the SP group computes the same assignment."""
    owners, loads = [0] * len(feature_rows), [0] * ranks
    for item in sorted(range(len(feature_rows)), key=lambda i: (-feature_rows[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[item], loads[rank] = rank, loads[rank] + feature_rows[item]
    return owners


def owners_by_modality(feature_rows: Mapping[str, list[int]], ranks: int) -> dict[str, list[int]]:
    """:func:`balanced_owners` over the items of every modality together (they run through the same tower)."""
    items = [(name, rows) for name, per_item in feature_rows.items() for rows in per_item]
    owners: dict[str, list[int]] = {name: [] for name in feature_rows}
    for (name, _), owner in zip(items, balanced_owners([rows for _, rows in items], ranks), strict=True):
        owners[name].append(owner)
    return owners


class _GatherRows(torch.autograd.Function):
    """``[n_r, hidden]`` on each rank ``r`` of ``group`` -> ``[sum of n_r, hidden]`` on every rank (rank order).
    Backward: the gradient summed over the ranks, each rank keeping its own rows."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, counts: list[int], group: ProcessGroup) -> Tensor:
        ctx.counts, ctx.group, ctx.rank = counts, group, dist.get_rank(group)
        padded = local.new_zeros(max(counts), *local.shape[1:])
        padded[: local.shape[0]] = local
        gathered = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(gathered, padded, group=group)
        return torch.cat([part[:count] for part, count in zip(gathered, counts, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None


def encoded_items(rows: Tensor, feature_rows: list[int], encode: Literal["shard", "all"]) -> list[int]:
    """The items whose embeddings this shard needs (``rows``: its ``vision_rows`` of one modality, 1-based), or with
    ``"all"`` every item; never none while the batch has items."""
    if encode == "all":
        return list(range(len(feature_rows)))
    ends = torch.tensor(feature_rows, device=rows.device).cumsum(0)
    needed = torch.searchsorted(ends, rows[rows > 0] - 1, right=True).unique().tolist()
    return needed or [min(range(len(feature_rows)), key=feature_rows.__getitem__)]


@dataclass
class MergedInputs:
    """A shard's language-model inputs from :func:`merged_inputs`."""

    embeds: Tensor
    """``[B, N/sp, hidden]``: the input embeddings, each placeholder replaced by its item's row."""
    visual_mask: Tensor | None = None
    """DeepStack families: ``[B, N/sp]`` bool, the shard's placeholders of every modality."""
    deepstack: list[Tensor] = field(default_factory=list)
    """DeepStack families: per layer ``[placeholders of the shard, hidden]``, in the shard's token order: what that
    decoder layer adds to its output at ``visual_mask`` (transformers' ``deepstack_visual_embeds``, on the shard)."""


def merged_inputs_embeds(
    model: PreTrainedModel,
    family: VisionFamily,
    batch: Mapping[str, Any],
    encode: VisionEncoding = "shard",
    group: ProcessGroup | None = None,
) -> Tensor:
    """``[B, N/sp, hidden]``: :attr:`MergedInputs.embeds` of :func:`merged_inputs`."""
    return merged_inputs(model, family, batch, encode, group).embeds


def merged_inputs(
    model: PreTrainedModel,
    family: VisionFamily,
    batch: Mapping[str, Any],
    encode: VisionEncoding = "shard",
    group: ProcessGroup | None = None,
) -> MergedInputs:
    """The embeddings of the shard's ``input_ids``, each placeholder replaced by its item's embedding row (see the
    module docstring), and for DeepStack families the rows its first decoder layers add at the shard's placeholders;
    ``group``: the SP group (``"exchange"`` only; ``None`` or one rank: as ``"all"``)."""
    if encode == "exchange" and (group is None or dist.get_world_size(group) == 1):
        encode = "all"
    input_ids, all_rows, vision = batch["input_ids"], batch[ROWS_KEY], batch[VISION_KEY]
    embeds = model.get_input_embeddings()(input_ids)
    hidden = embeds.shape[-1]
    # DeepStack rows of every token [B, N/sp, layers * hidden]: zero on text, the item's rows on placeholders
    stacked = embeds.new_zeros(*embeds.shape[:-1], family.deepstack_layers * hidden)
    visual_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    inner = cast(nn.Module, model.model)  # the base model: its vision tower and get_image_features
    if encode == "exchange":
        assert group is not None
        owners = owners_by_modality(vision["feature_rows"], dist.get_world_size(group))
    for modality in family.modalities:
        feature_rows = vision["feature_rows"].get(modality.name)
        if not feature_rows:
            embeds = embeds + 0.0 * _blank_rows(model, family, modality, embeds).sum()
            continue
        placeholders = input_ids == modality.token_id
        rows = torch.where(placeholders, all_rows, 0)
        if encode == "exchange":
            assert group is not None
            items, features = _exchanged(
                model, family, vision, modality, feature_rows, owners[modality.name], embeds, group
            )
        else:
            items = encoded_items(rows, feature_rows, encode)
            with unpatched(model):
                features = family.encode(inner, vision, modality, items).to(embeds.dtype)
        # batch row r of this modality -> its row in `features`
        local = torch.full((sum(feature_rows),), -1, dtype=torch.long, device=embeds.device)
        starts = [0, *torch.tensor(feature_rows).cumsum(0).tolist()]
        offset = 0
        for item in items:
            count = feature_rows[item]
            local[starts[item] : starts[item] + count] = torch.arange(offset, offset + count, device=embeds.device)
            offset += count
        index = local[(rows - 1).clamp(min=0)]
        if bool((placeholders & (index < 0)).any()):
            raise RuntimeError(f"A {modality.name} token of this shard has no encoded item (internal error).")
        merged = features[index.clamp(min=0)]  # [B, N/sp, (1 + deepstack layers) * hidden]
        embeds = torch.where(placeholders[..., None], merged[..., :hidden], embeds)
        stacked = torch.where(placeholders[..., None], merged[..., hidden:], stacked)
        visual_mask = visual_mask | placeholders
        if not bool(placeholders.any()):
            embeds = embeds + 0.0 * features.sum()  # keeps the vision tower in this rank's backward
    if not family.deepstack_layers:
        return MergedInputs(embeds)
    return MergedInputs(embeds, visual_mask, list(stacked[visual_mask].split(hidden, dim=-1)))


def _exchanged(
    model: nn.Module,
    family: VisionFamily,
    vision: Mapping[str, Any],
    modality: Any,
    feature_rows: list[int],
    owners: list[int],
    embeds: Tensor,
    group: ProcessGroup,
) -> tuple[list[int], Tensor]:
    """``encode="exchange"``: this rank encodes the items it owns, and every rank gets every item's rows. Returns the
    items in the order of the gathered rows (rank by rank) and the rows ``[sum of rows, hidden]``."""
    rank = dist.get_rank(group)
    shares = [[item for item, owner in enumerate(owners) if owner == r] for r in range(dist.get_world_size(group))]
    if shares[rank]:
        with unpatched(model):
            own = family.encode(cast(nn.Module, model.model), vision, modality, shares[rank]).to(embeds.dtype)
    else:  # fewer items than ranks: the tower runs all the same (ZeRO-3), on a blank item, and sends no row
        rows = _blank_rows(model, family, modality, embeds)
        own = rows[:0] + 0.0 * rows.sum()
    counts = [sum(feature_rows[item] for item in share) for share in shares]
    return [item for share in shares for item in share], _GatherRows.apply(own, counts, group)


def _blank_rows(model: nn.Module, family: VisionFamily, modality: Any, embeds: Tensor) -> Tensor:
    """The embedding rows of one blank item of ``modality`` (:meth:`VisionFamily.blank_vision`), for a rank that must
    run the vision tower without an item of its own; callers add them times zero."""
    blank = family.blank_vision(cast(nn.Module, model.model), modality, embeds.device, embeds.dtype)
    with unpatched(model):
        return family.encode(cast(nn.Module, model.model), blank, modality, [0]).to(embeds.dtype)
