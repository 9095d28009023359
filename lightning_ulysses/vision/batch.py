"""Whole-sequence preparation of a vision-language batch, before the strategy pads and shards it.

The batch from the data holds ``input_ids [B, N]`` (each image or video as its run of placeholder tokens), optionally
``labels``, ``attention_mask`` and packed ``position_ids [B, N]`` (restarting at 0 per document), and the vision
inputs under ``batch["vision"]`` (a dict: ``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``, ...; a dict
travels through :func:`~lightning_ulysses.sharding.prepare_batch` and :func:`~lightning_ulysses.sharding.shard_batch`
unchanged, so every SP rank keeps all of the batch's pixels). :func:`prepare_vision_batch` adds what must be computed on
the whole sequence, as per-token entries that the strategy then shards like ``input_ids``:

* ``vision_rows [B, N]``: 0 for a text token, ``r + 1`` for the placeholder that takes embedding row ``r`` of its
  modality's items, concatenated in batch order (the row that transformers' ``masked_scatter`` puts there);
* ``mrope_position_ids [B, N, 3]`` (multimodal RoPE families): temporal, height and width positions from the
  model's ``get_rope_index``, computed per document on its real tokens (as one process computes them on each
  document alone);
* ``labels`` with every placeholder masked (the loss is on text tokens only), ``input_ids`` as labels when absent.

and records, in ``batch["vision"]["feature_rows"]``, the rows of every item.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_ulysses.sharding import IGNORE_INDEX, document_starts
from lightning_ulysses.vision.families import VisionFamily

VISION_KEY = "vision"
ROWS_KEY = "vision_rows"
MROPE_KEY = "mrope_position_ids"


def prepare_vision_batch(batch: Mapping[str, Any], family: VisionFamily, inner: nn.Module) -> dict[str, Any]:
    """The batch with ``vision_rows``, ``mrope_position_ids`` (mRoPE families) and masked ``labels`` added (see the
    module docstring). ``inner`` is the model's base, whose ``get_rope_index`` numbers the positions."""
    out = dict(batch)
    input_ids = out["input_ids"]
    vision = dict(out.get(VISION_KEY) or {})
    rows = torch.zeros_like(input_ids)
    feature_rows = {}
    for modality in family.modalities:
        placeholders = input_ids == modality.token_id
        count = int(placeholders.sum())
        if modality.pixels_key not in vision:
            if count:
                raise ValueError(
                    f"The batch has {count} {modality.name} tokens but no batch['vision'][{modality.pixels_key!r}]."
                )
            continue
        per_item = family.feature_rows(vision, modality, count)
        if sum(per_item) != count:
            raise ValueError(
                f"The batch's {modality.name}s fill {sum(per_item)} embedding rows but it has {count} {modality.name} "
                "tokens (a sequence cut inside an image, or a processor of another model?). Cut samples only between "
                "images."
            )
        rows[placeholders] = torch.arange(1, count + 1, device=rows.device)
        feature_rows[modality.name] = per_item
    vision["feature_rows"] = feature_rows
    is_vision = _modality_types(input_ids, family) > 0
    out["labels"] = out.get("labels", input_ids).masked_fill(is_vision, IGNORE_INDEX)
    out[ROWS_KEY] = rows
    if family.mrope:
        out[MROPE_KEY] = mrope_positions(out, vision, family, inner)
    out[VISION_KEY] = vision
    return out


def _modality_types(input_ids: Tensor, family: VisionFamily) -> Tensor:
    """``[B, N]``: 0 for text, each modality's ``type_id`` on its placeholders."""
    types = torch.zeros_like(input_ids)
    for modality in family.modalities:
        types = types.masked_fill(input_ids == modality.token_id, modality.type_id)
    return types


def mrope_positions(
    batch: Mapping[str, Any], vision: Mapping[str, Any], family: VisionFamily, inner: nn.Module
) -> Tensor:
    """``[B, N, 3]`` long: each document's multimodal RoPE positions (0 on padding). Documents restart where the
    given ``position_ids`` are 0; padding is where ``attention_mask`` is 0."""
    input_ids = batch["input_ids"]
    types = _modality_types(input_ids, family)
    real = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones_like(input_ids, dtype=torch.bool)
    given = batch.get("position_ids")
    starts = document_starts(given) if given is not None else torch.zeros_like(real)
    positions = torch.zeros(*input_ids.shape, 3, dtype=torch.long, device=input_ids.device)
    taken = {modality.name: 0 for modality in family.modalities}
    runs_of = {m.name: family.item_runs(vision, m) if m.pixels_key in vision else [] for m in family.modalities}
    for row in range(input_ids.shape[0]):
        columns = real[row].nonzero().squeeze(1)
        if not len(columns):
            continue
        document_starts_here = starts[row, columns]
        document_starts_here[0] = True  # the first real token starts a document
        document_of = document_starts_here.long().cumsum(0)
        for document in document_of.unique().tolist():
            cols = columns[document_of == document]
            doc_types = types[row, cols]
            items = {}
            for modality in family.modalities:
                runs = int(((doc_types[1:] == modality.type_id) & (doc_types[:-1] != modality.type_id)).sum())
                runs += int(doc_types[0] == modality.type_id)
                first = taken[modality.name]
                while runs > 0:  # the items whose runs the document holds (a Qwen3-VL video: one run per frame)
                    runs -= runs_of[modality.name][taken[modality.name]]
                    taken[modality.name] += 1
                if runs < 0:
                    raise ValueError(f"A document of row {row} holds part of a {modality.name}'s frames only.")
                items[modality.name] = list(range(first, taken[modality.name]))
            positions[row, cols] = family.rope_index(inner, input_ids[row, cols], doc_types, vision, items).T
    return positions
