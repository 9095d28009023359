"""An integrity check before loading: every file that a load would read is whole.

:func:`integrity_problems` checks what a load would read: the pointer names an existing tag folder, and every
file in it is whole. ``torch.save`` writes zip archives with a CRC-32 per entry that ``torch.load`` never
checks (a flipped byte loads silently as a wrong weight; a truncated file fails with an error that names
no file). The ranks of a job split the files between them (:func:`check_integrity` gathers the verdicts).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_ulysses.runtime.directory import POINTER, read_pointer

_ZIP_MAGIC = b"PK\x03\x04"


class CorruptCheckpointError(ValueError):
    """A checkpoint directory whose pointer or files are missing, truncated or corrupted; raised before loading."""


def integrity_problems(
    checkpoint_dir: str | Path, pointer: str = POINTER, rank: int = 0, world_size: int = 1
) -> list[str]:
    """What would stop ``checkpoint_dir`` from loading whole: a missing pointer or tag folder (checked by every
    rank), and the files of the tag folder, every ``world_size``-th one from ``rank`` on, that are truncated or
    fail their CRC-32 check. Each problem names its file."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / pointer).is_file():
        if (checkpoint_dir.parent / pointer).is_file():
            return [f"{checkpoint_dir} is a tag folder inside the checkpoint {checkpoint_dir.parent}: pass that one"]
        return [
            f"{checkpoint_dir / pointer} is missing, so no save into this directory completed (a save that was "
            "interrupted before its commit, or not a DeepSpeed checkpoint directory)"
        ]
    tag_dir = checkpoint_dir / read_pointer(checkpoint_dir, pointer)
    files = sorted(path for path in tag_dir.rglob("*") if path.is_file())
    if not files:
        return [f"{checkpoint_dir / pointer} names {tag_dir}, which holds no files"]
    return [f"{file}: {problem}" for file in files[rank::world_size] if (problem := _file_problem(file))]


def _file_problem(file: Path) -> str | None:
    with open(file, "rb") as handle:
        magic = handle.read(len(_ZIP_MAGIC))
    if not magic:
        return "empty file"
    if magic != _ZIP_MAGIC:
        return None  # not torch's zip format (e.g. DeepSpeed's checkpoint_serialization=false): nothing to check
    try:
        with zipfile.ZipFile(file) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, EOFError, OSError) as error:
        return f"truncated or damaged ({error})"
    return f"its entry {damaged} fails its CRC-32 check (corrupted)" if damaged else None


def checkpoint_file_problem(file: Path) -> str | None:
    """What stops a single-file checkpoint (``torch.save``'s zip archive, as Lightning writes one without DeepSpeed)
    from loading, read from its zip structure alone (nothing is unpickled), or ``None``."""
    with open(file, "rb") as handle:
        if handle.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
            return "not a checkpoint (a checkpoint file is the zip archive torch.save writes)"
    return _file_problem(file)


def check_integrity(checkpoint_dir: str | Path, pointer: str = POINTER) -> None:
    """Raise :class:`CorruptCheckpointError` naming every damaged file of ``checkpoint_dir``, before anything is
    loaded. Inside a distributed job it is a collective (the ranks split the files and agree); otherwise the
    one process reads every file."""
    distributed = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    problems = integrity_problems(checkpoint_dir, pointer, rank, world_size)
    if distributed:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, problems)
        problems = list(dict.fromkeys(problem for rank_problems in gathered for problem in rank_problems))
    if problems:
        raise CorruptCheckpointError(
            f"The checkpoint {checkpoint_dir} cannot be loaded: " + "; ".join(problems) + ". Nothing was loaded. "
            "Resume from another checkpoint (ModelCheckpoint keeps the previous one until a new one is complete), or "
            "copy the damaged file again if it was transferred."
        )
