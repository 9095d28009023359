"""A shard's input embeddings with its images merged in, from the vision rows that the whole-sequence step numbered.

Every rank holds all of the batch's pixels and its own ``[B, N/sp]`` shard of ``input_ids`` and ``vision_rows``.
With ``encode="shard"`` it runs the vision tower on the items (images, videos) that have at least one placeholder
in its shard (an item cut by a shard border is encoded by both ranks), with ``encode="all"`` on every item of the
batch. An item's embeddings do not depend on the other items encoded with it (each is encoded on its own patches),
and each rank back-propagates only through the rows its shard holds, so the SP group's gradient sums to one
process's either way.

Every rank runs the vision tower once per modality in every step, whatever its batch holds, since ZeRO-3 gathers
the tower's weights collectively, over DP ranks whose batches differ too: a rank whose shard holds no placeholder of
a modality encodes the batch's smallest item of it, and a batch without any item of a modality encodes a blank one
(:meth:`~lightning_ulysses.vision.families.VisionFamily.blank_vision`); either is added times zero.

The vision tower runs unpatched (:func:`~lightning_ulysses.hf.patching.unpatched`): its own attention
implementation on whole images, never sequence-sharded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_ulysses.hf.apply import unpatched
from lightning_ulysses.vision.batch import ROWS_KEY, VISION_KEY
from lightning_ulysses.vision.families import VisionFamily

VisionEncoding = Literal["shard", "all"]


def encoded_items(rows: Tensor, feature_rows: list[int], encode: VisionEncoding) -> list[int]:
    """The items whose embeddings this shard needs (``rows``: its ``vision_rows`` of one modality, 1-based), or with
    ``"all"`` every item; never none while the batch has items."""
    if encode == "all":
        return list(range(len(feature_rows)))
    ends = torch.tensor(feature_rows, device=rows.device).cumsum(0)
    needed = torch.searchsorted(ends, rows[rows > 0] - 1, right=True).unique().tolist()
    return needed or [min(range(len(feature_rows)), key=feature_rows.__getitem__)]


def merged_inputs_embeds(model: nn.Module, family: VisionFamily, batch: Mapping[str, Any],
                         encode: VisionEncoding = "shard") -> Tensor:
    """``[B, N/sp, hidden]``: the embeddings of the shard's ``input_ids``, each placeholder replaced by its item's
    embedding row (see the module docstring)."""
    input_ids, all_rows, vision = batch["input_ids"], batch[ROWS_KEY], batch[VISION_KEY]
    embeds = model.get_input_embeddings()(input_ids)
    inner = model.model
    for modality in family.modalities:
        feature_rows = vision["feature_rows"].get(modality.name)
        if not feature_rows:
            blank = family.blank_vision(inner, modality, embeds.device, embeds.dtype)
            with unpatched(model):
                embeds = embeds + 0.0 * family.encode(inner, blank, modality, [0]).sum()
            continue
        placeholders = input_ids == modality.token_id
        rows = torch.where(placeholders, all_rows, 0)
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
        merged = features[index.clamp(min=0)]
        embeds = torch.where(placeholders[..., None], merged, embeds)
        if not bool(placeholders.any()):
            embeds = embeds + 0.0 * features.sum()  # keeps the vision tower in this rank's backward
    return embeds
