"""Checkpoints under sequence parallelism: resume equals the uninterrupted run, layouts, conversion, HF export.

Each case trains a tiny Llama with SGD + momentum or AdamW (optimizer state that a resume must restore)
for one epoch, or for a number of steps that ends inside an epoch, saves, and resumes in a fresh Trainer
up to the end of the second epoch, possibly on another ``(sp, dp)`` layout, or after
:func:`convert_checkpoint` on another process count and ZeRO stage. The
resumed run must reproduce the uninterrupted run and a single process on whole sequences: every
micro-batch loss (``rtol=1e-5``) and the final weights (relative update error ``< 1e-4``; a lost
momentum buffer or a wrong data order gives errors near 1, checked by a control that drops the momentum).
The saved checkpoints are then exported to Hugging Face folders that must load with
``AutoModelForCausalLM.from_pretrained`` and give the logits of the saved weights.

Process start-up is slow, so the cases share three launches: one process saves an AdamW checkpoint; two
processes run the SGD cases and resume the converted AdamW checkpoint under ZeRO-3; one process resumes
the converted two-process SGD checkpoints.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from lightning_ulysses import UlyssesStrategy
from lightning_ulysses.cli import main
from lightning_ulysses.runtime import check_resumable, convert_checkpoint, export_hf_model, is_universal_checkpoint
from lightning_ulysses.runtime.directory import UNTRAINED_STATE_FILE
from lightning_ulysses.runtime.load import load_untrained_state
from tests.launch import launch
from tests.tiny import (
    VOCAB,
    OptimizerName,
    SaveAndStop,
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

DATA = dict(num=8, seq_len=16, seed=3)
LR, MOMENTUM, BATCH, STEPS_PER_EPOCH, EPOCHS = 0.5, 0.9, 2, 4, 2
ADAMW_LR = 0.01
# saved with sp=2 x dp=1 on 2 processes after `saved_steps` steps; resumed with (resume_sp, its micro-batch size)
CASES: dict[str, dict[str, Any]] = {
    "sp2_zero2": dict(stage=2, saved_steps=STEPS_PER_EPOCH, resume_sp=2, resume_batch=BATCH, uninterrupted=True),
    "sp2_zero3": dict(stage=3, saved_steps=STEPS_PER_EPOCH, resume_sp=2, resume_batch=BATCH, uninterrupted=True),
    # dp=2 with half the micro-batch: the same global batches, so the same trajectory
    "sp2_to_dp2_zero2": dict(stage=2, saved_steps=STEPS_PER_EPOCH, resume_sp=1, resume_batch=BATCH // 2),
    "sp2_to_dp2_zero3": dict(stage=3, saved_steps=STEPS_PER_EPOCH, resume_sp=1, resume_batch=BATCH // 2),
    # inside an epoch: the resumed run must go on at the next batch, not at the epoch's first
    "sp2_zero2_mid_epoch_1": dict(
        stage=2, saved_steps=STEPS_PER_EPOCH + 1, resume_sp=2, resume_batch=BATCH, uninterrupted=True
    ),
    "sp2_to_dp2_zero3_mid_epoch_0": dict(stage=3, saved_steps=2, resume_sp=1, resume_batch=BATCH // 2),
}


# converted two-process SGD checkpoints, resumed by one process (sp=1 x dp=1, the micro-batch of the saved sp=2 x dp=1)
CONVERTED_CASES: dict[str, dict[str, Any]] = {
    "sp2_zero2_to_1_process_zero1": dict(source="sp2_zero2", stage=1),
    "sp2_zero3_to_1_process_zero2": dict(source="sp2_zero3", stage=2),
    # saved inside epoch 1: the one process goes on at the next batch (the same global batch of 2)
    "sp2_zero2_mid_epoch_1_to_1_process_zero1": dict(source="sp2_zero2_mid_epoch_1", stage=1),
    # control: the same resume without the momentum buffers must miss the reference
    "sp2_zero2_to_1_process_zero1_without_momentum": dict(source="sp2_zero2", stage=1, drop="momentum_buffer.pt"),
}


def frozen_norm_module(norm_weight: float | None = None) -> TinyCausalLM:
    """AdamW on every weight but the final norm's, which is frozen (at ``norm_weight`` if given, else at 1)."""
    module = TinyCausalLM(lr=ADAMW_LR, optimizer="adamw")
    norm = module.model.model.norm.weight
    if norm_weight is not None:
        with torch.no_grad():
            norm.fill_(norm_weight)
    norm.requires_grad_(False)
    return module


