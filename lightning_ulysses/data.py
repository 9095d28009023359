"""Long-document text data: local files in, ``{input_ids, position_ids, attention_mask}`` batches out.

Nothing is fetched at run time. Text comes from local files or folders; with no path given, the
Python standard library's own source files serve as the corpus (every machine has them: long,
real documents). Files that are not UTF-8 text (binary files, other encodings) are skipped with one
warning. Tokens come from a local Hugging Face tokenizer, or from :func:`byte_tokenizer`
(transformers' ``ByT5Tokenizer``: UTF-8 bytes, no files, saved with an exported model).

The shuffled files are split three ways, by file: ``val_fraction`` for validation, ``test_fraction`` for
``test`` and the rest for training, so no document is in two splits.

Two ways to turn documents into ``[seq_len]`` samples (documents longer than ``seq_len`` are first
cut into pieces of at most ``seq_len`` tokens):

* ``"documents"``: one piece per sample; the collate function right-pads a batch to its longest
  row and marks padding with ``attention_mask == 0``.
* ``"packed"``: pieces are concatenated into full rows of ``seq_len`` tokens; ``position_ids``
  restart at 0 at every piece, so under :class:`~lightning_ulysses.UlyssesStrategy` attention
  never crosses a document border and the label across a border is ignored.

Written here rather than taken from a library: transformers' ``DataCollatorWithFlattening`` flattens each
batch into one row of varying length, not ``[B, seq_len]`` rows (the global batch, the shards and the rows a
checkpoint resumes at would change with the data), and ``DataCollatorWithPadding`` pads through
``tokenizer.pad``, which does not pad ``position_ids``. The files are read into memory once per process (as
token rows); ``datasets`` (memory-mapped Arrow, cached) would pay off for corpora that do not fit in memory,
which this module does not target.
"""

from __future__ import annotations

import functools
import glob
import os
import random
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_ulysses.sp_loaders import worker_start_method

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

STDLIB = "stdlib"
"""The ``paths`` value that stands for the Python standard library's own files (:func:`standard_library_files`)."""

THIRD_PARTY_FOLDERS = frozenset({"site-packages", "dist-packages"})
"""Where packages are installed inside the interpreter's library folder: not the standard library."""

BYTE = "byte"
"""The ``tokenizer`` value that stands for :func:`byte_tokenizer`."""


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """UTF-8 bytes as tokens: transformers' ``ByT5Tokenizer(extra_ids=0)``, 259 ids, no vocabulary file.

    Ids: 0 ``<pad>``, 1 ``</s>`` (end of document), 2 ``<unk>`` (never produced), ``3 + byte`` for each byte.
    ``save_pretrained`` writes it next to an exported model, which ``AutoTokenizer`` then loads.
    """
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer(extra_ids=0)


def find_text_files(paths: Sequence[str], pattern: str) -> list[Path]:
    """Every file matched by ``paths`` (files, or folders searched recursively for ``pattern``), sorted.

    ``"stdlib"`` stands for the standard library's files (:func:`standard_library_files`).
    """
    files: set[Path] = set()
    for entry in paths:
        path = Path(entry).expanduser()
        if entry == STDLIB:
            files.update(standard_library_files(pattern))
        elif path.is_file():
            files.add(path)
        elif path.is_dir():
            files.update(p for p in path.rglob(pattern) if p.is_file())
        else:
            check_paths_exist([entry], "data.paths")
    if not files:
        raise FileNotFoundError(f"No file in {list(paths)} matches {pattern!r}. Change data.paths or data.pattern.")
    return sorted(files)


def standard_library_files(pattern: str) -> list[Path]:
    """The files of the standard library that match ``pattern``, sorted: the base interpreter's library folder
    (``sysconfig``'s ``stdlib``, also from inside a virtual environment) without its ``site-packages`` /
    ``dist-packages``, whose third-party packages differ from machine to machine."""
    files: list[Path] = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        # not walked at all: a base interpreter's site-packages can hold several times the library's own files
        subfolders[:] = [name for name in subfolders if name not in THIRD_PARTY_FOLDERS]
        files.extend(path for path in map(Path(folder).joinpath, names) if path.match(pattern) and path.is_file())
    return sorted(files)


