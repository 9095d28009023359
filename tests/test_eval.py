"""Validation, test and predict under sequence parallelism equal one process on whole sequences.

Every case evaluates a tiny Llama through ``L.Trainer`` on CPU processes (gloo) three ways: in the
validation loop of ``fit``, with ``trainer.validate`` on the fitted engine, and with ``trainer.test``
on a fresh Trainer (DeepSpeed's inference engine), then predicts per-token log-probabilities that
must come back in whole-sequence order and equal one process's (``rtol=1e-5``). With an odd number of
samples on 2 DP ranks (every ZeRO stage, and the memory options whose tiled MLP agrees on tiles over all
ranks), every loop must run the same batches on both ranks, count each sample once in the metrics and
predict each sample exactly once. The eval data differ from the training data in
batch size, in length (not a multiple of sp) and in valid tokens per row (padding, masked labels), so
shards and batches carry unequal token counts. The token-weighted loss, perplexity and accuracy must
equal a single-process evaluation with the same weights to ``rtol=1e-5``; a mean of per-rank or
per-batch means, or a loss off by ``sp``, misses by far more.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesStrategy
from lightning_ulysses.logits import Logits
from lightning_ulysses.metrics import Perplexity, TokenAccuracy, TokenCrossEntropy
from lightning_ulysses.model import CausalLM
from lightning_ulysses.prediction import token_log_probs
from lightning_ulysses.sharding import IGNORE_INDEX
from tests.cases import CaseTable
from tests.launch import launch
from tests.tiny import TINY_LLAMA, VOCAB, TinyCausalLM, collate, gathered_parameters, make_samples, tiny_llama

pytestmark = pytest.mark.distributed

TRAIN = dict(num=8, seq_len=16, seed=1)
EVAL = dict(num=12, seq_len=31, seed=2, masked_spans=[(0, 9)], padding=13)
TRAIN_BATCH, EVAL_BATCH = 2, 3
TWO_RANKS = {
    "sp2_zero2": dict(sp=2, stage=2),
    "sp2_zero3": dict(sp=2, stage=3),
    "dp2_zero3": dict(sp=1, stage=3),
    # evaluation and prediction through TiledLogits (5 tiles do not divide a rank's 3 x 16 tokens)
    "sp2_zero3_tiled_loss": dict(sp=2, stage=3, strategy=dict(tiled_loss=5)),
}
ODD_EVAL = {**EVAL, "num": 13}  # 7 samples on DP rank 0, 6 and a repeat on DP rank 1: 3 batches each
FIVE_EVAL = {**EVAL, "num": 5}  # one sample a batch: DP rank 1's third batch is a repeat of sample 0 alone
ODD_DP2 = {
    "dp2_zero1": dict(sp=1, stage=1),
    "dp2_zero2": dict(sp=1, stage=2),
    # every parameter partitioned (the tiny model's are all below ZeRO-3's default persistence threshold)
    "dp2_zero3": dict(
        sp=1,
        stage=3,
        strategy=dict(
            config={
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                "zero_allow_untested_optimizer": True,
            }
        ),
    ),
    "dp2_zero1_memory_options": dict(sp=1, stage=1, strategy=dict(tiled_mlp=True, activation_checkpointing=True)),
}


class EvalCausalLM(TinyCausalLM):
    """TinyCausalLM plus validation and test steps that log the exact token metrics, and torchmetrics' own
    perplexity and micro accuracy next to them where the logits are whole (their sums add up over ranks too)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.metrics = torch.nn.ModuleDict(
            {
                stage: torch.nn.ModuleDict({"loss": TokenCrossEntropy(), "ppl": Perplexity(), "acc": TokenAccuracy()})
                for stage in ("val", "test")
            }
        )
        vocab = tiny_llama().config.vocab_size
        self.torchmetrics = torch.nn.ModuleDict(
            {
                stage: torch.nn.ModuleDict(
                    {
                        "ppl": torchmetrics.text.Perplexity(ignore_index=IGNORE_INDEX),
                        "acc": torchmetrics.classification.MulticlassAccuracy(
                            vocab, average="micro", ignore_index=IGNORE_INDEX
                        ),
                    }
                )
                for stage in ("val", "test")
            }
        )
        self.logits_kinds: set[str] = set()

    def _evaluate(self, batch: dict[str, Tensor], stage: str) -> None:
        logits = self._logits(batch)
        for name, metric in self.metrics[stage].items():
            metric.update(logits, batch["shift_labels"])
            self.log(f"{stage}_{name}", metric)
        # a per-batch value as users log it: Lightning averages the batches of every rank, weighted by batch size
        self.log(f"{stage}_batch_loss", self.causal_lm_loss(logits, batch["shift_labels"]), sync_dist=True)
        if isinstance(logits, Tensor):
            self.torchmetrics[stage]["ppl"].update(logits, batch["shift_labels"])
            self.torchmetrics[stage]["acc"].update(logits.flatten(0, 1), batch["shift_labels"].flatten())
            for name, metric in self.torchmetrics[stage].items():
                self.log(f"{stage}_torchmetrics_{name}", metric)

    def _logits(self, batch: dict[str, Tensor]) -> Logits:
        logits = self.causal_lm_logits(self.model, batch)  # TiledLogits under the strategy's tiled_loss
        self.logits_kinds.add(type(logits).__name__)
        return logits

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        logits = self._logits(batch)
        log_probs = token_log_probs(logits, batch["shift_labels"])
        return {"index": batch["index"], "log_probs": self.trainer.strategy.gather_sequence(log_probs)}


