"""Chat SFT on images and video: local chat records with image / video file paths, a local processor folder.

A record is ``{"messages": [...]}`` in transformers' multimodal chat format: every message's ``content`` a list of
parts ``{"type": "text", "text": ...}``, ``{"type": "image", "image": <path>}`` or ``{"type": "video", "video":
[<frame paths>]}`` (paths relative to ``media_root``). The processor (``AutoProcessor.from_pretrained(processor)``:
its chat template, tokenizer and image / video processors) renders each record; each image becomes its run of
placeholder tokens. Labels are the assistant turns' tokens, located at token level: ``messages[:i]`` with the
generation prompt and ``messages[:i + 1]`` must tokenize to prefixes of the whole record's tokens (a template for
which they do not is refused with :class:`~lightning_ulysses.finetune.TemplateError`).

Batches are ``{input_ids, labels, position_ids, attention_mask}`` ``[B, N]`` plus ``vision``: the batch's pixels and
grids concatenated in row order (what :class:`~lightning_ulysses.VisionLanguageModel` reads). Samples are never cut
(that could cut an image): one longer than ``seq_len`` is dropped or refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import Dataset

from lightning_ulysses.data import collate_right_padded
from lightning_ulysses.finetune.datamodule import RecordsDataModule
from lightning_ulysses.finetune.packing import KEPT, NO_LABELS, TOO_LONG, DataReport, pack_rows, trained_tokens
from lightning_ulysses.finetune.templates import TemplateError
from lightning_ulysses.sharding import IGNORE_INDEX
from lightning_ulysses.vision.batch import VISION_KEY

if TYPE_CHECKING:
    import datasets

VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
"""Processor outputs that go into ``batch["vision"]``, concatenated over the batch's samples (dim 0)."""


def _media(messages: Sequence[Mapping[str, Any]], root: Path) -> tuple[list[Any], list[list[Any]]]:
    """The images and videos (lists of frames) of ``messages``, in order, opened with PIL."""
    from PIL import Image

    images, videos = [], []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") == "image":
                images.append(Image.open(root / part["image"]).convert("RGB"))
            elif part.get("type") == "video":
                videos.append([Image.open(root / frame).convert("RGB") for frame in part["video"]])
    return images, videos