def check_paths_exist(paths: Sequence[str], key: str, globs: bool = False) -> None:
    """Refuse the first entry of ``paths`` (the value of the config key ``key``) that is no file or folder (nor, with
    ``globs``, a pattern that matches a file): a cheap check, before anything is read."""
    for entry in paths:
        path = Path(entry).expanduser()
        if not path.exists() and not (globs and any(Path(p).is_file() for p in glob.glob(str(path), recursive=True))):
            raise FileNotFoundError(
                f"{key}: {entry!r} does not exist{' (nor matches a file as a glob)' if globs else ''}. Give existing "
                f"files or folders (--{key} '[path/to/data]')."
            )


def check_data_arguments(args: Mapping[str, Any], paths: Sequence[str], globs: bool = False) -> None:
    """Refuse what a data module's init arguments ``args`` alone show cannot run, before anything is read: rows too
    short, no sample per batch, a tokenizer folder or an entry of ``paths`` (``data.paths``, read as globs with
    ``globs``) that does not exist. Raises ``ValueError`` or ``FileNotFoundError`` naming the key."""
    check_sample_shape(args["seq_len"], args["batch_size"])
    check_tokenizer(args["tokenizer"])
    check_paths_exist(paths, "data.paths", globs)


def read_text_files(files: Sequence[Path]) -> tuple[dict[Path, str], list[Path]]:
    """The text of every file that is UTF-8 text (in the order given), and the files that are not."""
    texts, skipped = {}, []
    for path in files:
        text = _decode_text(path.read_bytes())
        if text is None:
            skipped.append(path)
        else:
            texts[path] = text
    return texts, skipped


