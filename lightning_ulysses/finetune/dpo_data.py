"""Preference data for DPO: ``prompt`` / ``chosen`` / ``rejected`` records -> one row per pair.

A row holds the pair as two documents, ``prompt + chosen`` then ``prompt + rejected`` (position ids from 0 in each,
so attention never crosses from one to the other), labelled on the completions only, with ``sequence_ids`` (0 on
the chosen document, 1 on the rejected) telling :class:`~lightning_ulysses.finetune.DPO` which sum each token's
log-probability joins. ``sequence_ids`` is a per-token tensor: the strategy shards it with the tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import Dataset

from lightning_ulysses.finetune.datamodule import RecordsDataModule
from lightning_ulysses.finetune.packing import (
    KEPT,
    NO_LABELS,
    TOO_LONG,
    TRUNCATED,
    DataReport,
    Truncation,
    fit_length,
    trained_tokens,
)
from lightning_ulysses.finetune.templates import TemplateError, tokenize_record
from lightning_ulysses.finetune.tokenizer import BYTE

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

CHOSEN, REJECTED = 0, 1


class PreferenceDataset(Dataset):
    """One pair per row: ``{"input_ids", "labels", "position_ids", "sequence_ids"}``, each ``[len(chosen) +
    len(rejected)]``."""

    def __init__(self, pairs: datasets.Dataset, kept: list[int]) -> None:
        self.pairs = pairs
        self.kept = kept

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        pair = self.pairs[self.kept[index]]
        chosen, rejected = len(pair["chosen_ids"]), len(pair["rejected_ids"])
        return {
            "input_ids": torch.tensor(pair["chosen_ids"] + pair["rejected_ids"]),
            "labels": torch.tensor(pair["chosen_labels"] + pair["rejected_labels"]),
            "position_ids": torch.cat([torch.arange(chosen), torch.arange(rejected)]),
            "sequence_ids": torch.tensor([CHOSEN] * chosen + [REJECTED] * rejected),
        }


def tokenize_pair(
    record: dict[str, Any], index: int, tokenizer: PreTrainedTokenizerBase, max_len: int, truncation: Truncation
) -> dict[str, Any]:
    """The ``datasets.map`` transform: both sequences of a pair, each fitted to ``max_len`` tokens; the pair's status
    is the worst of the two."""
    out: dict[str, Any] = {}
    statuses = []
    for side in ("chosen", "rejected"):
        try:
            ids, labels = tokenize_record(tokenizer, {"prompt": record["prompt"], "completion": record[side]})
        except TemplateError as error:
            raise TemplateError(f"Record {index} ({side}): {error}") from error
        out[f"{side}_ids"], out[f"{side}_labels"], status = fit_length(
            ids, labels, max_len, truncation, index, limit=f"data.seq_len // 2 (the {side} sequence of a pair)"
        )
        statuses.append(status)
    out["status"] = next((s for s in (TOO_LONG, NO_LABELS, TRUNCATED) if s in statuses), KEPT)
    out["length"] = len(out["chosen_ids"]) + len(out["rejected_ids"])
    out["trained"] = trained_tokens(out["chosen_labels"]) + trained_tokens(out["rejected_labels"])
    return out


def check_pair_length(seq_len: int) -> None:
    """Refuse rows too short for a pair: each of its two sequences needs a prompt token and a completion token."""
    if seq_len < 4:
        raise ValueError(
            f"data.seq_len={seq_len}: a row holds a pair, each sequence at most seq_len // 2 tokens, and needs at "
            "least 4 (2 per sequence of a pair); set data.seq_len to 4 or more, e.g. --data.seq_len 512."
        )


class PreferenceDataModule(RecordsDataModule):
    """Preference pairs from local files for :class:`~lightning_ulysses.finetune.DPO`.

    Args:
        paths: JSONL/JSON, Parquet or Arrow files (or folders, or globs) of records with ``prompt``, ``chosen`` and
            ``rejected``: all strings, or all lists of messages (the prompt's turns, then the completions' assistant
            turns), rendered by the tokenizer's chat template.
        tokenizer: a local Hugging Face tokenizer folder, or ``"byte"`` (built in, ChatML).
        seq_len: tokens per row; each sequence of a pair (prompt + completion) gets at most ``seq_len // 2``.
        truncation: a sequence longer than ``seq_len // 2``: ``"truncate"`` (cut its end), ``"drop"`` (the pair), or
            ``"refuse"``. Pairs left without a trained token on either side are dropped; counts in ``reports``.
        batch_size: pairs per micro-batch and per data-parallel group.
        val_paths: validation files; none: ``val_fraction`` of the records is held out.
        val_fraction: share of the records held out when ``val_paths`` is not given.
        num_proc: ``datasets`` worker processes for tokenizing.
        num_workers: DataLoader worker processes.
        seed: seed of the train/validation split.
    """

    def __init__(
        self,
        paths: Sequence[str],
        tokenizer: str = BYTE,
        seq_len: int = 4096,
        truncation: Truncation = "truncate",
        batch_size: int = 1,
        val_paths: Sequence[str] | None = None,
        val_fraction: float = 0.05,
        num_proc: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        check_pair_length(seq_len)
        super().__init__(
            paths, tokenizer, seq_len, truncation, batch_size, val_paths, val_fraction, num_proc, num_workers, seed
        )

    @classmethod
    def check_arguments(cls, args: Mapping[str, Any]) -> None:
        check_pair_length(args["seq_len"])
        super().check_arguments(args)

    def build(self, records: datasets.Dataset, name: str) -> PreferenceDataset:
        missing = {"prompt", "chosen", "rejected"} - set(records.column_names)
        if missing:
            raise ValueError(
                f"Preference records need 'prompt', 'chosen' and 'rejected'; the {name} files lack {sorted(missing)}."
            )
        transform = functools.partial(
            tokenize_pair, tokenizer=self.tokenizer, max_len=self.seq_len // 2, truncation=self.truncation
        )
        pairs = records.map(
            transform,
            with_indices=True,
            remove_columns=records.column_names,
            num_proc=self.num_proc,
            desc=f"Tokenizing the {name} pairs",
        )
        statuses, all_lengths = list(pairs["status"]), list(pairs["length"])
        kept = [i for i, status in enumerate(statuses) if status in (KEPT, TRUNCATED)]
        if not kept:
            raise ValueError(
                f"No {name} pair is left to train on. Check the records, data.seq_len and data.truncation."
            )
        lengths = [all_lengths[i] for i in kept]
        self.reports[name] = DataReport.of(statuses, lengths, sum(list(pairs["trained"])), len(kept), self.seq_len)
        rank_zero_info(f"DPO {name} data (records are pairs, a row holds one pair): {self.reports[name]}")
        return PreferenceDataset(pairs, kept)
