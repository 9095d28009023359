"""Long-document text data: local files in, ``{input_ids, position_ids, attention_mask}`` batches out.

Nothing is fetched at run time. Text comes from local files or folders; with no path given, the
Python standard library's own source files serve as the corpus (every machine has them: long,
real documents). Tokens come from a local Hugging Face tokenizer, or from :class:`ByteTokenizer`,
which needs no files at all.

Two ways to turn documents into ``[seq_len]`` samples (documents longer than ``seq_len`` are first
cut into pieces of at most ``seq_len`` tokens):

* ``"documents"``: one piece per sample; the collate function right-pads a batch to its longest
  row and marks padding with ``attention_mask == 0``.
* ``"packed"``: pieces are concatenated into full rows of ``seq_len`` tokens; ``position_ids``
  restart at 0 at every piece, so under :class:`~lightning_ulysses.UlyssesStrategy` attention
  never crosses a document border and the label across a border is ignored.
"""

from __future__ import annotations

import functools
import random
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

STDLIB = "stdlib"
"""The ``paths`` value that stands for the Python standard library's ``*.py`` files."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary file, no download, every text encodable.

    Ids: 0 padding, 1 beginning of document, 2 end of document, ``3 + byte`` for each byte.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    offset = 3
    vocab_size = offset + 256

    def encode(self, text: str) -> np.ndarray:
        """``[bos, bytes..., eos]`` as an int64 array."""
        body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + self.offset
        return np.concatenate([[self.bos_token_id], body, [self.eos_token_id]])

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - self.offset for i in ids if i >= self.offset).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size


def find_text_files(paths: Sequence[str], pattern: str) -> list[Path]:
    """Every file matched by ``paths`` (files, or folders searched recursively for ``pattern``), sorted.

    ``"stdlib"`` stands for the standard library folder of the running Python.
    """
    files: set[Path] = set()
    for entry in paths:
        path = Path(sysconfig.get_paths()["stdlib"] if entry == STDLIB else entry).expanduser()
        if path.is_file():
            files.add(path)
        elif path.is_dir():
            files.update(p for p in path.rglob(pattern) if p.is_file())
        else:
            raise FileNotFoundError(f"Data path {str(path)!r} does not exist. Give existing files or folders in data.paths.")
    if not files:
        raise FileNotFoundError(f"No file in {list(paths)} matches {pattern!r}. Change data.paths or data.pattern.")
    return sorted(files)


def split_documents(documents: list[np.ndarray], max_len: int) -> list[np.ndarray]:
    """Cut every document into consecutive pieces of at most ``max_len`` tokens."""
    return [doc[start : start + max_len] for doc in documents for start in range(0, len(doc), max_len)]


def pack_documents(pieces: list[np.ndarray], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate ``pieces`` (each at most ``seq_len`` tokens) into rows of exactly ``seq_len``.

    Returns ``input_ids`` and ``position_ids``, both ``[rows, seq_len]``; position ids count from 0 in
    every piece. A piece that runs over a row's end continues in the next row (whose first column
    starts a new document for the attention anyway). The last incomplete row is dropped.
    """
    if not pieces:
        return np.zeros((0, seq_len), dtype=np.int64), np.zeros((0, seq_len), dtype=np.int64)
    tokens = np.concatenate(pieces)
    positions = np.concatenate([np.arange(len(piece)) for piece in pieces])
    rows = len(tokens) // seq_len
    return tokens[: rows * seq_len].reshape(rows, seq_len), positions[: rows * seq_len].reshape(rows, seq_len)


class PackedDataset(Dataset):
    """Rows of packed documents: ``{"input_ids": [seq_len], "position_ids": [seq_len]}``."""

    def __init__(self, pieces: list[np.ndarray], seq_len: int) -> None:
        input_ids, position_ids = pack_documents(pieces, seq_len)
        self.input_ids = torch.from_numpy(input_ids)
        self.position_ids = torch.from_numpy(position_ids)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids[index], "position_ids": self.position_ids[index]}


class DocumentDataset(Dataset):
    """One document piece per sample: ``{"input_ids": [length]}`` with ``length <= seq_len``."""

    def __init__(self, pieces: list[np.ndarray]) -> None:
        self.pieces = [torch.from_numpy(piece) for piece in pieces]

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.pieces[index]}


def collate_right_padded(samples: list[dict[str, Tensor]], pad_token_id: int = 0) -> dict[str, Tensor]:
    """Stack samples into ``[B, N]`` tensors, ``N`` the longest sample; pad on the right.

    ``attention_mask`` (1 real, 0 padding) is added; padded ``position_ids`` are 0 (the strategy
    renumbers padding as documents of its own).
    """
    length = max(len(s["input_ids"]) for s in samples)
    batch: dict[str, Tensor] = {}
    for key in samples[0]:
        fill = pad_token_id if key == "input_ids" else 0
        batch[key] = torch.stack([torch.nn.functional.pad(s[key], (0, length - len(s[key])), value=fill) for s in samples])
    batch["attention_mask"] = torch.stack(
        [(torch.arange(length) < len(s["input_ids"])).long() for s in samples]
    )
    return batch