def _clean(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as JSON gave them: ``datasets`` fills the fields a part lacks with None (its Arrow schema)."""
    return [
        {**message, "content": [{k: v for k, v in part.items() if v is not None} for part in message["content"]]}
        if isinstance(message.get("content"), list)
        else dict(message)
        for message in messages
    ]


def process_record(processor: Any, messages: list[dict[str, Any]], root: Path) -> dict[str, Tensor]:
    """One record: ``input_ids`` and ``labels`` ``[length]`` (labels on the assistant turns) and its vision inputs."""

    def encode(upto: list[dict[str, Any]], generation_prompt: bool) -> dict[str, Any]:
        text = processor.apply_chat_template(upto, tokenize=False, add_generation_prompt=generation_prompt)
        images, videos = _media(upto, root)
        return processor(text=[text], images=images or None, videos=videos or None, return_tensors="pt")

    whole = encode(messages, False)
    ids = whole["input_ids"][0]
    labels = torch.full_like(ids, IGNORE_INDEX)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start, end = (
            _prefix_length(encode(messages[:j], prompt)["input_ids"][0], ids, i)
            for j, prompt in ((i, True), (i + 1, False))
        )
        labels[start:end] = ids[start:end]
    sample = {"input_ids": ids, "labels": labels}
    sample.update({key: whole[key] for key in VISION_INPUTS if key in whole})
    return sample


def _prefix_length(prefix: Tensor, ids: Tensor, turn: int) -> int:
    if len(prefix) > len(ids) or not torch.equal(ids[: len(prefix)], prefix):
        raise TemplateError(
            f"The processor's tokens of the conversation up to assistant message {turn} do not begin the tokens of the "
            "whole conversation, so that turn's tokens cannot be located exactly (a template that renders earlier "
            "turns differently once later ones follow, or a token merged across the turn's border)."
        )
    return len(prefix)


class VisionChatDataset(Dataset):
    """Rows of whole processed samples: ``{"input_ids", "labels", "position_ids"}`` (position ids from 0 in every
    sample) and the rows' vision inputs, each concatenated over its samples."""

    def __init__(self, samples: list[dict[str, Tensor]], rows: list[list[int]]) -> None:
        self.samples, self.rows = samples, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        picked = [self.samples[i] for i in self.rows[index]]
        row = {
            "input_ids": torch.cat([s["input_ids"] for s in picked]),
            "labels": torch.cat([s["labels"] for s in picked]),
            "position_ids": torch.cat([torch.arange(len(s["input_ids"])) for s in picked]),
        }
        return {**row, VISION_KEY: _concatenated([s for s in picked])}


def _concatenated(samples: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
    return {
        key: torch.cat([s[key] for s in samples if key in s]) for key in VISION_INPUTS if any(key in s for s in samples)
    }


def collate_vision_chats(rows: list[dict[str, Any]], pad_token_id: int = 0) -> dict[str, Any]:
    """Right-padded ``[B, N]`` text entries (:func:`~lightning_ulysses.data.collate_right_padded`) and the rows'
    vision inputs concatenated in row order."""
    batch: dict[str, Any] = collate_right_padded(
        [{k: v for k, v in row.items() if k != VISION_KEY} for row in rows], pad_token_id
    )
    batch[VISION_KEY] = _concatenated([row[VISION_KEY] for row in rows])
    return batch


class VisionChatDataModule(RecordsDataModule):
    """Chat SFT on images and video from local files (see the module docstring).

    Args:
        paths: JSONL/JSON, Parquet or Arrow files (or folders, or globs) of ``messages`` records.
        processor: a local processor folder (``AutoProcessor.from_pretrained``: chat template, tokenizer, image and
            video processors), e.g. the model's own folder.
        media_root: folder that image and video paths are relative to (``None``: the current folder).
        seq_len: tokens per row, before the strategy pads it to a multiple of ``sp_size`` and shards it.
        mode: ``"padded"``: one sample per row; ``"packed"``: whole samples fill rows (position ids restarting at
            every sample, with its own multimodal RoPE positions).
        truncation: a sample longer than ``seq_len``: ``"drop"`` or ``"refuse"`` (never cut: the cut could fall
            inside an image).
        batch_size, val_paths, val_fraction, num_workers, seed: as :class:`~lightning_ulysses.finetune.SFTDataModule`.

    Records are processed once at set-up, in this process, and kept in memory.
    """

    collate = staticmethod(collate_vision_chats)

    def __init__(
        self,
        paths: Sequence[str],
        processor: str,
        media_root: str | None = None,
        seq_len: int = 4096,
        mode: Literal["packed", "padded"] = "padded",
        truncation: Literal["drop", "refuse"] = "refuse",
        batch_size: int = 1,
        val_paths: Sequence[str] | None = None,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        from transformers import AutoProcessor

        if mode not in ("packed", "padded"):
            raise ValueError(f"data.mode must be 'packed' or 'padded', got {mode!r}.")
        if truncation not in ("drop", "refuse"):
            raise ValueError(
                f"data.truncation must be 'drop' or 'refuse' (a cut could fall inside an image), got {truncation!r}."
            )
        super().__init__(
            paths, processor, seq_len, truncation, batch_size, val_paths, val_fraction, None, num_workers, seed
        )
        self.processor = AutoProcessor.from_pretrained(processor)
        self.media_root = Path(media_root) if media_root else Path()
        self.mode = mode

    def build(self, records: datasets.Dataset, name: str) -> VisionChatDataset:
        samples, statuses = [], []
        for index, record in enumerate(records):
            try:
                # Any: its labels tensor goes to trained_tokens, which iterates it like the ints it is annotated with
                sample: dict[str, Any] = process_record(self.processor, _clean(record["messages"]), self.media_root)
            except TemplateError as error:
                raise TemplateError(f"Record {index}: {error}") from error
            length = len(sample["input_ids"])
            if length > self.seq_len and self.truncation == "refuse":
                raise ValueError(
                    f"{name} record {index} has {length} tokens, more than data.seq_len={self.seq_len}. "
                    "Raise data.seq_len, or set data.truncation to 'drop'."
                )
            status = TOO_LONG if length > self.seq_len else NO_LABELS if not trained_tokens(sample["labels"]) else KEPT
            statuses.append(status)
            if status == KEPT:
                samples.append(sample)
        if not samples:
            raise ValueError(
                f"No {name} sample is left to train on. Check data.seq_len and the records' assistant turns."
            )
        lengths = [len(s["input_ids"]) for s in samples]
        rows = pack_rows(lengths, self.seq_len) if self.mode == "packed" else [[i] for i in range(len(samples))]
        trained = sum(trained_tokens(s["labels"]) for s in samples)
        self.reports[name] = DataReport.of(statuses, lengths, trained, len(rows), self.seq_len)
        rank_zero_info(f"Vision chat {name} data: {self.reports[name]}")
        return VisionChatDataset(samples, rows)
