"""Batch preparation and sequence sharding (pure functions, no communication).

A batch is a dict with ``input_ids [B, N]`` and optionally ``labels``, ``attention_mask``
(1 = real token, 0 = padding) and ``position_ids``, all ``[B, N]``. ``prepare_batch`` works on the
whole sequence, before anything is split:

1. pads ``N`` up to a multiple of ``sp_size`` (input ids 0, labels -100, attention mask 0);
2. builds global ``position_ids`` when absent (``cumsum(attention_mask) - 1``, as Hugging Face does);
3. renumbers every run of padding as a document of its own starting at position 0, so padding is
   masked out of attention by the document rule below, with no dense mask;
4. computes ``shift_labels [B, N]`` (``shift_labels[:, i]`` is the label of token ``i + 1``),
   so the label across each shard border is kept.

Document rule (shared with the attention): a token starts a new document when it is the first of
its row or its position id is 0. Attention never crosses a document start. Packed documents are
therefore expressed by position ids that restart at 0, exactly as Hugging Face's padding-free
collators do; the label that would predict the first token of the next document is ignored.

``shard_batch`` then slices every per-token tensor to one rank's ``[B, N / sp_size]`` shard.

Ulysses x Ring (``ring_size > 1``, see :mod:`lightning_ulysses.attention.ring`): the sequence is cut into
``2 * ring_size`` chunks and ring rank ``r`` holds chunks ``r`` and ``2 * ring_size - 1 - r`` (zigzag), so that
every ring rank does the same causal attention work; its Ulysses group splits those two chunks, concatenated, into
``sp_size / ring_size`` contiguous shards. :func:`shard_index` names the whole-sequence columns of each shard; the
batch is prepared in whole-sequence order and only :func:`shard_batch` (and its inverse,
:func:`~lightning_ulysses.prediction.gather_sequence`) knows the zigzag.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100
"""Label value that is left out of the loss (the PyTorch / Hugging Face convention)."""

SEQUENCE_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def document_starts(position_ids: Tensor) -> Tensor:
    """``[B, N]`` bool: True where a token starts a document (first column, or position id 0)."""
    starts = position_ids == 0
    starts[:, 0] = True
    return starts


def positions_within_runs(run_starts: Tensor) -> Tensor:
    """``[B, N]`` long: each token's offset from the last True of ``run_starts`` at or before it.

    ``run_starts[:, 0]`` must be True.
    """
    columns = torch.arange(run_starts.shape[1], device=run_starts.device).expand_as(run_starts)
    last_start = torch.where(run_starts, columns, torch.zeros_like(columns)).cummax(dim=1).values
    return columns - last_start


def padded_length(seq_len: int, multiple: int) -> int:
    return -(-seq_len // multiple) * multiple


def _pad_columns(tensor: Tensor, pad: int, value: int | float) -> Tensor:
    if pad == 0:
        return tensor
    filler = tensor.new_full((tensor.shape[0], pad, *tensor.shape[2:]), value)
    return torch.cat([tensor, filler], dim=1)


def _classify(batch: Mapping[str, Any], batch_size: int, seq_len: int) -> list[str]:
    """Names of the per-token entries (``[B, N, ...]`` tensors); refuse tensors that fit no rule."""
    per_token = []
    for key, value in batch.items():
        if not isinstance(value, Tensor) or value.dim() == 0 or tuple(value.shape) == (batch_size,):
            continue  # scalars, per-sample values and non-tensors travel unchanged
        if value.dim() >= 2 and value.shape[0] == batch_size and value.shape[1] == seq_len:
            per_token.append(key)
            continue
        raise ValueError(
            f"Cannot shard batch entry {key!r} with shape {tuple(value.shape)}: sequence parallelism splits "
            f"per-token tensors shaped [batch={batch_size}, seq={seq_len}, ...] along dim 1 and passes scalars "
            f"and [batch] tensors through. Reshape {key!r} to one of these or remove it from the batch."
        )
    return per_token


def shard_multiple(sp_size: int, ring_size: int = 1) -> int:
    """The sequence length must be a multiple of this: ``sp_size`` shards, and with a ring ``2 * ring_size`` equal
    chunks whose pairs split evenly over a Ulysses group: ``ring_size * lcm(2, sp_size / ring_size)``."""
    return sp_size if ring_size == 1 else ring_size * math.lcm(2, sp_size // ring_size)


def zigzag_order(seq_len: int, ring_size: int, device: torch.device | None = None) -> Tensor:
    """``[N]`` long: the whole-sequence columns in shard order, ring rank ``r`` holding chunks ``r`` and
    ``2 * ring_size - 1 - r`` of ``2 * ring_size`` (the identity for ``ring_size=1``)."""
    columns = torch.arange(seq_len, device=device)
    if ring_size == 1:
        return columns
    if seq_len % (2 * ring_size):
        raise ValueError(f"Sequence length {seq_len} is not a multiple of 2 * ring_size={2 * ring_size}.")
    chunks = columns.view(2 * ring_size, -1)
    return torch.stack([chunks[:ring_size], chunks[ring_size:].flip(0)], dim=1).flatten()


def shard_index(seq_len: int, sp_rank: int, sp_size: int, ring_size: int = 1) -> Tensor:
    """``[N / sp_size]`` long: the whole-sequence columns of SP rank ``sp_rank``'s shard, in shard order."""
    local = seq_len // sp_size
    return zigzag_order(seq_len, ring_size)[sp_rank * local : (sp_rank + 1) * local]


