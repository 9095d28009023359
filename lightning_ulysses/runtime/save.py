"""Saving a checkpoint directory atomically: committed on every rank, or the previous one left untouched.

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

:func:`save_checkpoint` is what ``UlyssesStrategy.save_checkpoint`` runs: the loop state rewound to the last optimizer
step (:func:`~.resume.rewind_to_step_boundary`), then :func:`save_atomically`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_ulysses.engines import deepspeed as deepspeed_engine
from lightning_ulysses.runtime.directory import POINTER
from lightning_ulysses.runtime.resume import rewind_to_step_boundary

TAG_PREFIX = "checkpoint"  # Lightning's fixed tag, and the stem of ours (checkpoint-<id>)
STAGING_PREFIX = ".ulysses-partial-"


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank; raised on every rank, the previous checkpoint at that path intact."""


def save_checkpoint(
    engine: Any,
    checkpoint: dict[str, Any],
    filepath: str | Path,
    fit_loop: Any | None = None,
    step_in_flight: bool = False,
    *,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Save Lightning's ``checkpoint`` as DeepSpeed ``engine``'s checkpoint directory ``filepath``, atomically.

    The weights and optimizer state are the engine's (``checkpoint``'s ``state_dict`` and ``optimizer_states`` are
    left out); the rest is DeepSpeed's client state. ``fit_loop``: the Trainer's fit loop while fitting, whose saved
    progress is rewound to the last optimizer step in the weights (``step_in_flight``: one applied but not counted
    yet, see :func:`~.resume.resume_batch`). A collective: every rank calls it.
    """
    if fit_loop is not None and "loops" in checkpoint:
        rewind_to_step_boundary(checkpoint["loops"]["fit_loop"], fit_loop, step_in_flight)
    client_state = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
    save_atomically(engine, filepath, client_state, exclude_frozen_parameters=exclude_frozen_parameters)


def save_atomically(
    engine: Any, filepath: str | Path, client_state: dict[str, Any], *, exclude_frozen_parameters: bool = False
) -> None:
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
        engine.save_checkpoint(
            str(save_dir),
            tag=tag,
            client_state=client_state,
            save_latest=False,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
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
        failed = "; ".join(
            f"rank {r}: {failure}" for r, rank_failures in enumerate(failures) for failure in rank_failures
        )
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
        checkpoint_engine = engine.checkpoint_engine
        engine.checkpoint_engine = _RecordingCheckpointEngine(checkpoint_engine, self)
        try:
            with deepspeed_engine.recovery_script_copy_through(engine, lambda copy, path: self.run(copy, path, path)):
                yield
        finally:
            engine.checkpoint_engine = checkpoint_engine

    def run(self, write: Any, path: str, *args: Any) -> None:
        try:
            write(*args)
        except Exception as error:  # noqa: BLE001 - any write error is reported after the collectives, by every rank
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
