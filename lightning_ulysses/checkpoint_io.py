"""Checkpoint directories that are whole or untouched: atomic saves, and an integrity check before loading.

DeepSpeed writes a checkpoint as a directory: a tag folder of shards (each rank writes its own) and a
``latest`` file that names the tag. Lightning saves every checkpoint under the same tag (``checkpoint``), so
re-saving ``last.ckpt`` overwrote the previous shards in place, and rank 0 writes ``latest`` without waiting
for the other ranks: a crash in the middle of a save left a mix of old and new shards that still loads.

:func:`save_atomically` writes each save under a fresh tag (``checkpoint-<id>``) and commits it only once every
rank has written and flushed its files:

* into an existing checkpoint directory, the new tag folder is written next to the old one, ``latest`` is
  replaced in one ``os.replace``, then the old tag folders are removed (the directory briefly holds both);
* to a new path, the directory is written under a hidden name beside it (``.ulysses-partial-<key>-<id>``)
  and renamed into place, so the path appears only complete (Lightning's SLURM resume picks the newest
  ``hpc_ckpt_N.ckpt`` by name, and must never find a partial one).

A rank that dies at any point, or a write that fails (a full disk), leaves the previous checkpoint as it was.
Failed writes are caught and reported only after DeepSpeed's collectives, so every rank raises the same
:class:`CheckpointSaveError` together instead of leaving its peers in a barrier. Every rank must see the same
file system (as DeepSpeed's loader needs).

:func:`integrity_problems` checks what a load would read: the pointer names an existing tag folder, and every
file in it is whole. ``torch.save`` writes zip archives with a CRC-32 per entry that ``torch.load`` never
checks (a flipped byte loads silently as a wrong weight; a truncated file fails with an error that names
no file). The ranks of a job split the files between them (:func:`check_integrity` gathers the verdicts).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

POINTER = "latest"  # DeepSpeed's file naming the tag folder of a checkpoint directory
TAG_PREFIX = "checkpoint"  # Lightning's fixed tag, and the stem of ours (checkpoint-<id>)
STAGING_PREFIX = ".ulysses-partial-"
_ZIP_MAGIC = b"PK\x03\x04"


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank; raised on every rank, the previous checkpoint at that path intact."""


class CorruptCheckpointError(ValueError):
    """A checkpoint directory whose pointer or files are missing, truncated or corrupted; raised before loading."""


def read_pointer(checkpoint_dir: str | Path, pointer: str = POINTER) -> str:
    """The tag folder that a pointer file (``latest``, or ``latest_universal`` once converted) names."""
    return (Path(checkpoint_dir) / pointer).read_text().strip()


def save_atomically(engine: Any, filepath: str | Path, client_state: dict[str, Any], *,
                    exclude_frozen_parameters: bool = False) -> None:
    """Save DeepSpeed ``engine``'s checkpoint (with Lightning's ``client_state``) to the directory ``filepath``,
    committed on every rank or not at all (see the module docstring). A collective: every rank calls it."""
    if engine.checkpoint_engine.is_decoupled():
        raise CheckpointSaveError(
            f"DeepSpeed's {type(engine.checkpoint_engine).__name__} writes checkpoints in the background, so a save "
            "could not be committed once its files are complete. Remove the asynchronous writer from the DeepSpeed "
            "config ('checkpoint': {'writer': ...})."
        )
    rank, world_size = dist.get_rank(), dist.get_world_size()
    plan: list[Any] = [_plan(Path(filepath)) if rank == 0 else None]
    dist.broadcast_object_list(plan)
    target, save_dir, tag, error = plan[0]
    if error:
        raise CheckpointSaveError(f"Cannot save the checkpoint {target}: {error}")
    writes = _Writes()
    with writes.recorded(engine):
        engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state, save_latest=False,
                               exclude_frozen_parameters=exclude_frozen_parameters)
    writes.flush()
    failures: list[Any] = [None] * world_size
    dist.all_gather_object(failures, writes.failures)
    committed: list[Any] = [None]
    if rank == 0:
        committed[0] = "not all ranks wrote their files" if any(failures) else _commit(target, save_dir, tag)
        if committed[0]:
            shutil.rmtree(save_dir / tag if save_dir == target else save_dir, ignore_errors=True)  # free the space
    dist.broadcast_object_list(committed)
    if committed[0]:
        failed = "; ".join(f"rank {r}: {failure}" for r, rank_failures in enumerate(failures) for failure in rank_failures)
        raise CheckpointSaveError(
            f"Saving the checkpoint {target} failed ({failed or committed[0]}). Nothing was committed: "
            f"{'the checkpoint already at that path is intact' if save_dir == target else 'the path was not created'}, "
            "and the files of this attempt were removed. Free disk space or fix the file system, then save again."
        )


