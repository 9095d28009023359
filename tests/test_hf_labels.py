"""The Hugging Face habit under sequence parallelism: ``self.model(..., labels=batch["input_ids"]).loss``.

A user's LightningModule without the loss mixin calls the transformers model with ``labels=`` (this rank's shard of
unshifted labels) or ``shift_labels=`` (the batch's) and returns ``.loss``. Under ``UlyssesStrategy`` that loss must
be the SP-exact token mean: every micro-batch loss equal to the plain model's ``labels=`` loss on one process on the
whole sequence (``rtol=1e-5``) and the weights after SGD steps equal (relative update error ``< 1e-4``), under ZeRO-2
and 3, with a length that sp does not divide (the strategy's padding columns), padded rows, accumulation,
Ulysses x Ring (zigzag shards), a rank without valid tokens and ``loss_normalization="global"``.

A loss that went through no SP reduction (a plain ``F.cross_entropy`` mean of the shard) is refused at the first
step, before any optimizer step, with the fix; ``check_loss_reduction=False`` lets it run. The mixin's
``forward_causal_lm_loss`` runs under a plain single-process ``L.Trainer`` on the loader's batches and equals the
strategy's run.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import LlamaForCausalLM

from lightning_ulysses import UlyssesLossMixin, UlyssesStrategy
from lightning_ulysses.hf import apply_ulysses_attention, sequence_parallel_disabled
from tests.cases import CaseTable
from tests.test_global_loss import DATA as GLOBAL_DATA
from tests.test_global_loss import reference_global_training
from tests.tiny import (
    DPStepSampler,
    collate,
    gathered_parameters,
    make_samples,
    reference_loss,
    reference_training,
    relative_update_error,
    tiny_llama,
)

SEQ, BATCH, STEPS, LR = 24, 2, 2, 0.5
PADDED = dict(padding=SEQ // 2 + 3)  # odd rows: their last 15 columns are padding, all of rank 1's shard


class LabelsLM(L.LightningModule):
    """A user's step, the Hugging Face way: the model's own ``.loss`` from ``labels=`` (or ``shift_labels=``)."""

    def __init__(self, labels_from: str = "input_ids") -> None:
        super().__init__()
        self.model = tiny_llama()
        self.labels_from = labels_from
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        labels = {"input_ids": {"labels": batch["input_ids"]}, "shift_labels": {"shift_labels": batch["shift_labels"]}}
        loss = self.model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], **labels[self.labels_from]
        ).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class PlainMeanLM(LabelsLM):
    """The loss mixin forgotten: a plain token mean of this rank's shard."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten())
        self.losses.append(loss.item())
        return loss