def _trainer(case: dict[str, Any], world_size: int, **kwargs: Any) -> L.Trainer:
    strategy = UlyssesStrategy(
        sp_size=case["sp"], stage=case["stage"], attn_implementation="sdpa", **copy.deepcopy(case.get("strategy", {}))
    )  # Lightning fills in a DeepSpeed config
    return L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _metrics(trainer: L.Trainer, stage: str) -> dict[str, float]:
    names = ("loss", "ppl", "acc", "torchmetrics_ppl", "torchmetrics_acc")
    return {
        name: trainer.callback_metrics[f"{stage}_{name}"].item()
        for name in names
        if f"{stage}_{name}" in trainer.callback_metrics
    }


def _indexed_loader(data: dict[str, Any]) -> DataLoader:
    samples = [dict(sample, index=torch.tensor(i)) for i, sample in enumerate(make_samples(**data))]
    return DataLoader(samples, batch_size=EVAL_BATCH, collate_fn=collate)


def _predict(
    trainer: L.Trainer, loader: DataLoader, seq_len: int, module: EvalCausalLM | None = None
) -> dict[int, Tensor]:
    """Each predicted sample's log-probabilities, without the padding to a multiple of sp; a repeat would raise."""
    predicted: dict[int, Tensor] = {}
    for output in trainer.predict(module or EvalCausalLM(), loader):
        for i, log_probs in zip(output["index"].tolist(), output["log_probs"]):
            assert i not in predicted, f"sample {i} predicted twice"
            predicted[i] = log_probs[:seq_len]
    return predicted


def odd_eval_worker(args: dict[str, Any]) -> dict[str, Any]:
    """Validation inside fit (the first case only), standalone validation and test, and prediction of ODD_EVAL."""
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown deletes it
    results = {}
    for index, (name, case) in enumerate(args["cases"].items()):
        loader = _indexed_loader(ODD_EVAL)
        result = results[name] = {}
        if index == 0:
            module = EvalCausalLM()
            trainer = _trainer(case, world_size, max_epochs=1)
            trainer.fit(module, DataLoader(make_samples(**TRAIN), batch_size=TRAIN_BATCH, collate_fn=collate), loader)
            result.update(in_fit=_metrics(trainer, "val"), fitted=gathered_parameters(module.model, case["stage"] == 3))
            trainer.test(EvalCausalLM(), loader, verbose=False)
            result["test"] = _metrics(trainer, "test")
            five = DataLoader(make_samples(**FIVE_EVAL), batch_size=1, collate_fn=collate)
            trainer = _trainer(case, world_size)
            trainer.validate(EvalCausalLM(), five, verbose=False)
            result["five_batch_loss"] = trainer.callback_metrics["val_batch_loss"].item()
            lm = CausalLM(model=TINY_LLAMA, vocab_size=VOCAB)
            trainer = _trainer(case, world_size)
            trainer.validate(lm, five, verbose=False)
            result["five_causal_lm"] = {
                "loss": trainer.callback_metrics["val_loss"].item(),
                "ppl": trainer.callback_metrics["val_ppl"].item(),
                "params": gathered_parameters(lm.model, case["stage"] == 3),
            }
        trainer = _trainer(case, world_size)
        trainer.validate(EvalCausalLM(), loader, verbose=False)
        result["validate"] = _metrics(trainer, "val")
        result["predict"] = _predict(_trainer(case, world_size), loader, ODD_EVAL["seq_len"])
    return results


