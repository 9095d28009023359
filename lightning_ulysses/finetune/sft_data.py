"""Supervised fine-tuning data: chat or prompt/completion records -> rows labelled on the assistant's tokens only.

Records are read and tokenized by ``datasets`` (memory-mapped Arrow, cached by fingerprint, ``num_proc`` workers);
this module decides the labels (:mod:`~lightning_ulysses.finetune.templates`), the length policy and the rows
(:mod:`~lightning_ulysses.finetune.packing`). Batches are ``{input_ids, labels, position_ids, attention_mask}``,
``[B, N]`` with ``N <= seq_len``; :class:`~lightning_ulysses.UlyssesStrategy` shifts the labels on the whole
sequence and shards them like any batch, so ``CausalLM`` trains on the assistant's tokens with the exact token mean.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import Dataset

from lightning_ulysses.finetune.datamodule import RecordsDataModule
from lightning_ulysses.finetune.packing import (
    KEPT,
    TRUNCATED,
    DataReport,
    Truncation,
    fit_length,
    pack_rows,
    trained_tokens,
)
from lightning_ulysses.finetune.templates import TemplateError, tokenize_record
from lightning_ulysses.finetune.tokenizer import BYTE

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase


class SFTDataset(Dataset):
    """Rows of whole samples: ``{"input_ids", "labels", "position_ids"}``, each ``[row length <= seq_len]``, the
    position ids counting from 0 in every sample."""

    def __init__(self, samples: datasets.Dataset, rows: list[list[int]]) -> None:
        self.samples = samples
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        picked = self.samples[self.rows[index]]
        return {
            "input_ids": torch.tensor([t for ids in picked["input_ids"] for t in ids]),
            "labels": torch.tensor([t for labels in picked["labels"] for t in labels]),
            "position_ids": torch.cat([torch.arange(len(ids)) for ids in picked["input_ids"]]),
        }


def tokenize_and_fit(
    record: dict[str, Any], index: int, tokenizer: PreTrainedTokenizerBase, seq_len: int, truncation: Truncation
) -> dict[str, Any]:
    """The ``datasets.map`` transform: one record -> its ids, labels, length-policy status, length and trained
    tokens."""
    try:
        ids, labels = tokenize_record(tokenizer, record)
    except TemplateError as error:
        raise TemplateError(f"Record {index}: {error}") from error
    ids, labels, status = fit_length(ids, labels, seq_len, truncation, index)
    return {"input_ids": ids, "labels": labels, "status": status, "length": len(ids), "trained": trained_tokens(labels)}


class SFTDataModule(RecordsDataModule):
    """Chat SFT from local files: loss on the assistant's tokens only, samples packed or padded.

    Args:
        paths: JSONL/JSON, Parquet or Arrow files (or folders, or globs) of records: ``messages`` (chat), or
            ``prompt`` and ``completion`` (both strings, or both lists of messages).
        tokenizer: a local Hugging Face tokenizer folder (its chat template renders ``messages``), or ``"byte"``:
            the built-in byte-level tokenizer with a ChatML template (no files).
        seq_len: tokens per row, before the strategy pads it to a multiple of ``sp_size`` and shards it.
        mode: ``"packed"``: whole samples fill rows of at most ``seq_len`` tokens (best fit, position ids restarting
            at every sample, so attention never crosses one); ``"padded"``: one sample per row, a batch padded to its
            longest row.
        truncation: a sample longer than ``seq_len``: ``"truncate"`` (keep its first ``seq_len`` tokens and their
            labels), ``"drop"``, or ``"refuse"`` (stop at set-up, naming it). Samples left without a trained token are
            dropped. The counts are logged at set-up and kept in ``reports``.
        batch_size: rows per micro-batch and per data-parallel group (the SP ranks of a group share them).
        val_paths: validation files; none: ``val_fraction`` of the records (at least one) is held out.
        val_fraction: share of the records held out for validation when ``val_paths`` is not given.
        num_proc: ``datasets`` worker processes for tokenizing (``None``: in this process).
        num_workers: DataLoader worker processes.
        seed: seed of the train/validation split.
    """

    def __init__(
        self,
        paths: Sequence[str],
        tokenizer: str = BYTE,
        seq_len: int = 4096,
        mode: Literal["packed", "padded"] = "packed",
        truncation: Truncation = "truncate",
        batch_size: int = 1,
        val_paths: Sequence[str] | None = None,
        val_fraction: float = 0.05,
        num_proc: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        if mode not in ("packed", "padded"):
            raise ValueError(f"data.mode must be 'packed' or 'padded', got {mode!r}.")
        super().__init__(
            paths, tokenizer, seq_len, truncation, batch_size, val_paths, val_fraction, num_proc, num_workers, seed
        )
        self.mode = mode

    def build(self, records: datasets.Dataset, name: str) -> SFTDataset:
        transform = functools.partial(
            tokenize_and_fit, tokenizer=self.tokenizer, seq_len=self.seq_len, truncation=self.truncation
        )
        samples = records.map(
            transform,
            with_indices=True,
            remove_columns=records.column_names,
            num_proc=self.num_proc,
            desc=f"Tokenizing the {name} records",
        )
        statuses, all_lengths = list(samples["status"]), list(samples["length"])
        kept = [i for i, status in enumerate(statuses) if status in (KEPT, TRUNCATED)]
        lengths = [all_lengths[i] for i in kept]
        if not kept:
            raise ValueError(
                f"No {name} sample is left to train on ({DataReport.of(statuses, [], 0, 0, self.seq_len)}). Check the "
                "records' assistant turns, data.seq_len and data.truncation."
            )
        if self.mode == "packed":
            rows = [[kept[i] for i in row] for row in pack_rows(lengths, self.seq_len)]
        else:
            rows = [[i] for i in kept]
        trained = sum(list(samples["trained"]))  # 0 for the dropped
        self.reports[name] = DataReport.of(statuses, lengths, trained, len(rows), self.seq_len)
        rank_zero_info(f"SFT {name} data: {self.reports[name]}")
        return SFTDataset(samples, rows)