class MixinLM(UlyssesLossMixin, LabelsLM):
    """The loss mixin on the loader's batch, whatever the strategy."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.forward_causal_lm_loss(self.model, batch)
        self.losses.append(loss.item())
        return loss


MODULES = {"labels": LabelsLM, "plain_mean": PlainMeanLM, "mixin": MixinLM}
CASES = {
    "labels_zero2_length_not_divisible": dict(stage=2, data=dict(seq_len=SEQ - 1)),
    "labels_zero3_padding": dict(stage=3, data=PADDED),
    "labels_zero2_padding_accumulate2": dict(stage=2, accumulate=2, data=PADDED),
    "labels_ring2_zero2": dict(stage=2, strategy=dict(ring_size=2), data=dict(seq_len=SEQ - 2)),
    "shift_labels_zero3_rank_without_valid_tokens": dict(
        stage=3, labels_from="shift_labels", data=dict(masked_spans=[(SEQ // 2 - 1, SEQ)])
    ),
    "labels_global_zero2_padding_accumulate2": dict(
        stage=2, accumulate=2, batch=1, strategy=dict(loss_normalization="global"), data=GLOBAL_DATA
    ),
    "mixin_zero2_padding": dict(stage=2, module="mixin", data=PADDED),
    "plain_mean_opted_out": dict(stage=2, module="plain_mean", strategy=dict(check_loss_reduction=False)),
    "plain_mean_refused": dict(stage=2, module="plain_mean"),  # last: the world goes on after a fit that raised
}
EXACT = [name for name, case in CASES.items() if case.get("module", "labels") != "plain_mean"]


def _data(case: dict[str, Any]) -> dict[str, Any]:
    return {"num": 16, "seq_len": SEQ, **case.get("data", {})}


def fit_case(name: str, case: dict[str, Any], world_size: int) -> dict[str, Any]:
    module_class = MODULES[case.get("module", "labels")]
    module = module_class(case["labels_from"]) if "labels_from" in case else module_class()
    strategy = UlyssesStrategy(sp_size=2, stage=case["stage"], attn_implementation="sdpa", **case.get("strategy", {}))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=case.get("accumulate", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(make_samples(**_data(case)), batch_size=case.get("batch", BATCH), collate_fn=collate)
    error = None
    try:
        trainer.fit(module, loader)
    except RuntimeError as raised:
        error = str(raised)
    return {
        "losses": module.losses,
        "params": gathered_parameters(module.model, case["stage"] == 3),
        "steps": trainer.global_step,
        "error": error,
    }


TABLE = CaseTable("results", "tests.test_hf_labels:fit_case", 2, CASES)
results = TABLE.fixture()


def _reference(case: dict[str, Any]) -> tuple[list[float], dict[str, Tensor]]:
    """One process, the plain model, whole sequences: its ``labels=`` loss (padding labelled -100, as Hugging Face's
    collators label it) and SGD."""
    if case.get("strategy", {}).get("loss_normalization") == "global":
        return reference_global_training(dp_size=1)
    samples = make_samples(**_data(case))
    return reference_training(
        samples, steps=STEPS, batch_size=case.get("batch", BATCH), accumulate=case.get("accumulate", 1), lr=LR
    )


@pytest.mark.distributed
@pytest.mark.parametrize("name", EXACT)
def test_the_model_s_own_loss_equals_one_process_of_the_plain_model(results: list[dict[str, Any]], name: str) -> None:
    expected_losses, expected = _reference(CASES[name])
    initial = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    for rank, result in enumerate(results):
        got = result[name]
        assert got["error"] is None and got["steps"] == STEPS, got["error"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"


@pytest.mark.distributed
def test_a_loss_without_the_sp_reduction_is_refused_at_the_first_step(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        got = result["plain_mean_refused"]
        assert got["error"] is not None, f"rank {rank} trained a shard's plain mean"
        assert got["steps"] == 0 and len(got["losses"]) == 1, "refused after the first training_step, before a step"
        for fix in ("forward_causal_lm_loss", "labels=batch['input_ids']", "check_loss_reduction=False"):
            assert fix in got["error"], got["error"]


@pytest.mark.distributed
def test_the_check_s_opt_out_trains_the_plain_mean(results: list[dict[str, Any]]) -> None:
    for result in results:
        got = result["plain_mean_opted_out"]
        assert got["error"] is None and got["steps"] == STEPS and len(got["losses"]) == STEPS


@pytest.mark.distributed
def test_the_mixin_under_a_plain_trainer_equals_the_strategy(results: list[dict[str, Any]]) -> None:
    """Lightning's default strategy, one process: the loader's batches (no position_ids, no shift_labels), in the
    order the SP run's sampler deals them."""
    samples = make_samples(**_data(CASES["mixin_zero2_padding"]))
    module = MixinLM()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    sampler = DPStepSampler(len(samples), 1, BATCH)
    trainer.fit(module, DataLoader(samples, batch_size=BATCH, sampler=sampler, collate_fn=collate))
    assert not any("_ulysses_state" in m.__dict__ for m in module.model.modules()), "teardown removes the local patch"
    expected_losses, expected = _reference(CASES["mixin_zero2_padding"])
    initial = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    strategy_run = results[0]["mixin_zero2_padding"]
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(strategy_run["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
    params = {n: p.detach() for n, p in module.model.named_parameters()}
    assert relative_update_error(initial, strategy_run["params"], params) < 1e-4
    assert relative_update_error(initial, expected, params) < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# the patched forward's labels path, one process (a stand-in for the strategy's loss)
# ---------------------------------------------------------------------------------------------------------------
class RecordingLoss:
    def __init__(self) -> None:
        self.calls: list[tuple[Tensor | None, Tensor | None]] = []

    def __call__(self, logits: Tensor, labels: Tensor | None, shift_labels: Tensor | None, ignore: int) -> Tensor:
        self.calls.append((labels, shift_labels))
        return logits.float().mean()


def _patched(model: torch.nn.Module) -> RecordingLoss:
    loss = RecordingLoss()
    apply_ulysses_attention(model, group=None, attn_implementation="sdpa", labels_loss=loss)
    return loss


IDS = torch.randint(1, 61, (2, 12), generator=torch.Generator().manual_seed(0))
POSITIONS = torch.arange(12).expand(2, -1)


def test_a_call_with_labels_or_shift_labels_returns_the_strategy_s_loss() -> None:
    model = tiny_llama()
    recording = _patched(model)
    output = model(input_ids=IDS, position_ids=POSITIONS, labels=IDS)
    assert output.loss == output.logits.mean()
    assert len(recording.calls) == 1 and recording.calls[0][0] is IDS and recording.calls[0][1] is None
    shifted = torch.roll(IDS, -1, 1)
    output = model(input_ids=IDS, position_ids=POSITIONS, shift_labels=shifted)  # plain transformers: no loss
    assert output.loss == output.logits.mean() and recording.calls[-1][1] is shifted
    assert "_loss_function" not in model.__dict__, "the model's loss function is restored"
    with sequence_parallel_disabled(model):  # whole sequences on one rank: the model's own loss
        own = model(input_ids=IDS, position_ids=POSITIONS, labels=IDS).loss
    torch.testing.assert_close(own, reference_loss(tiny_llama(), {"input_ids": IDS}), rtol=1e-5, atol=0)
    assert len(recording.calls) == 2


def test_num_items_in_batch_and_a_loss_function_of_one_s_own_are_refused() -> None:
    model = tiny_llama()
    _patched(model)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        model(input_ids=IDS, position_ids=POSITIONS, labels=IDS, num_items_in_batch=7)
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.sum()
    with pytest.raises(ValueError, match="loss function of your own"):
        model(input_ids=IDS, position_ids=POSITIONS, labels=IDS)


def test_a_model_that_adds_a_router_loss_to_its_loss_is_refused() -> None:
    model = tiny_llama(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    _patched(model)
    model(input_ids=IDS, position_ids=POSITIONS, labels=IDS)  # its loss function's loss
    with pytest.raises(ValueError, match="router's auxiliary loss"):  # added to it in place
        model(input_ids=IDS, position_ids=POSITIONS, labels=IDS, output_router_logits=True)


def test_a_model_that_computes_its_loss_without_its_loss_function_is_refused() -> None:
    class OwnLossLlama(LlamaForCausalLM):
        def forward(
            self, input_ids: Tensor, position_ids: Tensor | None = None, labels: Tensor | None = None, **kwargs: Any
        ) -> Any:
            output = super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)
            if labels is not None:
                output.loss = F.cross_entropy(output.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return output

    model = OwnLossLlama(tiny_llama().config)
    recording = _patched(model)
    with pytest.raises(ValueError, match="without transformers' loss_function"):
        model(input_ids=IDS, position_ids=POSITIONS, labels=IDS)
    assert not recording.calls