def fit_case(name: str, case: dict[str, Any], world_size: int) -> dict[str, Any]:
    eval_loader = _indexed_loader(EVAL)
    train_loader = DataLoader(make_samples(**TRAIN), batch_size=TRAIN_BATCH, collate_fn=collate)
    module = EvalCausalLM()
    trainer = _trainer(case, world_size, max_epochs=1)
    trainer.fit(module, train_loader, eval_loader)
    in_fit = _metrics(trainer, "val")
    trainer.validate(module, eval_loader, verbose=False)
    after_fit = _metrics(trainer, "val")
    fitted = gathered_parameters(module.model, case["stage"] == 3)

    fresh, tested_module, predicted_module = _trainer(case, world_size), EvalCausalLM(), EvalCausalLM()
    fresh.test(tested_module, eval_loader, verbose=False)
    tested = _metrics(fresh, "test")
    predicted = _predict(fresh, eval_loader, EVAL["seq_len"], predicted_module)
    return {
        "in_fit": in_fit,
        "validate": after_fit,
        "fitted": fitted,
        "test": tested,
        "predict": predicted,
        "logits_kinds": [sorted(m.logits_kinds) for m in (module, tested_module, predicted_module)],
    }


def _reference_logits(params: dict[str, Tensor] | None, data: dict[str, Any] = EVAL) -> tuple[Tensor, Tensor]:
    """One process, whole sequences, plain transformers: ``logits [S, N-1, V]`` and their labels ``[S, N-1]``."""
    model = tiny_llama()
    if params is not None:
        model.load_state_dict(params)
    batch = collate(make_samples(**data))
    labels = batch["labels"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)[:, 1:]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    return logits, labels


def reference_metrics(params: dict[str, Tensor] | None, data: dict[str, Any] = EVAL) -> dict[str, float]:
    """Token-weighted loss, perplexity and accuracy of one process over every eval sequence."""
    logits, labels = _reference_logits(params, data)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX).item()
    valid = labels != IGNORE_INDEX
    accuracy = ((logits.argmax(-1) == labels) & valid).sum().item() / valid.sum().item()
    return {"loss": loss, "ppl": math.exp(loss), "acc": accuracy}


def with_torchmetrics(expected: dict[str, float]) -> dict[str, float]:
    """``expected`` plus the values torchmetrics' perplexity and accuracy must give: the same."""
    return {**expected, "torchmetrics_ppl": expected["ppl"], "torchmetrics_acc": expected["acc"]}


def _check(results: list[dict[str, Any]], name: str, whole_logits: bool) -> None:
    fitted = reference_metrics(results[0][name]["fitted"])
    initial = reference_metrics(None)
    if whole_logits:
        fitted, initial = with_torchmetrics(fitted), with_torchmetrics(initial)
    assert abs(fitted["loss"] - initial["loss"]) > 1e-3, "training did not move the eval loss; the check is too weak"
    for rank, result in enumerate(results):
        got = result[name]
        for where, expected in (("in_fit", fitted), ("validate", fitted), ("test", initial)):
            for metric, value in expected.items():
                assert got[where][metric] == pytest.approx(value, rel=1e-5), (
                    f"{name} rank {rank} {where} {metric}: {got[where][metric]} != single process {value}"
                )


def _check_predict(results: list[dict[str, Any]], name: str, sp: int, data: dict[str, Any] = EVAL) -> None:
    logits, labels = _reference_logits(None, data)
    valid = labels != IGNORE_INDEX
    expected = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    expected = torch.cat([expected, torch.zeros(len(expected), 1)], dim=1)  # the last token predicts nothing
    for first in range(0, len(results), sp):  # every rank of an SP group holds its samples, in sequence order
        group = [results[rank][name]["predict"] for rank in range(first, first + sp)]
        assert all(got.keys() == group[0].keys() for got in group)
        for got in group:
            for index, log_probs in got.items():
                torch.testing.assert_close(log_probs, expected[index], rtol=1e-5, atol=1e-6)
    covered = sorted(i for first in range(0, len(results), sp) for i in results[first][name]["predict"])
    assert covered == list(range(len(expected))), "every sample is predicted by exactly one SP group"


