"""A model loaded with ``from_pretrained`` (eval mode) trains in train mode under UlyssesStrategy.

The user's path: a tiny Llama written by ``save_pretrained`` and loaded by ``from_pretrained``, in the shipped
``CausalLM(pretrained=True)``, in ``DPO`` and in a user's own LightningModule that loads it in ``__init__``, trained
under ``UlyssesStrategy(sp_size=2)`` with activation checkpointing. The effect is asserted, not the flag: layer 0's
MLP runs its forward twice per step (recomputed in the backward; once in eval mode, where transformers does not
checkpoint), every module of the trained model is in train mode at the step's first forward (dropout included), the
frozen ones (a frozen reference model, frozen embeddings) stay in eval, validation in the middle of the fit runs in
eval and hands train mode back, and a resumed fit trains in train mode too. With dropout 0 the result equals one process
of the plain model (loss and update). ``validate`` switches nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from lightning_ulysses import DPO, CausalLM, PreferenceDataModule, UlyssesStrategy
from lightning_ulysses.finetune.tokenizer import byte_chat_tokenizer
from lightning_ulysses.train_mode import frozen_submodules, train_loaded_models
from tests.cases import CaseTable
from tests.finetune_data import preference_records, write_jsonl
from tests.test_equivalence import BATCH, LR, SEQ, STEPS
from tests.test_finetune import fresh_model
from tests.tiny import (
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

CHECKPOINTED = dict(activation_checkpointing=True)
CASES: dict[str, dict[str, Any]] = {
    # a user's own module, from_pretrained in __init__; validation before and between the steps
    "own_module_zero2": dict(module="own", stage=2, strategy=CHECKPOINTED, validate_every_step=True),
    # ... with a frozen reference model and frozen embeddings, which stay in eval
    "own_module_frozen_parts_zero3": dict(module="own", stage=3, strategy=CHECKPOINTED, frozen=True),
    # stopped after step 0, resumed from its checkpoint by a module loaded anew
    "own_module_resumed_zero2": dict(module="own", stage=2, strategy=CHECKPOINTED, resume=True),
    "causal_lm_pretrained_zero2": dict(module="causal_lm", stage=2),
    "dpo_zero2": dict(module="dpo", stage=2),
    "validate_only": dict(module="own", stage=2, validate_only=True),
}


class LoadingCausalLM(TinyCausalLM):
    """A user's module that loads its model in ``__init__``, as transformers' docs do (``from_pretrained``: eval
    mode); ``frozen``: with a frozen reference model and frozen input embeddings."""

    def __init__(self, folder: str, frozen: bool = False) -> None:
        super().__init__(lr=LR)
        self.model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
        if frozen:
            self.reference = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
            self.reference.requires_grad_(False)
            self.model.get_input_embeddings().requires_grad_(False)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR)


class StepRecorder(L.Callback):
    """Per training step: how often layer 0's MLP of each model named ran its forward, and the LightningModule's
    modules in eval mode at the step's first forward; per validation batch, its modules in train mode."""

    def __init__(self, models: tuple[str, ...]) -> None:
        self.models = models
        self.steps: list[dict[str, Any]] = []
        self.train_modes_in_validation: list[list[str]] = []
        self._calls: dict[str, int] = {}
        self._eval_modules: list[str] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name in self.models:
            mlp = getattr(pl_module, name).model.layers[0].mlp
            # a pre-hook: the recomputation stops early, once it has what the backward needs, inside the MLP
            mlp.register_forward_pre_hook(lambda *_, name=name: self._calls.update({name: self._calls[name] + 1}))

        def snapshot(*_: Any) -> None:
            if trainer.training and self._eval_modules is None:
                self._eval_modules = [n for n, m in pl_module.named_modules() if not m.training]

        getattr(pl_module, self.models[0]).register_forward_pre_hook(snapshot)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._calls, self._eval_modules = dict.fromkeys(self.models, 0), None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.steps.append({"mlp_forwards": dict(self._calls), "eval_modules": self._eval_modules})

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.train_modes_in_validation.append([n for n, m in pl_module.named_modules() if m.training])