def _fit(
    world_size: int,
    stage: int,
    sp: int,
    batch: int,
    max_steps: int = -1,
    ckpt_path: str | None = None,
    optimizer: OptimizerName = "sgd",
    callbacks: list[L.Callback] = (),
    module: TinyCausalLM | None = None,
) -> tuple[TinyCausalLM, L.Trainer]:
    lr = ADAMW_LR if optimizer == "adamw" else LR
    module = module or TinyCausalLM(lr=lr, momentum=MOMENTUM, optimizer=optimizer)
    trainer = cpu_trainer(
        world_size,
        UlyssesStrategy(sp_size=sp, stage=stage, attn_implementation="sdpa"),
        max_epochs=EPOCHS,
        max_steps=max_steps,
        callbacks=list(callbacks),
    )
    trainer.fit(module, DataLoader(make_samples(**DATA), batch_size=batch, collate_fn=collate), ckpt_path=ckpt_path)
    return module, trainer


def _fit_and_save(world_size: int, stage: int, steps: int, path: str) -> tuple[TinyCausalLM, dict[str, torch.Tensor]]:
    """An epoch's end: ``trainer.save_checkpoint`` after the fit. Inside an epoch: in the step, then stop."""
    if steps % STEPS_PER_EPOCH == 0:
        module, trainer = _fit(world_size, stage, 2, BATCH, max_steps=steps)
        trainer.save_checkpoint(path)
        return module, gathered_parameters(module.model, stage == 3)
    save = SaveAndStop(steps, path, stage == 3)
    module, _ = _fit(world_size, stage, 2, BATCH, callbacks=[save])
    return module, save.saved


def resume_worker(args: dict[str, Any]) -> dict[str, Any]:
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown deletes it
    results = {}
    for name, case in args["cases"].items():
        path = str(Path(args["dir"]) / name)
        first, saved = _fit_and_save(world_size, case["stage"], case["saved_steps"], path)
        result = {"saved": saved, "first_losses": first.losses}
        resumed, trainer = _fit(world_size, case["stage"], case["resume_sp"], case["resume_batch"], ckpt_path=path)
        result.update(
            resumed_losses=resumed.losses,
            resumed=gathered_parameters(resumed.model, case["stage"] == 3),
            steps=trainer.global_step,
            path=path,
        )
        if case.get("uninterrupted"):
            whole, _ = _fit(world_size, case["stage"], 2, BATCH)
            result.update(
                uninterrupted_losses=whole.losses, uninterrupted=gathered_parameters(whole.model, case["stage"] == 3)
            )
        results[name] = result
    try:  # a ZeRO-3 checkpoint on ZeRO-2: refused before DeepSpeed loads anything
        _fit(world_size, 2, 2, BATCH, ckpt_path=results["sp2_zero3"]["path"])
    except ValueError as error:
        results["stage_change_error"] = str(error)
    # saved by one process under ZeRO-2, converted, resumed by two (sp=2 x dp=1) under ZeRO-3
    resumed, trainer = _fit(world_size, 3, 2, BATCH, ckpt_path=args["adamw_converted"], optimizer="adamw")
    results["adamw_1_process_zero2_to_2_processes_zero3"] = dict(
        resumed_losses=resumed.losses, resumed=gathered_parameters(resumed.model, True), steps=trainer.global_step
    )
    # the frozen norm (saved at 0.5) comes back although the new module holds 1 there; no step is trained
    resumed, _ = _fit(
        world_size, 3, 2, BATCH, max_steps=1, ckpt_path=args["frozen_converted"], module=frozen_norm_module()
    )
    results["frozen_1_process_zero2_to_2_processes_zero3"] = gathered_parameters(resumed.model, True)
    return results


def save_single_process_worker(args: dict[str, Any]) -> dict[str, Any]:
    first, trainer = _fit(1, 2, 1, BATCH, max_steps=STEPS_PER_EPOCH, optimizer="adamw")
    trainer.save_checkpoint(args["path"])
    # and one step of a model with a frozen parameter, away from its initial value
    frozen, trainer = _fit(1, 2, 1, BATCH, max_steps=1, module=frozen_norm_module(0.5))
    trainer.save_checkpoint(args["frozen_path"])
    return {
        "first_losses": first.losses,
        "saved": gathered_parameters(first.model, False),
        "frozen_saved": gathered_parameters(frozen.model, False),
    }


class EvaluatedCausalLM(TinyCausalLM):
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.training_step(batch, batch_idx)


