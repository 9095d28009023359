"""Samples -> rows of at most ``seq_len`` tokens: the truncation policy, best-fit packing, and the report of both.

A sample is never split over rows: a row holds whole samples, each with ``position_ids`` from 0, so under
:class:`~lightning_ulysses.UlyssesStrategy` attention never crosses a sample and the label across a border is
ignored (see :mod:`lightning_ulysses.sharding`). A sample longer than ``seq_len`` is cut at its end (``input_ids``
and ``labels`` together), dropped, or refused, as the policy says; every cut or drop is counted in the report.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_ulysses.sharding import IGNORE_INDEX

Truncation = Literal["truncate", "drop", "refuse"]
KEPT, TRUNCATED, TOO_LONG, NO_LABELS = "kept", "truncated", "dropped_too_long", "dropped_no_labels"


class SampleTooLongError(ValueError):
    """A sample is longer than ``seq_len`` under ``truncation="refuse"``."""


def trained_tokens(labels: Sequence[int]) -> int:
    """Labels the loss uses: every one but the first token's (no token predicts it)."""
    return sum(label != IGNORE_INDEX for label in labels[1:])


def fit_length(
    input_ids: list[int],
    labels: list[int],
    seq_len: int,
    truncation: Truncation,
    index: int,
    limit: str = "data.seq_len",
) -> tuple[list[int], list[int], str]:
    """``(input_ids, labels, status)`` of sample ``index`` after the policy; status is one of :data:`KEPT`,
    :data:`TRUNCATED`, :data:`TOO_LONG`, :data:`NO_LABELS` (nothing to train on, also after a cut). ``limit`` names
    where ``seq_len`` comes from, for the refusal."""
    status = KEPT
    if len(input_ids) > seq_len:
        if truncation == "refuse":
            raise SampleTooLongError(
                f"Sample {index} has {len(input_ids)} tokens, more than {limit}={seq_len}. Raise data.seq_len, "
                "or set data.truncation to 'truncate' (cut its end) or 'drop' (leave it out)."
            )
        if truncation == "drop":
            return [], [], TOO_LONG
        input_ids, labels, status = input_ids[:seq_len], labels[:seq_len], TRUNCATED
    if trained_tokens(labels) == 0:
        return [], [], NO_LABELS
    return input_ids, labels, status


def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Best-fit decreasing: the sample indices of each row, longest samples first, each placed in the fullest row it
    still fits in. Every length must be at most ``seq_len``; deterministic."""
    rows: list[list[int]] = []
    space: list[tuple[int, int]] = []  # (free tokens, row), sorted
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = bisect.bisect_left(space, (lengths[index], -1))
        if slot == len(space):
            rows.append([])
            free, row = seq_len, len(rows) - 1
        else:
            free, row = space.pop(slot)
        rows[row].append(index)
        bisect.insort(space, (free - lengths[index], row))
    return rows


@dataclass(frozen=True)
class DataReport:
    """What became of a split's records: counts by status, and the rows they were packed into."""

    records: int
    kept: int
    truncated: int
    dropped_too_long: int
    dropped_no_labels: int
    rows: int
    tokens: int
    trained_tokens: int
    seq_len: int

    @classmethod
    def of(cls, statuses: Sequence[str], lengths: Sequence[int], trained: int, rows: int, seq_len: int) -> DataReport:
        counts = Counter(statuses)
        return cls(
            records=len(statuses),
            kept=counts[KEPT],
            truncated=counts[TRUNCATED],
            dropped_too_long=counts[TOO_LONG],
            dropped_no_labels=counts[NO_LABELS],
            rows=rows,
            tokens=sum(lengths),
            trained_tokens=trained,
            seq_len=seq_len,
        )

    @property
    def fill(self) -> float:
        """Share of the rows' ``rows x seq_len`` token slots that hold tokens (the rest is padding)."""
        return self.tokens / max(self.rows * self.seq_len, 1)

    def __str__(self) -> str:
        return (
            f"{self.records} records: {self.kept} kept, {self.truncated} truncated to seq_len={self.seq_len}, "
            f"{self.dropped_too_long} dropped as too long, {self.dropped_no_labels} dropped with no assistant token; "
            f"{self.rows} rows, {self.tokens} tokens ({self.fill:.1%} of the rows), {self.trained_tokens} trained"
        )
