"""Checkpoints under sequence parallelism: resume equals the uninterrupted run, layouts, HF export.

Each case trains a tiny Llama with SGD + momentum (optimizer state that a resume must restore) for
one epoch, or for a number of steps that ends inside an epoch, saves, and resumes in a fresh Trainer
up to the end of the second epoch, possibly on another ``(sp, dp)`` layout. The resumed run must reproduce the uninterrupted run and a single process on
whole sequences: every micro-batch loss (``rtol=1e-5``) and the final weights (relative update error
``< 1e-4``; a lost momentum buffer or a wrong data order gives errors near 1). The saved checkpoints
are then exported to Hugging Face folders that must load with ``AutoModelForCausalLM.from_pretrained``
and give the logits of the saved weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from lightning_ulysses import UlyssesStrategy, check_resumable, export_hf_model
from tests.launch import launch
from tests.tiny import (
    VOCAB, SaveAndStop, TinyCausalLM, collate, gathered_parameters, make_samples, reference_training,
    relative_update_error, tiny_llama,
)

DATA = dict(num=8, seq_len=16, seed=3)
LR, MOMENTUM, BATCH, STEPS_PER_EPOCH, EPOCHS = 0.5, 0.9, 2, 4, 2
# saved with sp=2 x dp=1 on 2 processes after `saved_steps` steps; resumed with (resume_sp, its micro-batch size)
CASES: dict[str, dict[str, Any]] = {
    "sp2_zero2": dict(stage=2, saved_steps=STEPS_PER_EPOCH, resume_sp=2, resume_batch=BATCH, uninterrupted=True),
    "sp2_zero3": dict(stage=3, saved_steps=STEPS_PER_EPOCH, resume_sp=2, resume_batch=BATCH, uninterrupted=True),
    # dp=2 with half the micro-batch: the same global batches, so the same trajectory
    "sp2_to_dp2_zero2": dict(stage=2, saved_steps=STEPS_PER_EPOCH, resume_sp=1, resume_batch=BATCH // 2),
    "sp2_to_dp2_zero3": dict(stage=3, saved_steps=STEPS_PER_EPOCH, resume_sp=1, resume_batch=BATCH // 2),
    # inside an epoch: the resumed run must go on at the next batch, not at the epoch's first
    "sp2_zero2_mid_epoch_1": dict(stage=2, saved_steps=STEPS_PER_EPOCH + 1, resume_sp=2, resume_batch=BATCH,
                                  uninterrupted=True),
    "sp2_to_dp2_zero3_mid_epoch_0": dict(stage=3, saved_steps=2, resume_sp=1, resume_batch=BATCH // 2),
}


def _fit(
    world_size: int, stage: int, sp: int, batch: int, max_steps: int = -1, ckpt_path: str | None = None,
    callbacks: list[L.Callback] = (),
) -> tuple[TinyCausalLM, L.Trainer]:
    module = TinyCausalLM(lr=LR, momentum=MOMENTUM)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, max_epochs=EPOCHS, max_steps=max_steps, logger=False,
        strategy=UlyssesStrategy(sp_size=sp, stage=stage, attn_implementation="sdpa"), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
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
        result.update(resumed_losses=resumed.losses, resumed=gathered_parameters(resumed.model, case["stage"] == 3),
                      steps=trainer.global_step, path=path)
        if case.get("uninterrupted"):
            whole, _ = _fit(world_size, case["stage"], 2, BATCH)
            result.update(uninterrupted_losses=whole.losses,
                          uninterrupted=gathered_parameters(whole.model, case["stage"] == 3))
        results[name] = result
    try:  # a ZeRO-3 checkpoint on ZeRO-2: refused before DeepSpeed loads anything
        _fit(world_size, 2, 2, BATCH, ckpt_path=results["sp2_zero3"]["path"])
    except ValueError as error:
        results["stage_change_error"] = str(error)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("checkpoints")
    return launch("tests.test_checkpoint:resume_worker", 2, {"cases": CASES, "dir": str(directory)})


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference_training(make_samples(**DATA), steps=STEPS_PER_EPOCH, batch_size=BATCH, lr=LR, momentum=MOMENTUM,
                              epochs=EPOCHS)


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
        torch.testing.assert_close(torch.tensor(got["first_losses"]), torch.tensor(expected_losses[:saved_steps]),
                                   rtol=1e-5, atol=0)
        torch.testing.assert_close(resumed_losses[rank], torch.tensor(expected_losses[saved_steps:]),
                                   rtol=1e-5, atol=0)
        saved = got["saved"]
        error = relative_update_error(saved, expected, got["resumed"])
        assert error < 1e-4, f"{name} rank {rank}: resumed weights vs single process, relative error {error:.2e}"
        if case.get("uninterrupted"):
            torch.testing.assert_close(torch.tensor(got["uninterrupted_losses"]), torch.tensor(expected_losses),
                                       rtol=1e-5, atol=0)
            error = relative_update_error(saved, got["uninterrupted"], got["resumed"])
            assert error < 1e-4, f"{name} rank {rank}: resumed vs uninterrupted weights, relative error {error:.2e}"
            assert relative_update_error(initial, expected, got["uninterrupted"]) < 1e-4


@pytest.mark.parametrize("name", ["sp2_zero2", "sp2_zero3"])
def test_export_hf_model_loads_with_the_saved_logits(results: list[dict[str, Any]], tmp_path: Path, name: str) -> None:
    export_hf_model(results[0][name]["path"], tiny_llama(), tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    expected = tiny_llama()
    expected.load_state_dict(results[0][name]["saved"])
    assert relative_update_error({n: p.detach() for n, p in tiny_llama().named_parameters()},
                                 results[0][name]["saved"], dict(loaded.named_parameters())) < 1e-6
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