def _trainer(case: dict[str, Any], world_size: int, *callbacks: L.Callback) -> L.Trainer:
    return cpu_trainer(
        world_size,
        UlyssesStrategy(sp_size=2, stage=case["stage"], attn_implementation="sdpa", **case.get("strategy", {})),
        max_steps=STEPS,
        val_check_interval=1 if case.get("validate_every_step") else None,
        limit_val_batches=None if case.get("validate_every_step") or case.get("validate_only") else 0,
        callbacks=list(callbacks),
    )


def _loader(num: int, seed: int) -> DataLoader:
    return DataLoader(make_samples(num, SEQ, seed=seed), batch_size=BATCH, collate_fn=collate)


def fit_case(name: str, case: dict[str, Any], world_size: int, folder: str, dpo: dict[str, str], tmp: str) -> Any:
    recorder = StepRecorder(("model", "reference") if case["module"] == "dpo" else ("model",))
    if case["module"] == "dpo":
        data = PreferenceDataModule(paths=[dpo["pairs"]], val_paths=[dpo["pairs"]], seq_len=SEQ * 4, batch_size=64)
        module: L.LightningModule = DPO(
            model=dpo["model"], pretrained=True, gradient_checkpointing=True, vocab_size=data.vocab_size
        )
        _trainer(case, world_size, recorder).fit(module, data)
        return {"steps": recorder.steps}
    if case["module"] == "causal_lm":
        module = CausalLM(model=folder, pretrained=True, gradient_checkpointing=True)
        _trainer(case, world_size, recorder).fit(module, _loader(16, seed=1))
        return {"steps": recorder.steps}
    module = LoadingCausalLM(folder, frozen=case.get("frozen", False))
    if case.get("validate_only"):
        _trainer(case, world_size, recorder).validate(module, _loader(4, seed=2), verbose=False)
        return {
            "train_modes_in_validation": recorder.train_modes_in_validation,
            "train_modes_after": [n for n, m in module.named_modules() if m.training and n.startswith("model")],
        }
    losses: list[float] = []
    ckpt_path = None
    if case.get("resume"):
        ckpt_path = str(Path(tmp) / f"{name}.ckpt")
        stop = SaveAndStop(1, ckpt_path, case["stage"] == 3)
        _trainer(case, world_size, StepRecorder(("model",)), stop).fit(module, _loader(16, seed=1))
        losses = module.losses
        module = LoadingCausalLM(folder)  # as a new process would: from_pretrained, eval mode
    val_loader = _loader(4, seed=2) if case.get("validate_every_step") else None
    _trainer(case, world_size, recorder).fit(module, _loader(16, seed=1), val_loader, ckpt_path=ckpt_path)
    return {
        "steps": recorder.steps,
        "train_modes_in_validation": recorder.train_modes_in_validation,
        "losses": losses + module.losses,
        "params": gathered_parameters(module.model, case["stage"] == 3),
    }


def prepare(cases: Any, folder: Path) -> dict[str, Any]:
    """The tiny Llama of the reference training saved as a user saves a model; DPO's model (the byte tokenizer's
    vocabulary) and preference pairs."""
    tiny_llama().save_pretrained(folder / "llama")
    fresh_model(len(byte_chat_tokenizer())).save_pretrained(folder / "dpo_model")
    pairs = str(write_jsonl(folder / "pairs.jsonl", preference_records()))
    dpo = {"model": str(folder / "dpo_model"), "pairs": pairs}
    return {"folder": str(folder / "llama"), "dpo": dpo, "tmp": str(folder)}


TABLE = CaseTable("results", "tests.test_train_mode:fit_case", 2, CASES)
results = TABLE.fixture(prepare)


