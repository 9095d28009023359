"""``loss_normalization="global"`` equals one process taking one token mean over each whole optimizer step.

With gradient accumulation and padding, the micro-batches (and DP ranks) of a step carry different
numbers of valid tokens, so the global token mean differs from the default average of per-group means
(the test checks that the two references are far apart). The SP run must match the global reference:
every micro-batch loss (the exact token mean of that micro-batch over all ranks, ``rtol=1e-5``) and the
final weights (relative update error ``< 1e-4``). One run is interrupted after its first step and
resumed from that checkpoint: the step's token count must cover the resumed step's micro-batches only.

With ``limit_train_batches=3`` and 2 micro-batches a step, the token counts must not read the batch past the limit
(which never trains): the loader serves exactly the 3 batches an epoch, and the epoch's 2 steps equal the reference,
the second one the token mean of the third batch alone (Lightning steps on an epoch's last batch); over two epochs,
4 steps, the second epoch's first step on its own batches; also interrupted after step 1 (inside epoch 0) or step 2
(after its short step) and resumed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesStrategy
from tests.launch import launch
from tests.tiny import (
    SaveAndStop,
    TinyCausalLM,
    collate,
    epoch_order,
    gathered_parameters,
    make_samples,
    reference_loss,
    reference_training,
    relative_update_error,
    tiny_llama,
)

pytestmark = pytest.mark.distributed

DATA = dict(num=10, seq_len=16, seed=4, padding=9)  # odd samples have 7 real tokens, even ones 16
BATCH, ACCUMULATE, STEPS, LR = 1, 2, 2, 0.5
LIMITED_BATCHES, LIMITED_EPOCHS = 3, (1, 2)  # limit_train_batches: 2 steps an epoch, the second on 1 batch
LIMITED_RESUMES = (1, 2)  # checkpoints inside epoch 0 (before its short step) and at its end (after it)
CASES = {
    "sp2_zero2": dict(sp=2, stage=2),
    "dp2_zero3": dict(sp=1, stage=3),
    "sp2_zero2_resumed_after_step_1": dict(sp=2, stage=2, resume_after=1),
}


def _fit(case: dict[str, Any], world_size: int, callbacks: list[L.Callback], ckpt_path: str | None) -> TinyCausalLM:
    module = TinyCausalLM(lr=LR)
    strategy = UlyssesStrategy(
        sp_size=case["sp"], stage=case["stage"], attn_implementation="sdpa", loss_normalization="global"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=callbacks,
        accumulate_grad_batches=ACCUMULATE,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(make_samples(**DATA), batch_size=BATCH, collate_fn=collate), ckpt_path=ckpt_path)
    return module


class RecordingSamples(list):
    """Samples that record which indices the loader read."""

    def __init__(self, samples: list[dict[str, Tensor]]) -> None:
        super().__init__(samples)
        self.read: list[int] = []

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        self.read.append(index)
        return super().__getitem__(index)


def _fit_limited(
    world_size: int, max_epochs: int, callbacks: list[L.Callback] = (), ckpt_path: str | None = None
) -> tuple[TinyCausalLM, RecordingSamples]:
    """sp=2, ZeRO-2, 3 batches an epoch (limit_train_batches) of 2 micro-batches a step."""
    module, samples = TinyCausalLM(lr=LR), RecordingSamples(make_samples(**DATA))
    strategy = UlyssesStrategy(sp_size=2, stage=2, attn_implementation="sdpa", loss_normalization="global")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_epochs=max_epochs,
        limit_train_batches=LIMITED_BATCHES,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(samples, batch_size=BATCH, collate_fn=collate), ckpt_path=ckpt_path)
    return module, samples


def global_worker(args: dict[str, Any]) -> dict[str, Any]:
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown deletes it
    results: dict[str, Any] = {}
    for epochs in LIMITED_EPOCHS:
        module, samples = _fit_limited(world_size, max_epochs=epochs)
        results[f"limited_{epochs}_epochs"] = {
            "read": samples.read,
            "losses": module.losses,
            "params": gathered_parameters(module.model, False),
        }
    for step in LIMITED_RESUMES:  # two epochs, interrupted after an optimizer step and resumed from its checkpoint
        ckpt_path = str(Path(args["dir"]) / f"limited_after_step_{step}")
        interrupted, _ = _fit_limited(world_size, 2, [SaveAndStop(step, ckpt_path, False)])
        module, _ = _fit_limited(world_size, 2, ckpt_path=ckpt_path)
        results[f"limited_resumed_after_step_{step}"] = {
            "losses": interrupted.losses + module.losses,
            "params": gathered_parameters(module.model, False),
        }
    for name, case in args["cases"].items():
        losses, ckpt_path = [], None
        if "resume_after" in case:
            ckpt_path = str(Path(args["dir"]) / name)
            interrupt = SaveAndStop(case["resume_after"], ckpt_path, case["stage"] == 3)
            losses = _fit(case, world_size, [interrupt], None).losses
        module = _fit(case, world_size, [], ckpt_path)
        params = gathered_parameters(module.model, case["stage"] == 3)
        results[name] = {"losses": losses + module.losses, "params": params}
    return results


def reference_global_training(
    dp_size: int, batches: int = STEPS * ACCUMULATE, epochs: int = 1
) -> tuple[list[float], dict[str, Tensor]]:
    """One process: each step's micro-batches of every DP rank concatenated, one token mean, one SGD step. Each
    epoch trains its first ``batches`` micro-batches in steps of ``ACCUMULATE``, the last step on the rest.
    Returns the token mean of each micro-batch (all DP ranks together) and the final parameters."""
    samples = make_samples(**DATA)
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    micro_batch_losses = []
    for epoch in range(epochs):
        per_rank = [epoch_order(samples, dp_size, d, epoch) for d in range(dp_size)]
        for first in range(0, batches, ACCUMULATE):
            micro_batches = [
                [per_rank[d][m * BATCH + i] for d in range(dp_size) for i in range(BATCH)]
                for m in range(first, min(first + ACCUMULATE, batches))
            ]
            with torch.no_grad():
                micro_batch_losses += [reference_loss(model, collate(micro)).item() for micro in micro_batches]
            reference_loss(model, collate([s for micro in micro_batches for s in micro])).backward()
            optimizer.step()
            optimizer.zero_grad()
    return micro_batch_losses, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("checkpoints"))
    return launch("tests.test_global_loss:global_worker", 2, {"cases": CASES, "dir": directory})


@pytest.mark.parametrize("name", CASES)
def test_global_normalization_equals_one_process_over_the_whole_step(results: list[dict[str, Any]], name: str) -> None:
    dp_size = 2 // CASES[name]["sp"]
    expected_losses, expected = reference_global_training(dp_size)
    initial = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    _, per_group_mean = reference_training(
        make_samples(**DATA), steps=STEPS, batch_size=BATCH, dp_size=dp_size, accumulate=ACCUMULATE, lr=LR
    )
    assert relative_update_error(initial, expected, per_group_mean) > 1e-2, (
        "the data do not tell the two normalisations apart"
    )
    for rank, result in enumerate(results):
        got = result[name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"


@pytest.mark.parametrize("epochs", LIMITED_EPOCHS)
def test_global_counts_never_read_past_the_batches_that_train(results: list[dict[str, Any]], epochs: int) -> None:
    expected_losses, expected = reference_global_training(dp_size=1, batches=LIMITED_BATCHES, epochs=epochs)
    _, without_the_short_steps = reference_global_training(dp_size=1, batches=LIMITED_BATCHES - 1, epochs=epochs)
    initial = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    assert relative_update_error(initial, expected, without_the_short_steps) > 1e-2, "the short steps must matter"
    for rank, result in enumerate(results):
        got = result[f"limited_{epochs}_epochs"]
        assert len(got["read"]) == epochs * LIMITED_BATCHES * BATCH, (
            f"rank {rank} read samples {got['read']}, beyond the {LIMITED_BATCHES} batches an epoch that train"
        )
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"rank {rank}: the optimizer steps vs one process, relative error {error:.2e}"


@pytest.mark.parametrize("step", LIMITED_RESUMES)
def test_a_run_resumed_around_a_short_step_equals_the_uninterrupted_one(
    results: list[dict[str, Any]], step: int
) -> None:
    expected_losses, expected = reference_global_training(dp_size=1, batches=LIMITED_BATCHES, epochs=2)
    initial = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    for rank, result in enumerate(results):
        got = result[f"limited_resumed_after_step_{step}"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"rank {rank}, resumed after step {step}: relative weight-update error {error:.2e}"