def resume_converted_worker(args: dict[str, Any]) -> dict[str, Any]:
    results = {}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        strategy=UlyssesStrategy(sp_size=1, stage=2, attn_implementation="sdpa"),
    )
    loader = DataLoader(make_samples(**DATA), batch_size=BATCH, collate_fn=collate)
    try:  # DeepSpeed's universal loader restores training only
        trainer.validate(EvaluatedCausalLM(), loader, ckpt_path=next(iter(args["paths"].values())))
    except ValueError as error:
        results["validate_error"] = str(error)
    for name, case in args["cases"].items():
        resumed, trainer = _fit(1, case["stage"], 1, BATCH, ckpt_path=args["paths"][name])
        results[name] = dict(
            resumed_losses=resumed.losses,
            resumed=gathered_parameters(resumed.model, case["stage"] == 3),
            steps=trainer.global_step,
            epoch=trainer.current_epoch,
        )
    return results


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def single_process_adamw(directory: Path) -> dict[str, Any]:
    """An AdamW checkpoint saved by one process under ZeRO-2 (``path``) and its conversion (``converted``); one
    with a frozen parameter, converted (``frozen_converted``)."""
    path, converted = directory / "adamw_1_process_zero2", directory / "adamw_1_process_zero2_universal"
    frozen, frozen_converted = directory / "frozen_1_process_zero2", directory / "frozen_1_process_zero2_universal"
    args = {"path": str(path), "frozen_path": str(frozen)}
    result = launch("tests.test_checkpoint:save_single_process_worker", 1, args)[0]
    convert_checkpoint(path, converted)
    convert_checkpoint(frozen, frozen_converted)
    return {**result, "path": path, "converted": converted, "frozen_converted": frozen_converted}


@pytest.fixture(scope="module")
def results(directory: Path, single_process_adamw: dict[str, Any]) -> list[dict[str, Any]]:
    return launch(
        "tests.test_checkpoint:resume_worker",
        2,
        {
            "cases": CASES,
            "dir": str(directory),
            "adamw_converted": str(single_process_adamw["converted"]),
            "frozen_converted": str(single_process_adamw["frozen_converted"]),
        },
    )


@pytest.fixture(scope="module")
def converted_results(directory: Path, results: list[dict[str, Any]]) -> dict[str, Any]:
    paths = {}
    for name, case in CONVERTED_CASES.items():
        paths[name] = directory / f"{name}_universal"
        convert_checkpoint(results[0][case["source"]]["path"], paths[name])
        if "drop" in case:
            for dropped in paths[name].glob(f"*/zero/*/{case['drop']}"):
                dropped.unlink()
    return launch(
        "tests.test_checkpoint:resume_converted_worker",
        1,
        {"cases": CONVERTED_CASES, "paths": {name: str(path) for name, path in paths.items()}},
    )[0]


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference_training(
        make_samples(**DATA), steps=STEPS_PER_EPOCH, batch_size=BATCH, lr=LR, momentum=MOMENTUM, epochs=EPOCHS
    )


@pytest.fixture(scope="module")
def adamw_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference_training(
        make_samples(**DATA), steps=STEPS_PER_EPOCH, batch_size=BATCH, lr=ADAMW_LR, epochs=EPOCHS, optimizer="adamw"
    )