TWO_RANK_TABLE = CaseTable("two_rank_results", "tests.test_eval:fit_case", 2, TWO_RANKS)
two_rank_results = TWO_RANK_TABLE.fixture()


@TWO_RANK_TABLE.each_case
def test_two_ranks_eval_equals_single_process(two_rank_results: list[dict[str, Any]], name: str) -> None:
    kind = "TiledLogits" if TWO_RANKS[name].get("strategy", {}).get("tiled_loss") else "Tensor"
    for result in two_rank_results:  # fit + validate, test, predict
        assert result[name]["logits_kinds"] == [[kind]] * 3
    _check(two_rank_results, name, whole_logits=kind == "Tensor")
    _check_predict(two_rank_results, name, TWO_RANKS[name]["sp"])


@pytest.fixture(scope="module")
def odd_results() -> list[dict[str, Any]]:
    return launch("tests.test_eval:odd_eval_worker", 2, {"cases": ODD_DP2})


@pytest.mark.parametrize("name", ODD_DP2)
def test_samples_that_do_not_divide_over_dp_ranks_count_once(odd_results: list[dict[str, Any]], name: str) -> None:
    initial = with_torchmetrics(reference_metrics(None, ODD_EVAL))
    first = next(iter(ODD_DP2))
    for rank, result in enumerate(odd_results):
        got = result[name]
        checks = [("validate", initial)]
        if name == first:
            checks += [
                ("in_fit", with_torchmetrics(reference_metrics(result[name]["fitted"], ODD_EVAL))),
                ("test", initial),
            ]
        for where, expected in checks:
            for metric, value in expected.items():
                assert got[where][metric] == pytest.approx(value, rel=1e-5), (
                    f"{name} rank {rank} {where} {metric}: {got[where][metric]} != single process {value}"
                )
    _check_predict(odd_results, name, sp=1, data=ODD_EVAL)


def test_repeated_samples_weigh_nothing_in_per_batch_logs_and_the_lm_module(odd_results: list[dict[str, Any]]) -> None:
    """dp=2, 5 samples, one a batch: a value logged per batch (``self.log(causal_lm_loss, sync_dist=True)``) averages
    the 5 samples' token means, as one process logging per batch does (plain DDP would count sample 0 twice: its
    sampler repeats it with its labels); CausalLM's val_loss and val_ppl are one process's token means."""
    logits, labels = _reference_logits(None, FIVE_EVAL)
    per_sample = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none").sum(1)
    per_sample = per_sample / (labels != IGNORE_INDEX).sum(1)
    one_process, plain_ddp = per_sample.mean().item(), torch.cat([per_sample, per_sample[:1]]).mean().item()
    assert abs(one_process - plain_ddp) > 5e-5 * one_process, "counting the repeat must miss the tolerance below"
    for rank, result in enumerate(odd_results):
        got = result[next(iter(ODD_DP2))]
        assert got["five_batch_loss"] == pytest.approx(one_process, rel=1e-5), f"rank {rank}: per-batch log"
        expected = reference_metrics(got["five_causal_lm"]["params"], FIVE_EVAL)
        for metric in ("loss", "ppl"):
            assert got["five_causal_lm"][metric] == pytest.approx(expected[metric], rel=1e-5), f"rank {rank}: {metric}"


def test_metrics_sum_tokens_across_uneven_shards() -> None:
    """Without processes: two shards with 3 and 0 valid tokens give the mean over the 3, not a NaN or a halved mean."""
    torch.manual_seed(0)
    logits, labels = torch.randn(1, 4, 5), torch.tensor([[1, 2, 3, IGNORE_INDEX]])
    expected = F.cross_entropy(logits[0], labels[0], ignore_index=IGNORE_INDEX)
    metric = TokenCrossEntropy()
    metric.update(logits[:, :2], labels[:, :2])
    metric.update(logits[:, 2:], labels[:, 2:])
    assert metric.compute().item() == pytest.approx(expected.item(), rel=1e-6)
    metric.update(logits[:, 3:], labels[:, 3:])  # a shard with no valid tokens changes nothing
    assert metric.compute().item() == pytest.approx(expected.item(), rel=1e-6)
    with pytest.raises(RuntimeError, match="no valid tokens"):
        empty = Perplexity()
        empty.update(logits[:, 3:], labels[:, 3:])
        empty.compute()
