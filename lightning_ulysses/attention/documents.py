"""The document layout of a batch, found once per batch, and the per-batch plans the kernels derive from it.

Documents (packed samples, padding runs) are read from the global ``position_ids``: a token starts a document
when it is first in its row or its position id is 0 (see :mod:`lightning_ulysses.sharding`). Finding them costs
one host sync (the offsets are copied to the host once); every plan a backend derives from them (SDPA's
length classes, flex's ``BlockMask``) is built once per batch and kept on the :class:`Documents`, so the
attention layers, and their recomputation under activation checkpointing, run without host syncs.

The whole rows come from the strategy's :class:`~lightning_ulysses.batch.ShardedBatch`, as they were before the batch
was cut (:func:`use_whole_rows`, which the patched forward calls); a shard without them is all-gathered once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

from lightning_ulysses.attention.collectives import gather_sequence
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.sharding import document_starts

PlanT = TypeVar("PlanT")


@dataclass(frozen=True)
class Documents:
    """Where the documents of a ``[B, N]`` batch start.

    ``cu_seqlens`` holds the offsets of every document in the flattened ``[B * N]`` token axis
    (row starts included) followed by ``B * N``: the varlen format of flash-attn; ``offsets`` is the same on
    the host. ``max_position`` is the largest position id of the whole rows (a 0-d tensor on their device):
    what a RoPE whose frequencies depend on the sequence length (dynamic NTK, longrope) must see on every rank.
    """

    starts: Tensor  # [B, N] bool
    cu_seqlens: Tensor  # [num_documents + 1] int32
    offsets: tuple[int, ...]  # cu_seqlens on the host
    max_position: Tensor  # [] long
    _plans: dict[Hashable, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_position_ids(cls, position_ids: Tensor, chunk: int | None = None) -> Documents:
        """The documents of whole ``[B, N]`` rows of position ids (one host sync); with ``chunk``, every position id
        divisible by it also starts one, so that a token attends only inside its chunk (Llama 4's chunked attention)."""
        starts = document_starts(position_ids)
        if chunk is not None:
            starts |= position_ids % chunk == 0
        offsets = starts.flatten().nonzero().flatten()
        total = torch.tensor([starts.numel()], device=offsets.device, dtype=offsets.dtype)
        cu_seqlens = torch.cat([offsets, total]).to(torch.int32)
        return cls(starts, cu_seqlens, tuple(cu_seqlens.tolist()), position_ids.max())

    @functools.cached_property
    def max_seqlen(self) -> int:
        """The length of the longest document."""
        return max(end - begin for begin, end in zip(self.offsets[:-1], self.offsets[1:]))

    @property
    def one_per_row(self) -> bool:
        """True when every row is a single causal document (no packing, no padding runs)."""
        return len(self.offsets) - 1 == self.starts.shape[0]

    @property
    def document_ids(self) -> Tensor:
        """``[B, N]`` long: the index of each token's document inside its row."""
        return self.starts.long().cumsum(dim=1)

    def plan(self, key: Hashable, build: Callable[[Documents], PlanT]) -> PlanT:
        """``build(self)``, built once per ``key`` (a backend's plan for these documents) and kept with them."""
        if key not in self._plans:
            self._plans[key] = build(self)
        return self._plans[key]


@dataclass(frozen=True)
class _GatheredPositions:
    """The whole ``[B, N]`` rows of one ``[B, N/P]`` shard tensor of position ids, and their documents per chunk size
    (filled as layers ask for them)."""

    position_ids: Tensor  # [B, N]
    documents: dict[int | None, Documents] = field(default_factory=dict)


def documents_of(position_ids: Tensor, group: SequenceParallelGroups, chunk: int | None = None) -> Documents:
    """The documents (cut into chunks of ``chunk`` positions, see :meth:`Documents.from_position_ids`) of the whole
    rows whose ``[B, N/P]`` shard of global position ids is ``position_ids``.

    Every attention layer of a forward (and its recomputation under activation checkpointing) receives
    the same ``position_ids`` tensor, so with the same ``group`` (the strategy's, or a patched model's own) the
    all-gather runs once per batch and the host sync of finding the document starts once per batch and chunk size,
    not once per layer (layers may alternate chunked and global attention): the gathered ids and their documents
    (with the plans built from them) are kept in its ``cache`` for the same tensor object at the same version (an
    in-place edit recomputes); every rank of the group sees the same sequence of tensors and so takes the same
    branch, collectives included.
    """
    gathered = _gathered(position_ids, group)
    if chunk not in gathered.documents:
        gathered.documents[chunk] = Documents.from_position_ids(gathered.position_ids, chunk)
    return gathered.documents[chunk]


def whole_position_ids(position_ids: Tensor, group: SequenceParallelGroups) -> Tensor:
    """The whole ``[B, N]`` rows, in sequence order, of the ``[B, N/P]`` shard ``position_ids`` of global position ids:
    all-gathered once per tensor and kept with its documents (see :func:`documents_of`; no host sync)."""
    return _gathered(position_ids, group).position_ids


def use_whole_rows(
    position_ids: Tensor, whole: Tensor, documents: dict[int | None, Documents], group: SequenceParallelGroups
) -> None:
    """Let :func:`documents_of` and :func:`whole_position_ids` of the ``[B, N/P]`` shard ``position_ids`` read
    ``whole``, its ``[B, N]`` rows as they were before they were cut (a
    :class:`~lightning_ulysses.batch.ShardedBatch`'s), with ``documents`` (by chunk size, filled and shared) instead
    of all-gathering the shards: kept in ``group``'s cache for that tensor."""
    group.cache.get(position_ids, lambda: _GatheredPositions(whole, documents))


def _gathered(position_ids: Tensor, group: SequenceParallelGroups) -> _GatheredPositions:
    """The whole rows of ``position_ids``, from ``group``'s cache."""

    def gather() -> _GatheredPositions:
        return _GatheredPositions(gather_sequence(position_ids, group))

    return group.cache.get(position_ids, gather)