def _decode_text(data: bytes) -> str | None:
    """``data`` as text, or ``None`` for binary data: bytes that are not UTF-8, or a NUL byte (valid UTF-8, but
    no text file holds one, while most binary formats do)."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


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
        batch[key] = torch.stack(
            [torch.nn.functional.pad(s[key], (0, length - len(s[key])), value=fill) for s in samples]
        )
    batch["attention_mask"] = torch.stack([(torch.arange(length) < len(s["input_ids"])).long() for s in samples])
    return batch


class LongTextDataModule(L.LightningDataModule):
    """Local text files as long causal-LM sequences.

    Args:
        paths: files or folders (searched recursively for ``pattern``); ``"stdlib"`` is the Python
            standard library's own files (the default corpus: the same on every machine with this Python version).
        pattern: glob for files inside folders. Files that are not UTF-8 text are skipped with a warning.
        tokenizer: ``"byte"`` (:func:`byte_tokenizer`, 259 ids) or the path of a local Hugging Face tokenizer.
        seq_len: tokens per sample (before the strategy pads it to a multiple of ``sp_size`` and
            shards it: each rank holds ``seq_len / sp_size`` tokens).
        mode: ``"packed"`` (full rows of several documents) or ``"documents"`` (one per sample, padded).
        batch_size: samples per micro-batch and per data-parallel group (the SP ranks of a group share them).
        val_fraction: share of the files held out for validation (at least one file).
        test_fraction: share of the files held out for ``test`` (at least one file; 0: no test split), disjoint
            from the validation and training files.
        max_files: read only the first ``max_files`` files of the shuffled list (``None``: all).
        num_workers: DataLoader worker processes.
        seed: seed of the file shuffle that decides the splits: the first ``val_fraction`` of the shuffled files
            validate, the next ``test_fraction`` test, the rest train.
    """

    def __init__(
        self,
        paths: Sequence[str] = (STDLIB,),
        pattern: str = "*.py",
        tokenizer: str = BYTE,
        seq_len: int = 2048,
        mode: Literal["packed", "documents"] = "packed",
        batch_size: int = 1,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        max_files: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_sample_shape(seq_len, batch_size)
        if not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction must be between 0 and 1 (exclusive), got {val_fraction}.")
        if not 0 <= test_fraction < 1 or val_fraction + test_fraction >= 1:
            raise ValueError(
                f"data.test_fraction must be at least 0 and leave files for training (val_fraction + test_fraction "
                f"< 1), got test_fraction={test_fraction} with val_fraction={val_fraction}."
            )
        if mode not in ("packed", "documents"):
            raise ValueError(f"data.mode must be 'packed' or 'documents', got {mode!r}.")
        self.paths = list(paths)
        self.pattern = pattern
        self.tokenizer = byte_tokenizer() if tokenizer == BYTE else _load_hf_tokenizer(tokenizer)
        self.seq_len = seq_len
        self.mode = mode
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.max_files = max_files
        self.num_workers = num_workers
        self.seed = seed
        self.files: dict[str, list[Path]] = {}
        """``"train"`` / ``"val"`` / ``"test"`` -> that split's files (set by :meth:`setup`)."""
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None

    @classmethod
    def check_arguments(cls, args: Mapping[str, Any]) -> None:
        """:func:`check_data_arguments` of the init arguments ``args`` (the CLI calls it before any process starts)."""
        check_data_arguments(args, [path for path in args["paths"] if path != STDLIB])

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to ``vocab_size - 1``; the model's embedding must be at least this large."""
        return len(self.tokenizer)

    def setup(self, stage: str) -> None:
        if self.trainer is not None:
            warn_on_empty_shards(self.seq_len, getattr(self.trainer.strategy, "sp_size", 1))
        if self.train_dataset is not None:
            return
        files = find_text_files(self.paths, self.pattern)
        random.Random(self.seed).shuffle(files)
        texts, skipped = read_text_files(files[: self.max_files])
        if skipped:
            _report_skipped(skipped, len(skipped) + len(texts), self.pattern)
        self.files = split_files(list(texts), self.val_fraction, self.test_fraction)
        datasets = {name: self._dataset([texts[path] for path in split]) for name, split in self.files.items()}
        for name, dataset in datasets.items():
            if len(dataset) == 0 and self.files[name]:  # no test files at all (test_fraction=0) is allowed
                raise ValueError(
                    f"The {name} split has no full sample of seq_len={self.seq_len} tokens. Add files, raise "
                    f"data.max_files{f' or data.{name}_fraction' if name != 'train' else ''}, or lower data.seq_len."
                )
        self.train_dataset, self.val_dataset, self.test_dataset = datasets["train"], datasets["val"], datasets["test"]

    def _dataset(self, texts: list[str]) -> PackedDataset | DocumentDataset:
        pieces = split_documents([self._encode(text) for text in texts if text.strip()], self.seq_len)
        return PackedDataset(pieces, self.seq_len) if self.mode == "packed" else DocumentDataset(pieces)

    def _encode(self, text: str) -> np.ndarray:
        """The document's ids, ending in one EOS; the text's characters are never read as special tokens."""
        from transformers import ByT5Tokenizer

        if isinstance(self.tokenizer, ByT5Tokenizer):
            # ByT5's own ids (tests/test_data.py compares them with its tokenizer's), computed at memory speed: its
            # Python tokenizer takes about 0.5 s per MB, over a minute for the whole standard library
            body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + self.tokenizer.offset
            return np.append(body, self.tokenizer.eos_token_id)
        ids = self.tokenizer(text, add_special_tokens=True, split_special_tokens=True)["input_ids"]
        eos = self.tokenizer.eos_token_id
        if eos is not None and (not ids or ids[-1] != eos):  # some tokenizers append it themselves
            ids.append(eos)
        return np.asarray(ids, dtype=np.int64)

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("LongTextDataModule.setup() must run before its dataloaders are requested.")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=functools.partial(collate_right_padded, pad_token_id=pad),
            persistent_workers=self.num_workers > 0,
            multiprocessing_context=worker_start_method(self.num_workers),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """The test files: held out from training and validation."""
        if not self.test_fraction:
            raise ValueError("data.test_fraction=0 holds out no test files; set it above 0 (e.g. 0.05) to run test.")
        return self._loader(self.test_dataset, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """The validation files, in order (``CausalLM.predict_step`` scores every next token)."""
        return self._loader(self.val_dataset, shuffle=False)


def split_files(files: list[Path], val_fraction: float, test_fraction: float) -> dict[str, list[Path]]:
    """``{"train", "val", "test"}`` -> disjoint parts of ``files``: the first ``val_fraction`` (at least one), the
    next ``test_fraction`` (at least one, none for 0), the rest (at least one)."""
    num_val = max(1, round(len(files) * val_fraction))
    num_test = max(1, round(len(files) * test_fraction)) if test_fraction else 0
    if len(files) < num_val + num_test + 1:
        raise ValueError(
            f"Need at least {num_val + num_test + 1} text files for the training, validation"
            f"{' and test' if num_test else ''} splits, found {len(files)}. Add files, raise data.max_files"
            f"{' or set data.test_fraction=0' if num_test else ''}."
        )
    return {"train": files[num_val + num_test :], "val": files[:num_val], "test": files[num_val : num_val + num_test]}


def check_sample_shape(seq_len: int, batch_size: int) -> None:
    """Refuse rows of fewer than 2 tokens (no next token to predict) and micro-batches of no sample.

    2 is the least at any ``sp_size``: a row of 2 tokens over 2 ranks leaves the second rank no label, which is
    exact (it adds nothing to the token sums), and shorter rows than ``sp_size`` only warn
    (:func:`warn_on_empty_shards`)."""
    if seq_len < 2:
        raise ValueError(
            f"data.seq_len={seq_len}: a row needs at least 2 tokens (a token and the next one it predicts); set "
            "data.seq_len to 2 or more, e.g. --data.seq_len 1024."
        )
    if batch_size < 1:
        raise ValueError(
            f"data.batch_size={batch_size}: it is the number of sequences per micro-batch of each data-parallel group "
            "and must be at least 1 (data.batch_size=1)."
        )


def warn_on_empty_shards(seq_len: int, sp_size: int) -> None:
    """Warn when a row of ``seq_len`` tokens, padded to a multiple of ``sp_size`` and split into ``sp_size``
    shards, leaves the last ranks of the SP group without a single token. Still exact (those ranks hold only
    padding, which no loss counts), but their compute is wasted."""
    shard = -(-seq_len // sp_size)
    empty = [rank for rank in range(sp_size) if rank * shard >= seq_len]
    if empty:
        rank_zero_warn(
            f"data.seq_len={seq_len} split over sp_size={sp_size} ranks gives each rank {shard} position(s), so SP "
            f"rank(s) {empty[0]}{f'-{empty[-1]}' if len(empty) > 1 else ''} hold no token of any sequence, only "
            f"padding: exact, but their compute is wasted. Set data.seq_len to a multiple of sp_size (e.g. "
            f"{shard * sp_size}) or lower sp_size."
        )


def _report_skipped(skipped: list[Path], total: int, pattern: str) -> None:
    examples = ", ".join(str(path) for path in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
    if len(skipped) == total:
        raise ValueError(
            f"None of the {total} files matched by data.pattern={pattern!r} is UTF-8 text (binary or another "
            f"encoding), e.g. {examples}. Give text files in data.paths, or narrow data.pattern (e.g. '*.txt')."
        )
    rank_zero_warn(
        f"Skipped {len(skipped)} of {total} files that are not UTF-8 text (binary or another encoding), e.g. "
        f"{examples}. Narrow data.pattern={pattern!r} (e.g. '*.txt') to leave them out."
    )


def check_tokenizer(name: str) -> None:
    """Refuse a ``data.tokenizer`` that is neither ``"byte"`` nor a local folder (nothing is downloaded)."""
    if name != BYTE and not Path(name).expanduser().is_dir():
        raise FileNotFoundError(
            f"data.tokenizer={name!r} is neither 'byte' nor a local tokenizer folder. Nothing is downloaded at run "
            "time: save the tokenizer first (AutoTokenizer.from_pretrained(name).save_pretrained(folder)) and give "
            "the folder."
        )


def _load_hf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    check_tokenizer(path)
    return AutoTokenizer.from_pretrained(Path(path).expanduser())
