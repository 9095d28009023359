"""Evaluation and prediction when the samples do not divide over the DP ranks: every rank runs the same batches.

Every forward under ZeRO-3 gathers parameters from all ranks, and tiled MLPs agree on their tile count with an
all-reduce: a rank that runs one batch fewer than the others leaves them blocked in those collectives (until the
timeout). Lightning's validation and test samplers (``DistributedSampler``) pad every DP rank to
``ceil(N / dp)`` samples with repeats of the first ones, as for DDP, so the batch counts agree, but each repeat
counts twice in the metrics; its predict sampler repeats nothing and leaves the ranks with different counts.

:func:`pad_over_dp_ranks` gives every evaluation and prediction loader that padded sampler and wraps it in
:class:`MarkDuplicates`, which finds the repeated rows of each batch (always the last ones of a rank's stream) and
notes them in the strategy's :class:`RepeatedRows`, kept for the batch's ``input_ids`` tensor: the batch itself
travels as the loader made it. The strategy takes them with the batch into its
:class:`~lightning_ulysses.batch.ShardedBatch` and masks their labels (``shift_labels = IGNORE_INDEX``), so token
losses and the metrics of :mod:`lightning_ulysses.metrics` count every sample once, exposes them as
``UlyssesStrategy.repeated_rows``, gives Lightning the batch's real rows as the batch size that weighs values logged
per evaluation batch (repeats weigh 0), and drops their rows from ``predict_step``'s output, from the batch that later
hooks see and from the batch indices that prediction writers get (:func:`drop_rows`). Loaders whose sampler is not
Lightning's distributed one are left as they are.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sized
from typing import Any, cast

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.utils.data import DistributedSampler

from lightning_ulysses.engines import lightning as lightning_engine
from lightning_ulysses.engines.lightning import DatasetSamplerWrapper, IndexBatchSamplerWrapper
from lightning_ulysses.sp_loaders import index_batch_sampler


class RepeatedRows:
    """The repeated rows of the evaluation batches that :class:`MarkDuplicates` yielded and the strategy has not taken
    yet, each noted for its batch's ``input_ids`` tensor (weakly: a batch that is never transferred leaves nothing)."""

    def __init__(self) -> None:
        self._pending: list[tuple[weakref.ref[Tensor], Tensor]] = []

    def note(self, input_ids: Tensor, repeated: Tensor) -> None:
        """Note ``repeated`` (``[B]`` bool) for the batch whose ``input_ids`` tensor is ``input_ids``."""
        self._pending = [entry for entry in self._pending if entry[0]() is not None]
        self._pending.append((weakref.ref(input_ids), repeated))

    def take(self, input_ids: Tensor) -> Tensor | None:
        """The repeated rows noted for the batch whose ``input_ids`` tensor is ``input_ids`` (``None``: it has none),
        forgetting them and every note before them (batches yielded earlier that never arrived)."""
        for index, (ref, repeated) in enumerate(self._pending):
            if ref() is input_ids:
                del self._pending[: index + 1]
                return repeated
        return None


def pad_over_dp_ranks(loader: Any, repeated_rows: RepeatedRows) -> Any:
    """``loader`` with the same number of samples on every DP rank and its repeats marked (see the module docstring).

    Lightning's predict sampler (no repeats) is replaced in place by its padded counterpart, in the batch sampler
    that the loader iterates.
    """
    inner = index_batch_sampler(loader)
    sampler = getattr(inner, "sampler", None)
    if isinstance(sampler, UnrepeatedDistributedSamplerWrapper):
        original = lightning_engine.wrapped_sampler(cast(DatasetSamplerWrapper, sampler.dataset))
        replicas, rank = sampler.num_replicas, sampler.rank
        sampler = DistributedSamplerWrapper(original, num_replicas=replicas, rank=rank, shuffle=False)
        inner.sampler = sampler  # read at every iteration, and by len()
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return loader
    unique = len(range(sampler.rank, len(cast(Sized, sampler.dataset)), sampler.num_replicas))
    return loader if unique == sampler.num_samples else MarkDuplicates(loader, unique, repeated_rows)


class MarkDuplicates:
    """Wraps an evaluation or prediction loader whose rank holds ``unique`` samples followed by repeats.

    For each dict batch that holds repeats it notes in ``repeated_rows`` a ``[B]`` bool, True from the ``unique``-th
    row of the rank's stream on, and yields the batch as it is; with Lightning's index-tracking batch sampler
    (prediction), the batch's recorded indices lose those rows. Everything else (``len``, ``batch_sampler``, ...) is
    the wrapped loader's.
    """

    def __init__(self, loader: Any, unique: int, repeated_rows: RepeatedRows) -> None:
        self.loader, self.unique, self.repeated_rows = loader, unique, repeated_rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        seen = 0
        for index, batch in enumerate(self.loader):
            if not isinstance(batch, Mapping) or "input_ids" not in batch:
                yield batch  # the strategy refuses it with the reason
                continue
            rows = len(batch["input_ids"])
            duplicate = torch.arange(seen, seen + rows) >= self.unique
            seen += rows
            if duplicate.any():
                if isinstance(batch_sampler, IndexBatchSamplerWrapper):
                    del batch_sampler.seen_batch_indices[index][rows - int(duplicate.sum()) :]
                self.repeated_rows.note(batch["input_ids"], duplicate)
            yield batch


def drop_rows(data: Any, keep: Tensor) -> Any:
    """``data`` with every tensor whose first dimension is the batch (``len(keep)``) cut to the rows in ``keep``
    (``[B]`` bool); other values as they are. Dict batches are changed in place (later hooks see the same dict)."""

    def cut(tensor: Tensor) -> Tensor:
        return tensor[keep.to(tensor.device)] if tensor.dim() and len(tensor) == len(keep) else tensor

    if isinstance(data, dict):
        data.update(apply_to_collection(data, Tensor, cut))
        return data
    return apply_to_collection(data, Tensor, cut)