class LongTextDataModule(L.LightningDataModule):
    """Local text files as long causal-LM sequences.

    Args:
        paths: files or folders (searched recursively for ``pattern``); ``"stdlib"`` is the Python
            standard library's source folder (the default corpus: present on every machine).
        pattern: glob for files inside folders.
        tokenizer: ``"byte"`` (built in, 259 ids) or the path of a local Hugging Face tokenizer.
        seq_len: tokens per sample (before the strategy pads it to a multiple of ``sp_size`` and
            shards it: each rank holds ``seq_len / sp_size`` tokens).
        mode: ``"packed"`` (full rows of several documents) or ``"documents"`` (one per sample, padded).
        batch_size: samples per micro-batch and per data-parallel group (the SP ranks of a group share them).
        val_fraction: share of the files held out for validation (at least one file).
        max_files: read only the first ``max_files`` files of the shuffled list (``None``: all).
        num_workers: DataLoader worker processes.
        seed: seed of the file shuffle that decides the train/validation split.
    """

    def __init__(
        self,
        paths: Sequence[str] = (STDLIB,),
        pattern: str = "*.py",
        tokenizer: str = "byte",
        seq_len: int = 2048,
        mode: Literal["packed", "documents"] = "packed",
        batch_size: int = 1,
        val_fraction: float = 0.05,
        max_files: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if seq_len < 2:
            raise ValueError(f"data.seq_len must be at least 2 tokens, got {seq_len}.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction must be between 0 and 1 (exclusive), got {val_fraction}.")
        if mode not in ("packed", "documents"):
            raise ValueError(f"data.mode must be 'packed' or 'documents', got {mode!r}.")
        self.paths = list(paths)
        self.pattern = pattern
        self.tokenizer = ByteTokenizer() if tokenizer == "byte" else _load_hf_tokenizer(tokenizer)
        self.seq_len = seq_len
        self.mode = mode
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_files = max_files
        self.num_workers = num_workers
        self.seed = seed
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to ``vocab_size - 1``; the model's embedding must be at least this large."""
        return len(self.tokenizer)

    def setup(self, stage: str) -> None:
        if self.train_dataset is not None:
            return
        files = find_text_files(self.paths, self.pattern)
        random.Random(self.seed).shuffle(files)
        files = files[: self.max_files]
        if len(files) < 2:
            raise ValueError(f"Need at least 2 files for a train/validation split, found {len(files)} in {self.paths}.")
        num_val = max(1, round(len(files) * self.val_fraction))
        self.val_dataset = self._dataset(files[:num_val])
        self.train_dataset = self._dataset(files[num_val:])
        for name, dataset in (("training", self.train_dataset), ("validation", self.val_dataset)):
            if len(dataset) == 0:
                raise ValueError(
                    f"The {name} split has no full sample of seq_len={self.seq_len} tokens. Add files, raise "
                    "data.max_files or data.val_fraction, or lower data.seq_len."
                )

    def _dataset(self, files: list[Path]) -> Dataset:
        texts = (path.read_text(encoding="utf-8", errors="replace") for path in files)
        pieces = split_documents([self._encode(text) for text in texts if text.strip()], self.seq_len)
        return PackedDataset(pieces, self.seq_len) if self.mode == "packed" else DocumentDataset(pieces)

    def _encode(self, text: str) -> np.ndarray:
        if isinstance(self.tokenizer, ByteTokenizer):
            return self.tokenizer.encode(text)
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return np.asarray(ids, dtype=np.int64)

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("LongTextDataModule.setup() must run before its dataloaders are requested.")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return DataLoader(
            dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
            collate_fn=functools.partial(collate_right_padded, pad_token_id=pad), persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """The held-out files (the validation split): there is no third split."""
        return self._loader(self.val_dataset, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """The held-out files, in order (``CausalLM.predict_step`` scores every next token)."""
        return self._loader(self.val_dataset, shuffle=False)


def _load_hf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    if not Path(path).expanduser().is_dir():
        raise FileNotFoundError(
            f"data.tokenizer={path!r} is neither 'byte' nor a local tokenizer folder. Nothing is downloaded at run "
            "time: save the tokenizer first (AutoTokenizer.from_pretrained(name).save_pretrained(folder)) and give "
            "the folder."
        )
    return AutoTokenizer.from_pretrained(Path(path).expanduser())
