"""One loader batch as one rank runs it: :class:`ShardedBatch`, built by :func:`shard_loader_batch`.

``UlyssesStrategy.batch_to_device`` turns every loader batch into one ``ShardedBatch`` (pure, no communication) and
keeps it as :attr:`UlyssesStrategy.sharded_batch` until the next batch arrives; everything that needs more of the
batch than this rank's shards reads it from there, as data::

    loader batch ─► ShardedBatch ─┬─► inputs: the dict the LightningModule's step receives ([B, N/sp] shards)
                                  ├─► the patched model's forward: the documents of the whole position ids
                                  │   (no all-gather of the shards), the attention plans built from them
                                  └─► the loss (LossContext.batch): padding, repeated rows, the step's token count

The documents are found from the whole position ids, before they were cut (one host sync per batch and chunk size,
none inside a layer). The repeated rows of evaluation (:class:`~lightning_ulysses.runtime.eval_data.RepeatedRows`)
and the step's token count of ``loss_normalization="global"`` (:class:`~lightning_ulysses.loss.StepTokenCounts`) come
from the strategy's loader wrappers, noted beside the batch, never as keys in it: the batch reaches the
LightningModule's hooks as the loader made it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_ulysses.attention.documents import Documents
from lightning_ulysses.sharding import IGNORE_INDEX, prepare_batch, shard_batch, shard_sequence


@dataclass(frozen=True)
class ShardedBatch:
    """A loader batch, prepared whole (:func:`~lightning_ulysses.sharding.prepare_batch`) and cut to one rank's shard.

    ``inputs``: what the LightningModule's step receives: every per-token entry cut to ``[B, N/sp]`` (``input_ids``,
    ``position_ids``, ``shift_labels``, ...; the labels of ``repeated_rows`` set to ``-100``), every other entry as
    loaded. ``position_ids``: ``[B, N]`` the whole rows of global position ids in sequence order (``N`` padded to a
    multiple of the shard count), of which ``inputs["position_ids"]`` is this rank's shard. ``padding``: ``[B, N/sp]``
    bool, this rank's padding tokens (the batch's ``attention_mask`` zeros and the columns
    :func:`~lightning_ulysses.sharding.prepare_batch` appended). ``loaded_shape``: ``(B, N)`` as loaded, before padding.
    ``repeated_rows``: ``[B]`` bool on an evaluation or prediction batch, the rows the distributed sampler repeated to
    even out the DP ranks (``None``: none). ``step_valid_tokens``: under ``loss_normalization="global"``, this SP
    group's valid tokens in the running optimizer step (``None`` elsewhere).
    """

    inputs: dict[str, Any]
    position_ids: Tensor
    padding: Tensor
    loaded_shape: tuple[int, int]
    repeated_rows: Tensor | None = None
    step_valid_tokens: int | None = None
    _documents: dict[int | None, Documents] = field(default_factory=dict, compare=False, repr=False)

    def documents(self, chunk: int | None = None) -> Documents:
        """The documents of the whole rows (with ``chunk``: cut into chunks of that many positions, see
        :meth:`~lightning_ulysses.attention.documents.Documents.from_position_ids`), found once per chunk size (one
        host sync) and kept with the batch, with every plan built from them."""
        if chunk not in self._documents:
            self._documents[chunk] = Documents.from_position_ids(self.position_ids, chunk)
        return self._documents[chunk]

    @property
    def documents_by_chunk(self) -> dict[int | None, Documents]:
        """The documents found so far, by chunk size (filled by :meth:`documents`; shared, not copied)."""
        return self._documents


def shard_loader_batch(
    batch: Mapping[str, Any],
    sp_rank: int,
    sp_size: int,
    ring_size: int = 1,
    repeated_rows: Tensor | None = None,
    step_valid_tokens: int | None = None,
) -> ShardedBatch:
    """The :class:`ShardedBatch` of SP rank ``sp_rank`` of a whole loader ``batch`` (a dict with ``input_ids [B, N]``,
    see :func:`~lightning_ulysses.sharding.prepare_batch`), its shards cut as
    :func:`~lightning_ulysses.sharding.shard_batch` cuts them. Pure: no communication, no host sync."""
    prepared = prepare_batch(batch, sp_size, ring_size)
    inputs = shard_batch(prepared, sp_rank, sp_size, ring_size)
    if repeated_rows is not None:  # repeated to even out the DP ranks: no token of theirs counts
        inputs["shift_labels"][repeated_rows.to(inputs["shift_labels"].device)] = IGNORE_INDEX
    padding = shard_sequence(padding_tokens(batch, prepared), sp_rank, sp_size, ring_size)
    batch_size, seq_len = batch["input_ids"].shape
    return ShardedBatch(
        inputs, prepared["position_ids"], padding, (batch_size, seq_len), repeated_rows, step_valid_tokens
    )


def padding_tokens(batch: Mapping[str, Tensor], prepared: Mapping[str, Tensor]) -> Tensor:
    """``[B, N']`` bool: the padding tokens of ``prepared``, :func:`~lightning_ulysses.sharding.prepare_batch` of
    ``batch``: the columns it appended and the zeros of the batch's ``attention_mask``."""
    padding = torch.zeros_like(prepared["input_ids"], dtype=torch.bool)
    padding[:, batch["input_ids"].shape[1] :] = True
    if "attention_mask" in prepared:
        padding |= prepared["attention_mask"] == 0
    return padding


BatchSource = Callable[[], "ShardedBatch | None"]
"""``() -> ShardedBatch | None``: the batch the strategy is running (``UlyssesStrategy.sharded_batch``), which a
patched model's forward reads its documents from (:mod:`lightning_ulysses.hf.forward`); ``None`` outside a batch."""