@pytest.mark.parametrize("name", CASES)
def test_resume_equals_uninterrupted_single_process(results: list[dict[str, Any]], reference: Any, name: str) -> None:
    expected_losses, expected = reference
    initial = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    case = CASES[name]
    # the resumed run's micro-batch losses: per SP group, so a dp=2 resume averages its two ranks' samples
    resumed_losses = torch.tensor([r[name]["resumed_losses"] for r in results]).reshape(2, -1)
    if case["resume_sp"] == 1:
        resumed_losses = resumed_losses.mean(dim=0, keepdim=True).expand(2, -1)
    for rank, result in enumerate(results):
        got = result[name]
        saved_steps = case["saved_steps"]
        assert got["steps"] == EPOCHS * STEPS_PER_EPOCH
        torch.testing.assert_close(
            torch.tensor(got["first_losses"]), torch.tensor(expected_losses[:saved_steps]), rtol=1e-5, atol=0
        )
        torch.testing.assert_close(resumed_losses[rank], torch.tensor(expected_losses[saved_steps:]), rtol=1e-5, atol=0)
        saved = got["saved"]
        error = relative_update_error(saved, expected, got["resumed"])
        assert error < 1e-4, f"{name} rank {rank}: resumed weights vs single process, relative error {error:.2e}"
        if case.get("uninterrupted"):
            torch.testing.assert_close(
                torch.tensor(got["uninterrupted_losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0
            )
            error = relative_update_error(saved, got["uninterrupted"], got["resumed"])
            assert error < 1e-4, f"{name} rank {rank}: resumed vs uninterrupted weights, relative error {error:.2e}"
            assert relative_update_error(initial, expected, got["uninterrupted"]) < 1e-4


@pytest.mark.parametrize(("name", "converted"), [("sp2_zero2", False), ("sp2_zero3", False), ("sp2_zero3", True)])
def test_export_hf_model_loads_with_the_saved_logits(
    results: list[dict[str, Any]], tmp_path: Path, name: str, converted: bool
) -> None:
    source = results[0][name]["path"]
    if converted:
        convert_checkpoint(source, tmp_path / "universal")
        source = tmp_path / "universal"
    export_hf_model(source, tiny_llama(), tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    expected = tiny_llama()
    expected.load_state_dict(results[0][name]["saved"])
    assert (
        relative_update_error(
            {n: p.detach() for n, p in tiny_llama().named_parameters()},
            results[0][name]["saved"],
            dict(loaded.named_parameters()),
        )
        < 1e-6
    )
    input_ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, expected(input_ids).logits, rtol=1e-5, atol=1e-6)


def test_resume_on_another_process_count_or_stage_is_refused(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert "saved by 2 processes under ZeRO stage 3; this run has 2 processes under ZeRO stage 2" in (
            result.get("stage_change_error", "")
        ), result.get("stage_change_error")
    path = results[0]["sp2_zero3"]["path"]
    check_resumable(path, 2, 3)  # any sp x dp split of 2 processes under ZeRO-3 resumes
    with pytest.raises(ValueError, match=r"saved by 2 processes under ZeRO stage 3; this run has 4 processes"):
        check_resumable(path, 4, 3)
    with pytest.raises(ValueError, match=r"ZeRO stage 3; this run has 2 processes under ZeRO stage 2"):
        check_resumable(path, 2, 2)


@pytest.mark.parametrize("name", CONVERTED_CASES)
def test_converted_checkpoint_resumes_on_another_process_count_and_stage(
    results: list[dict[str, Any]], converted_results: dict[str, Any], reference: Any, name: str
) -> None:
    expected_losses, expected = reference
    got = converted_results[name]
    assert (got["steps"], got["epoch"]) == (EPOCHS * STEPS_PER_EPOCH, EPOCHS)  # Lightning's loops carried over
    saved = results[0][CONVERTED_CASES[name]["source"]]["saved"]
    error = relative_update_error(saved, expected, got["resumed"])
    if CONVERTED_CASES[name].get("drop"):
        assert error > 1e-2, f"{name}: a resume without the momentum still matches the reference ({error:.2e})"
        return
    saved_steps = CASES[CONVERTED_CASES[name]["source"]]["saved_steps"]
    torch.testing.assert_close(
        torch.tensor(got["resumed_losses"]), torch.tensor(expected_losses[saved_steps:]), rtol=1e-5, atol=0
    )
    assert error < 1e-4, f"{name}: resumed weights vs single process, relative error {error:.2e}"


def test_converted_single_process_adamw_resumes_on_two_processes_zero3(
    results: list[dict[str, Any]], single_process_adamw: dict[str, Any], adamw_reference: Any
) -> None:
    expected_losses, expected = adamw_reference
    torch.testing.assert_close(
        torch.tensor(single_process_adamw["first_losses"]),
        torch.tensor(expected_losses[:STEPS_PER_EPOCH]),
        rtol=1e-5,
        atol=0,
    )
    for rank, result in enumerate(results):
        got = result["adamw_1_process_zero2_to_2_processes_zero3"]
        assert got["steps"] == EPOCHS * STEPS_PER_EPOCH
        torch.testing.assert_close(
            torch.tensor(got["resumed_losses"]), torch.tensor(expected_losses[STEPS_PER_EPOCH:]), rtol=1e-5, atol=0
        )
        error = relative_update_error(single_process_adamw["saved"], expected, got["resumed"])
        assert error < 1e-4, f"rank {rank}: resumed AdamW weights vs single process, relative error {error:.2e}"


def test_unconverted_refusal_says_how_to_convert_and_zero3_refuses_sgd_state(
    converted_results: dict[str, Any], tmp_path: Path, results: list[dict[str, Any]]
) -> None:
    path = results[0]["sp2_zero2"]["path"]
    command = re.escape(f"lightning-ulysses convert-checkpoint {path} {path}-universal")
    with pytest.raises(ValueError, match=rf"{command} .*then ckpt_path="):
        check_resumable(path, 1, 1)
    converted = tmp_path / "universal"
    convert_checkpoint(path, converted)
    for processes, stage in ((1, 1), (4, 2)):
        check_resumable(converted, processes, stage)  # any process count under ZeRO 1/2
    with pytest.raises(ValueError, match=r"holds optimizer state \['momentum_buffer'\].*under ZeRO stage 1 or 2"):
        check_resumable(converted, 2, 3)
    assert "loads only to resume trainer.fit" in converted_results.get("validate_error", ""), converted_results.keys()


def test_convert_checkpoint_command_writes_what_the_function_writes(
    results: list[dict[str, Any]], tmp_path: Path
) -> None:
    source = results[0]["sp2_zero3"]["path"]
    main(["convert-checkpoint", source, str(tmp_path / "command")])
    convert_checkpoint(source, tmp_path / "function")
    files = sorted(p.relative_to(tmp_path / "function") for p in (tmp_path / "function").rglob("*") if p.is_file())
    assert len(files) > 3 and files == sorted(
        p.relative_to(tmp_path / "command") for p in (tmp_path / "command").rglob("*") if p.is_file()
    )
    for file in files:
        if file.suffix == ".pt":
            expected = torch.load(tmp_path / "function" / file, weights_only=False)
            assert _same(torch.load(tmp_path / "command" / file, weights_only=False), expected), file


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__"):  # e.g. DeepSpeed's loss scaler, which has no __eq__
        return type(a) is type(b) and _same(vars(a), vars(b))
    return a == b


def test_frozen_parameters_come_back_from_a_converted_checkpoint(
    results: list[dict[str, Any]], single_process_adamw: dict[str, Any]
) -> None:
    saved = single_process_adamw["frozen_saved"]
    assert torch.equal(saved["model.norm.weight"], torch.full_like(saved["model.norm.weight"], 0.5))
    for rank, result in enumerate(results):
        resumed = result["frozen_1_process_zero2_to_2_processes_zero3"]
        assert resumed.keys() == saved.keys()
        for name, value in saved.items():  # the trained weights (AdamW state) and the frozen norm alike
            torch.testing.assert_close(resumed[name], value, rtol=1e-6, atol=0, msg=f"rank {rank}: {name}")


def test_convert_checkpoint_refuses_its_input_or_a_non_empty_output(
    results: list[dict[str, Any]], tmp_path: Path
) -> None:
    source = Path(results[0]["sp2_zero2"]["path"])
    files = {path: path.stat().st_mtime_ns for path in source.rglob("*") if path.is_file()}
    for output in (source, source / "universal", source.parent):  # itself, inside it, around it
        with pytest.raises(ValueError, match="it is the checkpoint .* being converted, inside it or around it"):
            convert_checkpoint(source, output, overwrite=True)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("kept")
    with pytest.raises(ValueError, match=r"exists and is not an empty directory.*overwrite=True"):
        convert_checkpoint(source, occupied)
    assert (occupied / "notes.txt").read_text() == "kept"
    convert_checkpoint(source, occupied, overwrite=True)
    assert not (occupied / "notes.txt").exists() and is_universal_checkpoint(occupied)
    assert {path: path.stat().st_mtime_ns for path in source.rglob("*") if path.is_file()} == files, "input changed"
    check_resumable(source, 2, 2)


class _Payload:
    """Unpickling it creates ``marker``: what a tampered checkpoint file could run on every rank."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return Path.touch, (self.marker,)


def test_files_of_tensors_are_loaded_without_running_their_code(tmp_path: Path) -> None:
    marker, checkpoint = tmp_path / "code_ran", tmp_path / "universal"
    tag = checkpoint / "checkpoint"
    (tag / "zero" / "model.norm.weight").mkdir(parents=True)
    (checkpoint / "latest_universal").write_text("checkpoint")
    torch.save({"model.norm.weight": _Payload(marker)}, tag / UNTRAINED_STATE_FILE)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_untrained_state(tiny_llama(), checkpoint)
    torch.save({"param": _Payload(marker)}, tag / "zero" / "model.norm.weight" / "fp32.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        export_hf_model(checkpoint, tiny_llama(), tmp_path / "hf", prefix="")
    assert not marker.exists()