def prepare_batch(batch: Mapping[str, Any], sp_size: int, ring_size: int = 1) -> dict[str, Any]:
    """Pad, position and label a whole-sequence batch so that it can be split into ``sp_size`` shards.

    Returns a new dict with every per-token tensor padded to ``[B, N']`` (``N'`` a multiple of
    :func:`shard_multiple`: ``sp_size``, or ``2 * sp_size`` with a ring of Ulysses groups of odd size),
    ``position_ids`` and ``shift_labels`` added and ``labels`` removed (a model that shifts ``labels`` itself would
    drop the label at every shard border). Without ``labels`` the next-token targets are the ``input_ids``.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"Sequence parallelism needs dict batches with an 'input_ids' entry of shape [batch, seq]; got a "
            f"{type(batch).__name__}. Return a dict from your Dataset or collate_fn."
        )
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"The batch needs 'input_ids' as a [batch, seq] tensor; got {shape}.")
    batch_size, seq_len = input_ids.shape
    per_token = _classify(batch, batch_size, seq_len)
    pad = padded_length(seq_len, shard_multiple(sp_size, ring_size)) - seq_len

    out = {key: value for key, value in batch.items() if key not in per_token}
    fill = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0}
    for key in per_token:
        out[key] = _pad_columns(batch[key], pad, fill.get(key, 0))

    real = out["attention_mask"].bool() if "attention_mask" in out else None
    if real is None and pad:
        real = torch.ones_like(out["input_ids"], dtype=torch.bool)
        real[:, seq_len:] = False
    position_ids = _build_position_ids(out["input_ids"], out.get("position_ids"), real)

    labels = out.pop("labels", out["input_ids"])
    out["position_ids"] = position_ids
    out["shift_labels"] = _shift_labels(labels, position_ids, real)
    return out


def _build_position_ids(input_ids: Tensor, given: Tensor | None, real: Tensor | None) -> Tensor:
    if real is None:
        if given is not None:
            return given.long()
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids).clone()
    padding = ~real
    positions = (real.long().cumsum(dim=1) - 1).clamp(min=0) if given is None else given.long().clone()
    # every run of padding becomes a document of its own: position 0 at its first token, then 1, 2, ...
    pad_run_start = padding.clone()
    pad_run_start[:, 1:] &= ~padding[:, :-1]
    pad_run_start[:, 0] = True
    pad_positions = positions_within_runs(pad_run_start | real)
    positions = torch.where(padding, pad_positions, positions)

    # a real token right after padding must start a document, or it would attend to the tokens before the gap
    resumes = real[:, 1:] & padding[:, :-1] & (positions[:, 1:] != 0)
    if resumes.any():
        row, col = (int(i) for i in resumes.nonzero()[0])
        raise ValueError(
            f"attention_mask row {row} has padding inside the sequence, before column {col + 1}, and the real "
            "tokens after it continue the position ids of the tokens before it. Ulysses attention masks padding "
            "as separate documents and cannot let a document attend across a gap. Put padding at the start or "
            "end of each row, or pack documents with position_ids that restart at 0 after the padding."
        )
    return positions


def _shift_labels(labels: Tensor, position_ids: Tensor, real: Tensor | None) -> Tensor:
    """``[B, N]``: the target of token i is the label of token i + 1 inside the same document."""
    labels = labels.long()
    if real is not None:
        labels = labels.masked_fill(~real, IGNORE_INDEX)
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    next_starts_document = document_starts(position_ids)[:, 1:]
    shifted[:, :-1] = shifted[:, :-1].masked_fill(next_starts_document, IGNORE_INDEX)
    return shifted


def shard_batch(batch: Mapping[str, Any], sp_rank: int, sp_size: int, ring_size: int = 1) -> dict[str, Any]:
    """Slice every per-token tensor of a prepared batch to this rank's ``[B, N / sp_size]`` shard.

    Without a ring, rank ``r`` keeps columns ``[r * N/sp, (r + 1) * N/sp)``; with one, the columns of
    :func:`shard_index` (two zigzag pieces). Other entries are passed through.
    """
    seq_len = batch["input_ids"].shape[1]
    multiple = shard_multiple(sp_size, ring_size)
    if seq_len % multiple:
        raise ValueError(
            f"Sequence length {seq_len} is not a multiple of {multiple} (sp_size={sp_size}, ring_size={ring_size}); "
            "call prepare_batch first."
        )
    per_token = set(_classify(batch, batch["input_ids"].shape[0], seq_len))
    return {
        key: shard_sequence(value, sp_rank, sp_size, ring_size) if key in per_token else value
        for key, value in batch.items()
    }


def shard_sequence(tensor: Tensor, sp_rank: int, sp_size: int, ring_size: int = 1) -> Tensor:
    """``[B, N, ...] -> [B, N / sp_size, ...]``: SP rank ``sp_rank``'s columns of one whole-sequence tensor, as
    :func:`shard_batch` cuts them."""
    seq_len = tensor.shape[1]
    local = seq_len // sp_size
    if ring_size == 1:
        return tensor[:, sp_rank * local : (sp_rank + 1) * local]
    return tensor.index_select(1, shard_index(seq_len, sp_rank, sp_size, ring_size).to(tensor.device))