def _plan(target: Path) -> tuple[Path, Path, str, str | None]:
    """Rank 0: ``(target, directory to write, fresh tag, error)``. An existing directory is written in place under a
    new tag, a new path under a staging name; the staged remains of earlier interrupted saves to it are removed."""
    tag = f"{TAG_PREFIX}-{uuid.uuid4().hex[:12]}"
    key = hashlib.sha1(target.name.encode()).hexdigest()[:8]  # the name itself could fool Lightning's hpc_ckpt_N search
    save_dir = target if target.is_dir() else target.parent / f"{STAGING_PREFIX}{key}-{tag}"
    try:
        for stale in target.parent.glob(f"{STAGING_PREFIX}{key}-*"):  # earlier saves to this path, interrupted
            shutil.rmtree(stale, ignore_errors=True)
        save_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return target, save_dir, tag, str(error)
    return target, save_dir, tag, None


def _commit(target: Path, save_dir: Path, tag: str) -> str | None:
    """Rank 0, once every rank wrote its files: point ``latest`` at ``tag`` and put the directory in place, then
    remove the tags it replaced. Returns the error if it failed before the commit point (``os.replace`` of the
    pointer in place, the rename of a staged directory), which leaves the previous state."""
    pointer = save_dir / f".{POINTER}-{tag}"
    try:
        with open(pointer, "w") as file:
            file.write(tag)
            file.flush()
            os.fsync(file.fileno())
        _fsync(save_dir / tag)
        if save_dir == target:
            os.replace(pointer, target / POINTER)  # the commit point
        else:
            os.replace(pointer, save_dir / POINTER)
            _fsync(save_dir)
            os.rename(save_dir, target)  # the commit point
    except OSError as error:
        pointer.unlink(missing_ok=True)
        return str(error)
    _fsync(target.parent if save_dir != target else target)
    for old in target.iterdir():  # only now: until the pointer moved, they were the checkpoint
        if old.is_dir() and old.name != tag and (old.name == TAG_PREFIX or old.name.startswith(f"{TAG_PREFIX}-")):
            shutil.rmtree(old, ignore_errors=True)
    return None


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class _Writes:
    """The files this rank wrote during a DeepSpeed save, and the writes that failed (caught, not raised)."""

    def __init__(self) -> None:
        self.written: list[str] = []
        self.failures: list[str] = []

    @contextmanager
    def recorded(self, engine: Any) -> Iterator[None]:
        """Route ``engine``'s checkpoint writes through this record: its checkpoint engine's ``save`` (every shard)
        and its copy of the ``zero_to_fp32.py`` script (rank 0), an instance attribute over DeepSpeed's method."""
        checkpoint_engine, copy_script = engine.checkpoint_engine, engine._copy_recovery_script
        engine.checkpoint_engine = _RecordingCheckpointEngine(checkpoint_engine, self)
        engine._copy_recovery_script = lambda save_path: self.run(copy_script, save_path, save_path)
        try:
            yield
        finally:
            engine.checkpoint_engine = checkpoint_engine
            del engine._copy_recovery_script

    def run(self, write: Any, path: str, *args: Any) -> None:
        try:
            write(*args)
        except Exception as error:  # reported after the collectives, by every rank (save_atomically)
            self.failures.append(f"writing {path}: {type(error).__name__}: {error}")
            return
        self.written.append(path)

    def flush(self) -> None:
        """Push this rank's files to the disk before the pointer names them."""
        for path in filter(os.path.isfile, self.written):
            try:
                _fsync(Path(path))
            except OSError as error:
                self.failures.append(f"flushing {path}: {error}")


class _RecordingCheckpointEngine:
    """DeepSpeed's checkpoint engine with its ``save`` recorded by :class:`_Writes`; everything else its own."""

    def __init__(self, wrapped: Any, writes: _Writes) -> None:
        self._wrapped, self._writes = wrapped, writes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)

    def save(self, state_dict: Any, path: str) -> None:
        self._writes.run(self._wrapped.save, path, state_dict, path)


def integrity_problems(checkpoint_dir: str | Path, pointer: str = POINTER, rank: int = 0,
                       world_size: int = 1) -> list[str]:
    """What would stop ``checkpoint_dir`` from loading whole: a missing pointer or tag folder (checked by every
    rank), and the files of the tag folder, every ``world_size``-th one from ``rank`` on, that are truncated or
    fail their CRC-32 check. Each problem names its file."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / pointer).is_file():
        if (checkpoint_dir.parent / pointer).is_file():
            return [f"{checkpoint_dir} is a tag folder inside the checkpoint {checkpoint_dir.parent}: pass that one"]
        return [f"{checkpoint_dir / pointer} is missing, so no save into this directory completed (a save that was "
                "interrupted before its commit, or not a DeepSpeed checkpoint directory)"]
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
