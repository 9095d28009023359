"""Local record files (JSONL, Parquet, Arrow) as a ``datasets.Dataset``: memory-mapped and cached by ``datasets``."""

from __future__ import annotations

import glob
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_ulysses.data import check_paths_exist

if TYPE_CHECKING:
    import datasets

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
"""File suffix -> the ``datasets`` builder that reads it."""


def find_record_files(paths: Sequence[str], key: str = "data.paths") -> list[Path]:
    """Every file named by ``paths`` (files, folders searched recursively for the suffixes of :data:`BUILDERS`,
    or glob patterns; the value of the config key ``key``), sorted."""
    files: set[Path] = set()
    for entry in paths:
        path = Path(entry).expanduser()
        if path.is_file():
            files.add(path)
        elif path.is_dir():
            files.update(p for p in path.rglob("*") if p.suffix in BUILDERS and p.is_file())
        elif matches := glob.glob(str(path), recursive=True):
            files.update(Path(p) for p in matches if Path(p).is_file())
        else:
            check_paths_exist([entry], key, globs=True)
    if not files:
        raise FileNotFoundError(f"{key}: no {'/'.join(BUILDERS)} file in {list(paths)}.")
    return sorted(files)


def load_records(paths: Sequence[str], key: str = "data.paths") -> datasets.Dataset:
    """The records of every file in ``paths`` (all of one format; the value of the config key ``key``), in file
    order."""
    import datasets

    files = find_record_files(paths, key)
    builders = {BUILDERS.get(path.suffix) for path in files}
    if None in builders or len(builders) > 1:
        raise ValueError(
            f"Data files must all be JSONL/JSON, all Parquet or all Arrow ({', '.join(BUILDERS)}); got "
            f"{sorted({path.suffix for path in files})} in {list(paths)}."
        )
    return datasets.load_dataset(builders.pop(), data_files=[str(path) for path in files], split="train")
