"""What the fine-tuning data modules share: local record files, a tokenizer, a train/validation split, loaders."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import lightning as L
from torch.utils.data import DataLoader, Dataset

from lightning_ulysses.data import (
    check_data_arguments,
    check_paths_exist,
    check_sample_shape,
    collate_right_padded,
    warn_on_empty_shards,
)
from lightning_ulysses.finetune.packing import Truncation
from lightning_ulysses.finetune.records import load_records
from lightning_ulysses.finetune.tokenizer import load_tokenizer
from lightning_ulysses.sp_loaders import worker_start_method

if TYPE_CHECKING:
    import datasets

    from lightning_ulysses.finetune.packing import DataReport


@contextlib.contextmanager
def _progress_bars_of_rank_zero(trainer: L.Trainer | None) -> Iterator[None]:
    """``datasets``' progress bars (reading, tokenizing) on global rank 0 only: every rank reads and tokenizes the same
    records, and the bars of several ranks on one terminal garble each other's lines."""
    import datasets

    hide = trainer is not None and trainer.global_rank > 0 and not datasets.are_progress_bars_disabled()
    if hide:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if hide:
            datasets.enable_progress_bars()


class RecordsDataModule(L.LightningDataModule):
    """Reads ``paths`` (and ``val_paths``, or holds out ``val_fraction`` of the records) once per process and turns
    each split into a Dataset with :meth:`build`. Batches are right-padded (``attention_mask``) by
    :func:`~lightning_ulysses.data.collate_right_padded`; the strategy wraps the training loader to resume mid-epoch."""

    collate: Callable[..., dict[str, Any]] = staticmethod(collate_right_padded)
    """``(samples, pad_token_id) -> batch``: how the loaders batch this module's samples."""

    def __init__(
        self,
        paths: Sequence[str],
        tokenizer: str,
        seq_len: int,
        truncation: Truncation,
        batch_size: int,
        val_paths: Sequence[str] | None,
        val_fraction: float,
        num_proc: int | None,
        num_workers: int,
        seed: int,
    ) -> None:
        super().__init__()
        check_sample_shape(seq_len, batch_size)
        if truncation not in ("truncate", "drop", "refuse"):
            raise ValueError(f"data.truncation must be 'truncate', 'drop' or 'refuse', got {truncation!r}.")
        if not val_paths and not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction must be between 0 and 1 (exclusive), got {val_fraction}.")
        self.paths, self.val_paths = list(paths), list(val_paths or [])
        self.tokenizer = load_tokenizer(tokenizer)
        self.seq_len, self.truncation, self.batch_size, self.val_fraction = (
            seq_len,
            truncation,
            batch_size,
            val_fraction,
        )
        self.num_proc, self.num_workers, self.seed = num_proc, num_workers, seed
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.reports: dict[str, DataReport] = {}
        """``"training"`` / ``"validation"`` -> what became of that split's records (logged at set-up)."""

    @classmethod
    def check_arguments(cls, args: Mapping[str, Any]) -> None:
        """:func:`~lightning_ulysses.data.check_data_arguments` of the init arguments ``args``, and ``val_paths`` (the
        CLI calls it before any process starts)."""
        check_data_arguments(args, args["paths"], globs=True)
        check_paths_exist(args.get("val_paths") or [], "data.val_paths", globs=True)

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to ``vocab_size - 1``; the model's embedding must be at least this large."""
        return len(self.tokenizer)

    def build(self, records: datasets.Dataset, name: str) -> Dataset:
        """The Dataset of one split (``name``: ``"training"`` or ``"validation"``); records ``reports[name]``."""
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        if self.trainer is not None:
            warn_on_empty_shards(self.seq_len, getattr(self.trainer.strategy, "sp_size", 1))
        if self.train_dataset is not None:
            return
        with _progress_bars_of_rank_zero(self.trainer):
            records = load_records(self.paths)
            if self.val_paths:
                train, val = records, load_records(self.val_paths, "data.val_paths")
            else:
                test_size = max(1, round(len(records) * self.val_fraction))
                split = records.train_test_split(test_size=test_size, seed=self.seed)
                train, val = split["train"], split["test"]
            self.train_dataset, self.val_dataset = self.build(train, "training"), self.build(val, "validation")

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before its dataloaders are requested.")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=functools.partial(self.collate, pad_token_id=self.tokenizer.pad_token_id or 0),
            persistent_workers=self.num_workers > 0,
            multiprocessing_context=worker_start_method(self.num_workers),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)