@pytest.mark.distributed
@TABLE.each_case
def test_loaded_model_trains_in_train_mode(results: list[dict[str, Any]], name: str) -> None:
    case = CASES[name]
    for rank, result in enumerate(r[name] for r in results):
        if case.get("validate_only"):  # evaluation runs in eval mode and switches nothing
            assert result["train_modes_in_validation"] and not any(result["train_modes_in_validation"])
            assert result["train_modes_after"] == [], f"rank {rank}: validate switched modules to train mode"
            continue
        steps = result["steps"]
        assert len(steps) == (1 if case.get("resume") else STEPS), f"{name} rank {rank}: {steps}"
        for step in steps:
            # checkpointed: run in the forward, recomputed in the backward; DPO's reference runs once, without gradient
            expected = {"model": 2, "reference": 1} if case["module"] == "dpo" else {"model": 2}
            assert step["mlp_forwards"] == expected, f"{name} rank {rank}: {step}"
            frozen = [
                n
                for n in step["eval_modules"]
                if not (n == "reference" or n.startswith("reference.") or n == "model.model.embed_tokens")
            ]
            assert frozen == [], f"{name} rank {rank}: in eval mode during the step: {frozen}"
            if case.get("frozen") or case["module"] == "dpo":  # frozen parts stay in eval
                assert "reference.model.layers.0.mlp" in step["eval_modules"]
            if case.get("frozen"):
                assert "model.model.embed_tokens" in step["eval_modules"]
        if case.get("validate_every_step"):  # the sanity check and one validation after each step, all in eval
            validations = result["train_modes_in_validation"]
            assert len(validations) >= 3 and not any(validations), f"rank {rank}: {validations}"


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["own_module_zero2", "own_module_resumed_zero2"])
def test_loaded_model_trains_as_one_process(results: list[dict[str, Any]], name: str) -> None:
    """Dropout 0: train mode changes nothing but checkpointing, so the fit equals one process of the plain model."""
    expected_losses, expected = reference_training(make_samples(16, SEQ, seed=1), steps=STEPS, batch_size=BATCH, lr=LR)
    initial = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    for rank, result in enumerate(r[name] for r in results):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, result["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"


# ----------------------------------------------------------------------------------------------
# the rule, one process
# ----------------------------------------------------------------------------------------------
class Recipe(nn.Module):
    """A policy loaded in eval mode with frozen embeddings, a frozen reference, and a model the recipe put in train
    mode with one part kept in eval."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.policy = AutoModelForCausalLM.from_pretrained(folder)
        self.policy.get_input_embeddings().requires_grad_(False)
        self.reference = AutoModelForCausalLM.from_pretrained(folder).requires_grad_(False)
        self.chosen = AutoModelForCausalLM.from_pretrained(folder).train()
        self.chosen.model.layers[1].eval()


def test_the_rule_switches_loaded_models_and_keeps_frozen_parts_and_a_recipes_modes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tiny_llama().save_pretrained(tmp_path)
    recipe = Recipe(tmp_path)
    assert not any(m.training for m in recipe.policy.modules())  # what from_pretrained returns

    with caplog.at_level(logging.INFO):
        assert train_loaded_models(recipe) == ["policy (LlamaForCausalLM)"]
    (line,) = [r.getMessage() for r in caplog.records if "train mode" in r.getMessage()]
    assert line.startswith("Put policy (LlamaForCausalLM) in train mode") and "policy.model.embed_tokens" in line
    eval_modules = {n for n, m in recipe.named_modules() if not m.training}
    reference = {f"reference{'.' + n if n else ''}" for n, _ in recipe.reference.named_modules()}
    chosen_layer = {
        f"chosen.model.layers.1{'.' + n if n else ''}" for n, _ in recipe.chosen.model.layers[1].named_modules()
    }
    assert eval_modules == {"policy.model.embed_tokens", *reference, *chosen_layer}
    assert train_loaded_models(recipe) == []  # once switched, a model's modes are the recipe's


def test_frozen_submodules_are_the_outermost_wholly_frozen_ones() -> None:
    model = tiny_llama()
    model.model.layers[0].requires_grad_(False)
    model.model.layers[1].mlp.requires_grad_(False)
    model.model.layers[1].self_attn.q_proj.requires_grad_(False)
    layers = model.model.layers
    assert frozen_submodules(model) == [layers[0], layers[1].self_attn.q_proj, layers[1].mlp]
    frozen = tiny_llama().requires_grad_(False)
    assert frozen_submodules(frozen) == [frozen.model, frozen.lm_head]
