"""The zoo harness's own pieces (:mod:`tests.zoo`), in one process: the pretrained runs start from the folder's state
in eval mode, the reference is loaded from that folder, the effect count sees recomputed layers, a refusal counts only
when it names an option asked for, and a model with dropout on is seen. The zoo itself runs in ``tests/test_zoo.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_ulysses.hf import UnsupportedModelError
from tests.zoo import (
    ERROR,
    PASS,
    REFUSED,
    Outcome,
    ZooEntry,
    ZooModule,
    build_model,
    decoder_layers,
    draws_random_numbers,
    load_pretrained,
    option_refusal,
    option_run_problem,
    prepare,
    reference_batch,
    save_and_reload,
    state_difference,
)
from tests.zoo_configs import tiny_recipe


def test_folder_gives_back_the_saved_model_in_eval_mode(tmp_path: Path) -> None:
    """The pretrained runs start from the folder's state, as ``from_pretrained`` gives it (eval mode); the check of
    that state sees a weight that differs."""
    recipe = tiny_recipe("llama")
    model, attn_implementation = build_model(recipe)
    loaded, why = save_and_reload(model, recipe, attn_implementation, tmp_path)
    assert loaded is not None, why
    assert not loaded.training and model.training
    assert state_difference(model, loaded) == ""
    with torch.no_grad():
        model.get_output_embeddings().weight[0, 0] += 1.0
    assert "lm_head.weight" in state_difference(model, loaded)


def test_prepare_writes_the_folder_the_reference_was_loaded_from(tmp_path: Path) -> None:
    """The reference is the plain model loaded from the entry's folder: its folder holds the initial weights."""
    prepared = prepare(ZooEntry("llama", "llama"), tmp_path)
    assert prepared.recipe is not None and not prepared.pretrained_failed and prepared.reference_loss is not None
    loaded = load_pretrained(prepared.recipe, prepared.attn_implementation, prepared.folder)
    state = loaded.state_dict()
    assert state.keys() == prepared.initial.keys()
    assert all(torch.equal(state[name], prepared.initial[name]) for name in state)


@pytest.mark.parametrize("train", [True, False])
def test_effect_count_sees_recomputed_layers(train: bool) -> None:
    """:meth:`ZooModule.recomputed` counts the decoder layers that activation checkpointing runs again in the
    backward: all of them in train mode, none in eval mode (transformers checkpoints only while training)."""
    recipe = tiny_recipe("llama")
    model, _ = build_model(recipe)
    model.gradient_checkpointing_enable()
    module = ZooModule(model.train(train), loss_scale=1.0)
    batch = reference_batch(recipe)
    batch = {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])}
    batch["shift_labels"] = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    module.training_step(batch, 0).backward()
    layers = {f"layer {i}" for i in range(len(decoder_layers(model)))}
    assert module.recomputed() == (layers if train else set())


def test_a_refusal_passes_only_when_it_names_an_option_asked_for() -> None:
    """A set-up refusal of an option run is accepted when its message names the option to drop, not otherwise (e.g.
    head chunks refused for "mixing tokens outside attention", which dropping no option the message names fixes)."""
    named = option_refusal(ValueError("tiled_mlp found no dense MLP in X. Set tiled_mlp=False."), {"tiled_mlp": True})
    unnamed = option_refusal(
        UnsupportedModelError("layers.0.self_attn (X): mixes information between tokens outside attention"),
        {"head_chunks": "auto"},
    )
    assert (named.verdict, unnamed.verdict) == (REFUSED, ERROR)
    outcome = Outcome(PASS, options={"tiled_mlp": named, "head_chunks": unnamed, "tiled_loss": named})
    assert option_run_problem(outcome, "tiled_mlp") == ""
    assert option_run_problem(outcome, "head_chunks").startswith("head_chunks: ERROR")
    assert option_run_problem(outcome, "tiled_loss").startswith("tiled_loss: REFUSED")  # names another option


def test_a_model_with_dropout_on_is_seen() -> None:
    """The zoo's models draw no random numbers in train mode (its configs switch dropout off), and the check that
    keeps a family with dropout out of the comparison sees dropout that is on."""
    recipe = tiny_recipe("llama")
    model, _ = build_model(recipe)
    batch = reference_batch(recipe)
    assert not draws_random_numbers(model.train(), batch)
    model.model.layers[0].self_attn.attention_dropout = 0.5  # read by the eager attention in train mode
    assert draws_random_numbers(model, batch)
