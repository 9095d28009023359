"""Fault injection: a full disk, damaged checkpoint files, a rank killed with ``kill -9`` in the middle of a save.

Two processes (sp=2, ZeRO-2, SGD with momentum, strategy timeout 30 s) save a checkpoint after step 2, then:

* at step 3, a full disk on rank 1 (its checkpoint writer writes half a file and raises ``ENOSPC``), once into the
  same checkpoint directory and once to a new path: both saves must raise the same error on every rank, naming
  the rank; the directory must still hold step 2's checkpoint, whole, and the new path must not exist;
* a copy of the checkpoint with one shard truncated, and one with a flipped byte inside a tensor: resuming from
  either must fail before any training, naming the file; so must ``convert_checkpoint`` and ``export_hf_model``;
* resumed from the step-2 checkpoint, rank 1 dies (``SIGKILL``) in the middle of writing its shard of the step-3
  checkpoint: rank 0 must exit non-zero within the timeout, naming rank 1 as dead.

A second launch resumes the step-2 checkpoint left by all this and trains to the end: losses (``rtol=1e-5``) and
weights (relative update error ``< 1e-4``) must equal one process trained without interruption.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time
import zipfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesStrategy
from lightning_ulysses.runtime import convert_checkpoint, export_hf_model
from lightning_ulysses.runtime.directory import read_pointer
from lightning_ulysses.runtime.integrity import CorruptCheckpointError, check_integrity
from lightning_ulysses.runtime.save import CheckpointSaveError
from tests.launch import RankExit, launch, launch_to_exit
from tests.tiny import (
    TinyCausalLM,
    collate,
    cpu_trainer,
    gathered_parameters,
    make_samples,
    reference_training,
    relative_update_error,
    tiny_llama,
)

pytestmark = pytest.mark.distributed

DATA = dict(num=8, seq_len=16, seed=6)
BATCH, STEPS_PER_EPOCH, EPOCHS, LR, MOMENTUM = 2, 4, 2, 0.5, 0.9
PG_TIMEOUT_S = 30
SAVED_STEP = 2


def _fit(
    world_size: int, module: TinyCausalLM, ckpt_path: str | None = None, callbacks: list[L.Callback] = ()
) -> L.Trainer:
    strategy = UlyssesStrategy(sp_size=2, stage=2, attn_implementation="sdpa", timeout=timedelta(seconds=PG_TIMEOUT_S))
    trainer = cpu_trainer(world_size, strategy, max_epochs=EPOCHS, callbacks=list(callbacks))
    trainer.fit(module, DataLoader(make_samples(**DATA), batch_size=BATCH, collate_fn=collate), ckpt_path=ckpt_path)
    return trainer


def _module() -> TinyCausalLM:
    return TinyCausalLM(lr=LR, momentum=MOMENTUM)


def _break_writer(trainer: L.Trainer, then: Any) -> None:
    """Rank 1's next checkpoint files: half written, then ``then()`` (raise, or die)."""
    if trainer.global_rank != 1:
        return
    engine = trainer.strategy.deepspeed_engine.checkpoint_engine

    def save(state_dict: Any, path: str) -> None:
        torch.save(state_dict, path)
        with open(path, "r+b") as file:
            file.truncate(os.path.getsize(path) // 2)
        then()

    engine.save = save


def _full_disk() -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


class SaveThenFillTheDisk(L.Callback):
    """Step 2: saves ``dir/last.ckpt`` and, on rank 0, its damaged copies. Step 3: saves with a full disk on rank 1,
    into ``last.ckpt`` and to ``fresh.ckpt``, and stops."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.saved: dict[str, torch.Tensor] = {}
        self.errors: list[str] = []
        self.tag_folders: list[str] = []  # in last.ckpt after the failed saves

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == SAVED_STEP:
            trainer.save_checkpoint(self.directory / "last.ckpt")
            self.saved = gathered_parameters(pl_module.model, False)
            if trainer.is_global_zero:
                damage_copies(self.directory)
            trainer.strategy.barrier()
        if trainer.global_step == SAVED_STEP + 1:
            for name in ("last.ckpt", "fresh.ckpt"):
                _break_writer(trainer, _full_disk)
                try:
                    trainer.save_checkpoint(self.directory / name)
                except CheckpointSaveError as error:
                    self.errors.append(str(error))
            self.tag_folders = [path.name for path in (self.directory / "last.ckpt").iterdir() if path.is_dir()]
            trainer.should_stop = True


def damage_copies(directory: Path) -> None:
    """``truncated.ckpt``: rank 1's optimizer shard cut in half; ``flipped.ckpt``: a byte inverted in the middle of the
    largest tensor of the model states (the zip archive stays readable)."""
    source = directory / "last.ckpt"
    for name in ("truncated.ckpt", "flipped.ckpt"):
        shutil.copytree(source, directory / name)
    tag = read_pointer(source)
    shard = directory / "truncated.ckpt" / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with open(shard, "r+b") as file:
        file.truncate(shard.stat().st_size // 2)
    states = directory / "flipped.ckpt" / tag / "mp_rank_00_model_states.pt"
    with zipfile.ZipFile(states) as archive:
        entry = max(archive.infolist(), key=lambda info: info.file_size)
    with open(states, "r+b") as file:
        file.seek(entry.header_offset + 26)  # the local header's name and extra-field lengths, then the data
        name_length, extra_length = (int.from_bytes(file.read(2), "little") for _ in range(2))
        file.seek(entry.header_offset + 30 + name_length + extra_length + entry.file_size // 2)
        byte = file.read(1)[0]
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte ^ 0xFF]))


class KillRankOneInTheSave(L.Callback):
    """Resumed at step 2: after step 3, writes this rank's results to ``dir``, then saves ``last.ckpt``, in the middle
    of which rank 1 kills itself."""

    def __init__(self, directory: Path, results: dict[str, Any]) -> None:
        self.directory, self.results = directory, results

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step != SAVED_STEP + 1:
            return
        self.results["resumed_losses"] = list(pl_module.losses)
        torch.save(self.results, self.directory / f"results{trainer.global_rank}.pt")
        _break_writer(trainer, lambda: os.kill(os.getpid(), signal.SIGKILL))
        (self.directory / f"killing{trainer.global_rank}").write_text(str(time.time()))
        trainer.save_checkpoint(self.directory / "last.ckpt")


def faults_worker(args: dict[str, Any]) -> None:
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])  # read once: teardown deletes them
    directory = Path(args["dir"])
    results: dict[str, Any] = {}
    first, module = SaveThenFillTheDisk(directory), _module()
    _fit(world_size, module, callbacks=[first])
    results.update(
        first_losses=module.losses, saved=first.saved, full_disk_errors=first.errors, tag_folders=first.tag_folders
    )
    for name in ("truncated.ckpt", "flipped.ckpt"):
        module = _module()
        try:
            _fit(world_size, module, ckpt_path=str(directory / name))
        except CorruptCheckpointError as error:
            results[name] = str(error)
        results[f"{name} losses"] = module.losses
    try:
        _fit(world_size, _module(), str(directory / "last.ckpt"), [KillRankOneInTheSave(directory, results)])
    finally:  # reached by rank 0 only: rank 1 is gone
        (directory / f"failed{rank}").write_text(str(time.time()))


def resume_worker(args: dict[str, Any]) -> dict[str, Any]:
    """Resumes ``path`` to the end, then saves into it again (which removes the tag folder of the killed save)."""
    module = _module()
    trainer = _fit(int(os.environ["WORLD_SIZE"]), module, ckpt_path=args["path"])
    tag_folders = [path.name for path in Path(args["path"]).iterdir() if path.is_dir()]
    trainer.save_checkpoint(args["path"])
    return {"losses": module.losses, "params": gathered_parameters(module.model, False), "tag_folders": tag_folders}


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("faults")
    exits = launch_to_exit("tests.test_faults:faults_worker", 2, {"dir": str(directory)}, timeout=400)
    results = [
        torch.load(path, weights_only=False) if (path := directory / f"results{rank}.pt").is_file() else None
        for rank in range(2)
    ]
    return {"dir": directory, "exits": exits, "results": results}


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference_training(
        make_samples(**DATA), steps=STEPS_PER_EPOCH, batch_size=BATCH, lr=LR, momentum=MOMENTUM, epochs=EPOCHS
    )


def _output(exit: RankExit) -> str:
    return exit.output[-6000:]


def test_a_killed_rank_ends_every_rank_naming_it(faults: dict[str, Any]) -> None:
    survivor, killed = faults["exits"]
    assert killed.returncode == -signal.SIGKILL, _output(killed)
    assert survivor.returncode not in (None, 0), _output(survivor)
    assert "rank 1 stopped: no heartbeat" in survivor.output, _output(survivor)
    assert "Resume from the last checkpoint" in survivor.output, _output(survivor)
    killed_at = float((faults["dir"] / "killing1").read_text())
    assert float((faults["dir"] / "failed0").read_text()) - killed_at < PG_TIMEOUT_S


def test_a_full_disk_raises_on_every_rank_and_keeps_the_previous_checkpoint(faults: dict[str, Any]) -> None:
    directory = faults["dir"]
    for rank, results in enumerate(faults["results"]):
        assert results is not None, _output(faults["exits"][rank])
        in_place, fresh = results["full_disk_errors"]
        for error in (in_place, fresh):
            assert "failed (rank 1: writing" in error and "No space left on device" in error, error
        assert "the checkpoint already at that path is intact" in in_place, in_place
        assert "the path was not created" in fresh, fresh
    assert not (directory / "fresh.ckpt").exists() and not list(directory.glob(".ulysses-partial-*"))
    assert faults["results"][0]["tag_folders"] == [read_pointer(directory / "last.ckpt")], "a failed save left files"


def test_a_damaged_checkpoint_is_refused_before_any_training_naming_the_file(
    faults: dict[str, Any], tmp_path: Path
) -> None:
    directory = faults["dir"]
    tag = read_pointer(directory / "last.ckpt")
    truncated = f"{directory / 'truncated.ckpt' / tag / 'zero_pp_rank_1_mp_rank_00_optim_states.pt'}: truncated"
    flipped = f"{directory / 'flipped.ckpt' / tag / 'mp_rank_00_model_states.pt'}: its entry"
    for _rank, results in enumerate(faults["results"]):
        assert truncated in results["truncated.ckpt"], results["truncated.ckpt"]
        assert flipped in results["flipped.ckpt"] and "fails its CRC-32 check" in results["flipped.ckpt"]
        assert results["truncated.ckpt losses"] == results["flipped.ckpt losses"] == [], "it trained before refusing"
    with pytest.raises(CorruptCheckpointError, match=truncated):
        convert_checkpoint(directory / "truncated.ckpt", tmp_path / "universal")
    with pytest.raises(CorruptCheckpointError, match=flipped):
        export_hf_model(directory / "flipped.ckpt", tiny_llama(), tmp_path / "hf")


def test_resuming_after_the_faults_equals_the_uninterrupted_run(faults: dict[str, Any], reference: Any) -> None:
    expected_losses, expected = reference
    resumed = launch("tests.test_faults:resume_worker", 2, {"path": str(faults["dir"] / "last.ckpt")})
    first = faults["results"][0]
    torch.testing.assert_close(
        torch.tensor(first["first_losses"]), torch.tensor(expected_losses[: SAVED_STEP + 1]), rtol=1e-5, atol=0
    )
    for rank, (results, got) in enumerate(zip(faults["results"], resumed)):
        # the resume before the kill and this one start at step 2: the failed saves changed nothing
        for losses in (results["resumed_losses"], got["losses"]):
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(expected_losses[SAVED_STEP:][: len(losses)]), rtol=1e-5, atol=0
            )
        assert len(got["losses"]) == EPOCHS * STEPS_PER_EPOCH - SAVED_STEP
        error = relative_update_error(results["saved"], expected, got["params"])
        assert error < 1e-4, f"rank {rank}: weights resumed after the faults vs one process, relative error {error:.2e}"
    # the killed save's tag folder stayed beside the committed one until the next save into the directory
    assert len(resumed[0]["tag_folders"]) == 2
    path = faults["dir"] / "last.ckpt"
    check_integrity(path)
    assert [folder.name for folder in path.iterdir() if folder.is_dir()] == [read_pointer(path)]
