"""The model zoo: every causal LM that the installed transformers registers, trained one step with sequence
parallelism and compared with one process of the plain model on the whole sequence.

The project's promise, checked family by family: a model that ``UlyssesStrategy`` accepts trains exactly like one
process on the whole sequence; any other is refused at set-up with :class:`~lightning_ulysses.hf.UnsupportedModelError`.
Each entry (one per ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, plus :data:`VARIANT_ENTRIES` and the
:data:`CONTROL_ENTRIES`) gets a tiny seeded config with the proportions of its default (flagship) config and its
features on (:mod:`tests.zoo_configs`) and:

* reference: the plain, unpatched model (eager attention where it has it, else SDPA) on one process on the whole
  batch, token-mean next-token cross entropy, one SGD step;
* SP run: the same initial weights wrapped in a LightningModule with :class:`~lightning_ulysses.UlyssesLossMixin`,
  ``L.Trainer(devices=2, strategy=UlyssesStrategy(sp_size=2, stage=2, attn_implementation="sdpa"), max_steps=1)``;
* verdict: ``PASS`` (loss within ``rtol`` 1e-5 and weight update within 1e-4 relative error, or 10x the plain
  model's own eager-vs-SDPA difference where that is larger, on every rank),
  ``REFUSED`` (UnsupportedModelError before any training step), ``FAIL`` (ran and differs), ``ERROR`` (any other
  exception in the SP run) or ``NOT BUILT`` (the tiny config or the plain reference could not be built or run).

The user's path, crossed with the memory options: each entry's tiny model (its perturbed initial weights) is written
with ``save_pretrained`` to a folder, and the reference is the plain model loaded from there with ``from_pretrained``
and trained in train mode, checked to hold exactly the saved parameters and buffers and to draw no random numbers
(every zoo config has dropout 0: two train-mode forwards agree).
For each setting of :data:`OPTION_SETTINGS` (no option, each of ``tiled_loss``, ``tiled_mlp``, ``fused_norms``,
``head_chunks="auto"``, activation checkpointing with offload, all of them together) an entry that trains in the
default set-up (``PASS``, ``GATHER``: with ``sequence_mixers="gather"``) trains again, its model loaded on each rank
with ``from_pretrained`` as a user gets it (eval mode), the loss through
:meth:`~lightning_ulysses.UlyssesLossMixin.forward_causal_lm_loss` (tiled when ``tiled_loss`` is on). Verdict:
``PASS`` (exact as above, and activation checkpointing and the tiled loss show their effect: decoder layers run
again in the backward; ``lm_head`` runs in tiles, each either run again in the backward or, fused, with its backward
inside the loss's forward), ``REFUSED`` (refused at set-up by a message that names an option asked for:
the one to drop), else ``FAIL`` / ``ERROR`` / ``NOT BUILT`` (the folder could not be written or read back). The
reference is computed once per entry and serves every setting.

Data: 2 rows of 32 random token ids (no special tokens), labels -100 on a span across the shard border.

All entries run inside one launch of 2 processes, one after the other, each caught on its own. The references are
split between the two ranks and computed first, before any process group exists (``save_pretrained`` writes on
torch.distributed's rank 0 only); each rank saves the recipe, the (perturbed, seeded) initial weights, their
``save_pretrained`` folder and the reference result of its entries to a shared folder, which the SP runs then read.
After each run (an entry's default set-up, then each option setting) the ranks exchange their outcomes on a
process group of the harness's own. An entry that failed on one rank only
releases the others after ``COLLECTIVE_TIMEOUT``; the ranks then make every process group afresh (see
:class:`_World`), so that no abandoned collective reaches the next entry.

``python -m tests.zoo`` prints the table (every entry, every option setting; ``--options`` picks settings, none with
``--options`` alone); ``python -m tests.zoo --markdown docs/model-support.md`` writes the page.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lightning_ulysses import UlyssesLossMixin, UlyssesStrategy
from lightning_ulysses.hf import SequenceMixers, UnsupportedModelError
from lightning_ulysses.sharding import IGNORE_INDEX
from tests.launch import launch
from tests.tiny import collate, cpu_trainer, relative_update_error
from tests.zoo_configs import SEQ_LEN, SHARD_LEN, SP_SIZE, TinyRecipe, features, tiny_recipe

ROWS = 2
MASKED_SPAN = (SHARD_LEN - 4, SHARD_LEN + 4)  # labels -100 across the shard border
LR = 0.1
SEED = 0
PERTURBATION = 0.02  # std of the noise added to every initial weight
LOSS_RTOL = 1e-5
UPDATE_TOLERANCE = 1e-4
KERNEL_NOISE_FACTOR = (
    10  # the SP update may differ from the reference by 10x the plain model's eager-vs-SDPA difference
)
COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # an entry that fails on one rank only frees the others after this
HARNESS_TIMEOUT = timedelta(minutes=10)
LAUNCH_TIMEOUT_S = 1800.0
REGENERATE = "python -m tests.zoo --markdown docs/model-support.md"

PASS, GATHER, REFUSED, FAIL, ERROR, NOT_BUILT = "PASS", "GATHER", "REFUSED", "FAIL", "ERROR", "NOT BUILT"
SEVERITY = [PASS, GATHER, REFUSED, FAIL, ERROR, NOT_BUILT]  # when the ranks disagree, the worst verdict is the entry's


@dataclass(frozen=True)
class ZooEntry:
    """One row of the zoo: a family (``model_type``), optionally with a config variant."""

    name: str
    model_type: str
    variant: str | None = None
    sp_loss_scale: float = 1.0  # a control entry's deliberately wrong SP loss


# the families whose token mixers outside attention run head-sharded (checked against the sp=2 run), also run at sp=4
SHARDED_MIXER_FAMILIES = [
    "bailing_hybrid",
    "bamba",
    "falcon_h1",
    "falcon_mamba",
    "granitemoehybrid",
    "jamba",
    "kimi_linear",
    "lara_mini",
    "lfm2",
    "lfm2_moe",
    "lfm3",
    "mamba",
    "mamba2",
    "minimax",
    "nemotron_h",
    "olmo_hybrid",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "qwen3_next",
    "recurrent_gemma",
    "rwkv",
    "xlstm",
    "zamba",
    "zamba2",
    "zaya",
]
# those this transformers registers (5.17 has no bailing_hybrid, lara_mini, lfm3)
SHARDED_MIXER_FAMILIES = [name for name in SHARDED_MIXER_FAMILIES if name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
VARIANT_ENTRIES = [
    ("llama", "rope=dynamic"),
    ("phi3", "rope=longrope"),
    # the families that scale their logits outside lm_head, with the factor their checkpoints set (defaults: 1)
    *[(model_type, "logits scaled") for model_type in ("granite", "granitemoe", "granitemoeshared")],
    *[(model_type, "logits scaled") for model_type in ("granitemoehybrid", "falcon_h1", "hyperclovax")],
    ("gemma4_text", "KV sharing"),
]
# entries that check the harness: families known to match must PASS, a wrong SP loss must FAIL
CONTROL_ENTRIES = [ZooEntry("llama[control: SP loss x2]", "llama", sp_loss_scale=2.0)]


# The memory options crossed with the families (each run from a save_pretrained folder loaded with from_pretrained):
# column name -> UlyssesStrategy keyword arguments. "pretrained" asks for no option: the user's path alone.
EVERY_OPTION: dict[str, Any] = {
    "tiled_loss": True,
    "tiled_mlp": True,
    "fused_norms": True,
    "head_chunks": "auto",
    "activation_checkpointing": True,
    "offload_activations": True,  # runs on CPU: the kept inputs are already in host memory
}
OPTION_SETTINGS: dict[str, dict[str, Any]] = {
    "pretrained": {},
    "tiled_loss": {"tiled_loss": True},
    "tiled_mlp": {"tiled_mlp": True},
    "fused_norms": {"fused_norms": True},
    "head_chunks": {"head_chunks": "auto"},
    "checkpointing": {"activation_checkpointing": True, "offload_activations": True},
    "all options": EVERY_OPTION,
}
SINGLE_OPTION_SETTINGS = [name for name in OPTION_SETTINGS if name != "all options"]


def zoo_entries() -> list[ZooEntry]:
    """Every causal-LM family transformers registers, the variants, and the control entries."""
    entries = [ZooEntry(model_type, model_type) for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)]
    entries += [ZooEntry(f"{model_type}[{variant}]", model_type, variant) for model_type, variant in VARIANT_ENTRIES]
    return entries + CONTROL_ENTRIES


@dataclass
class Outcome:
    """One rank's result for one entry (or the merged result of all ranks)."""

    verdict: str
    reason: str = ""
    loss_error: float | None = None
    update_error: float | None = None
    features: str = ""
    seconds: float = 0.0
    missing_package: bool = False  # NOT BUILT for want of an optional package (the environment's, not the harness's)
    sharded_mixers: int = (
        0  # token mixers whose kernels ran head-sharded (lightning_ulysses.hf.mixers.shard_token_mixers)
    )
    recomputed_layers: int = 0  # decoder layers run again in the backward (activation checkpointing's effect)
    loss_tiled: bool = (
        False  # the tiled loss's effect: lm_head ran again in the backward, or its backward in the forward
    )
    options: dict[str, Outcome] = field(default_factory=dict)  # the runs from the save_pretrained folder, by setting


@dataclass
class Prepared:
    """What the rank that prepares an entry saves for both: the recipe, the initial weights, the reference."""

    recipe: TinyRecipe | None = None
    attn_implementation: str = ""  # the plain model's (the SP run builds the same model, then the strategy patches it)
    features: str = ""
    initial: dict[str, Tensor] = field(default_factory=dict)
    reference_loss: float | None = None
    reference_params: dict[str, Tensor] = field(default_factory=dict)
    not_built: str = ""  # why the config or the model could not be built
    missing_package: bool = False  # ... because an optional package is not installed
    reference_failed: str = ""  # why the plain model could not run (the SP run may still be refused)
    folder: str = ""  # the save_pretrained folder of the initial weights
    pretrained_failed: str = ""  # why the folder could not be written, or read back into the same model


# ----------------------------------------------------------------------------------------------
# data and the reference
# ----------------------------------------------------------------------------------------------
def make_samples(token_ids: list[int]) -> list[dict[str, Tensor]]:
    """``ROWS`` samples of ``SEQ_LEN`` token ids drawn from ``token_ids``; labels -100 on ``MASKED_SPAN``."""
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.tensor(token_ids)[torch.randint(len(token_ids), (ROWS, SEQ_LEN), generator=generator)]
    labels = ids.clone()
    labels[:, slice(*MASKED_SPAN)] = IGNORE_INDEX
    return [{"input_ids": ids[row], "labels": labels[row]} for row in range(ROWS)]


def build_model(recipe: TinyRecipe) -> tuple[torch.nn.Module, str]:
    """The plain model and its attention (eager where the family has it, else SDPA), its seeded initial weights
    perturbed so that no path is inert: families initialise gates, biases, sink logits, router weights and
    convolutions to zero, which would hide what they compute."""
    try:
        model, attn_implementation = recipe.build("eager", SEED), "eager"
    except ValueError:  # the family does not implement eager attention
        model, attn_implementation = recipe.build("sdpa", SEED), "sdpa"
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(PERTURBATION * torch.randn(parameter.shape, generator=generator))
    return model, attn_implementation


def prepare(entry: ZooEntry, folder: Path) -> Prepared:
    """Build the entry's tiny model, write it to ``folder`` with ``save_pretrained`` and run the reference step (one
    process, whole sequences) on the model loaded back from there with ``from_pretrained``, in train mode (on the
    built model where the folder does not give it back)."""
    try:
        recipe = tiny_recipe(entry.model_type, entry.variant)
        model, attn_implementation = build_model(recipe)
    except ImportError as exc:  # transformers' message names the package
        return Prepared(not_built=_one_line(exc), missing_package=True)
    except Exception as exc:  # noqa: BLE001 - any failure to build is the entry's NOT BUILT reason
        return Prepared(not_built=_one_line(exc))
    initial = {name: value.detach().clone() for name, value in model.state_dict().items()}
    prepared = Prepared(recipe, attn_implementation, features(recipe, model), initial, folder=str(folder))
    loaded, prepared.pretrained_failed = save_and_reload(model, recipe, attn_implementation, folder)
    if loaded is not None:
        model = loaded.train()  # as one process of plain PyTorch trains it
    if draws_random_numbers(model, reference_batch(recipe)):
        return Prepared(not_built="the plain model's train-mode forward is random (dropout or noise left on)")
    try:
        loss, params = reference_step(model, reference_batch(recipe))
    except Exception as exc:  # noqa: BLE001 - the plain model cannot train on token ids alone
        prepared.reference_failed = _one_line(exc)
        return prepared
    if not loss.isfinite() or all(torch.equal(params[name], initial[name]) for name in params):
        prepared.reference_failed = f"the plain model's step is degenerate (loss {loss.item()}, or no weight moved)"
        return prepared
    prepared.reference_loss, prepared.reference_params = loss.item(), params
    return prepared


def load_pretrained(recipe: TinyRecipe, attn_implementation: str, folder: str | Path) -> PreTrainedModel:
    """The model as a user gets it from a checkpoint folder: ``from_pretrained``, fp32, in eval mode."""
    return recipe.model_class.from_pretrained(folder, attn_implementation=attn_implementation, dtype=torch.float32)


def save_and_reload(
    model: PreTrainedModel, recipe: TinyRecipe, attn_implementation: str, folder: Path
) -> tuple[PreTrainedModel | None, str]:
    """``model`` written to ``folder`` with ``save_pretrained`` and loaded back with :func:`load_pretrained`; ``None``
    and the reason where that fails or the loaded model differs from ``model`` (:func:`state_difference`)."""
    try:
        model.save_pretrained(folder)
        loaded = load_pretrained(recipe, attn_implementation, folder)
    except Exception as exc:  # noqa: BLE001 - the family's pretrained runs are NOT BUILT for this reason
        return None, f"save_pretrained / from_pretrained failed: {_one_line(exc)}"
    difference = state_difference(model, loaded)
    return (None, difference) if difference else (loaded, "")


def state_difference(saved: torch.nn.Module, loaded: torch.nn.Module) -> str:
    """Where ``loaded`` is not in ``saved``'s state: parameters and buffers (persistent or not) missing, extra or
    not equal; ``""`` when it is."""
    want = dict(saved.named_parameters()) | dict(saved.named_buffers())
    got = dict(loaded.named_parameters()) | dict(loaded.named_buffers())
    names = sorted(
        (want.keys() ^ got.keys())
        | {name for name in want.keys() & got.keys() if not torch.equal(want[name].detach(), got[name].detach())}
    )
    return f"the model loaded from the folder differs from the saved one: {', '.join(names)}"[:300] if names else ""


def draws_random_numbers(model: torch.nn.Module, batch: dict[str, Tensor]) -> bool:
    """Whether two train-mode forwards of ``batch`` differ (dropout, router jitter): one step of the SP ranks equals one
    of a single process only where neither draws, so every zoo config switches them off (:mod:`tests.zoo_configs`).
    False where the plain model cannot run (its reference step says why)."""
    try:
        with torch.no_grad():
            first, second = (model(input_ids=batch["input_ids"]).logits for _ in range(2))
    except Exception:  # noqa: BLE001 - the reference step reports the failure
        return False
    return not torch.equal(first, second)


def reference_batch(recipe: TinyRecipe) -> dict[str, Tensor]:
    """The whole rows of every reference step of an entry (the plain model's, and its other kernel's)."""
    return collate(make_samples(recipe.token_ids))


def reference_step(model: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """One SGD step of the plain model on whole sequences: token-mean next-token cross entropy; the loss and the
    updated parameters."""
    logits = model(input_ids=batch["input_ids"]).logits
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX
    )
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.detach(), {name: p.detach().clone() for name, p in model.named_parameters()}


def _kernel_noise(prepared: Prepared) -> float:
    """How far the plain model's own step moves between its eager and SDPA kernels (relative update error): deep
    models amplify float rounding (24-layer Gemma 4: 9e-5), and the SP run may not be held closer than the plain
    model is to itself. 0 when the family has one kernel only."""
    recipe = prepared.recipe
    if prepared.attn_implementation != "eager" or recipe is None:
        return 0.0
    try:
        model = recipe.build("sdpa", SEED)
    except ValueError:  # no SDPA for this family
        return 0.0
    model.load_state_dict(prepared.initial)
    _, params = reference_step(model, reference_batch(recipe))
    initial = {name: prepared.initial[name] for name in prepared.reference_params}
    return relative_update_error(initial, prepared.reference_params, params)


# ----------------------------------------------------------------------------------------------
# the sequence-parallel run
# ----------------------------------------------------------------------------------------------
class ZooModule(UlyssesLossMixin, L.LightningModule):
    """One causal-LM training step: :meth:`~lightning_ulysses.UlyssesLossMixin.forward_causal_lm_loss` (the shard's
    global position ids, the exact token mean, the tiled loss when the strategy asks for it), SGD. Counts the calls
    of the decoder layers' submodules and of the output embedding, to tell which of them the backward ran again, and
    whether the output embedding's backward ran inside the loss's forward (the fused tiled loss's)."""

    def __init__(self, model: PreTrainedModel, loss_scale: float) -> None:
        super().__init__()
        self.model = model
        self.loss_scale = loss_scale
        self.steps_started = 0
        self.losses: list[float] = []
        self.sharded_mixers = 0  # token mixers running head-sharded in the latest step
        self.calls: Counter[tuple[str, str]] = Counter()  # (layer, submodule) -> forward calls so far
        self.forward_calls: Counter[tuple[str, str]] = Counter()  # ... when the latest step's loss was computed
        self.lm_head_gradients = 0  # gradients that reached lm_head's outputs so far
        self.lm_head_backward_in_forward = False  # ... some of them in the latest step's forward
        # transformers checkpoints a layer's forward, not its __call__: the layer's own hooks do not run again, those
        # of its submodules do. Only submodules with parameters: a recompute stops once the backward has every tensor
        # it saved, before a trailing parameter-free module (a residual dropout) whose output nothing saved
        watched = {
            (f"layer {i}", name): child
            for i, layer in enumerate(decoder_layers(model))
            for name, child in layer.named_children()
            if any(True for _ in child.parameters())
        }
        if isinstance(lm_head := model.get_output_embeddings(), torch.nn.Module):
            watched["lm_head", ""] = lm_head
            lm_head.register_forward_hook(self._watch_lm_head_gradient)
        for key, module in watched.items():
            module.register_forward_pre_hook(lambda *_, key=key: self.calls.update([key]))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.steps_started += 1
        self.sharded_mixers = sum("_ulysses_mixer_forward" in m.__dict__ for m in self.model.modules())
        gradients = self.lm_head_gradients
        loss = self.forward_causal_lm_loss(self.model, batch) * self.loss_scale
        self.forward_calls = Counter(self.calls)
        self.lm_head_backward_in_forward = self.lm_head_gradients > gradients
        self.losses.append(loss.item())
        return loss

    def _watch_lm_head_gradient(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(self._count_lm_head_gradient)

    def _count_lm_head_gradient(self, gradient: Tensor) -> None:
        self.lm_head_gradients += 1

    def recomputed(self) -> set[str]:
        """The decoder layers (``"layer i"``) every submodule of which that ran in the latest step's forward ran again
        in its backward (activation checkpointing's effect: a tiled MLP or head chunks recompute parts of a layer
        only), and ``"lm_head"`` if the output embedding ran again (the tiled loss's)."""
        ran: dict[str, list[bool]] = {}
        for (owner, child), count in self.forward_calls.items():
            ran.setdefault(owner, []).append(self.calls[owner, child] > count)
        return {owner for owner, again in ran.items() if all(again)}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers that activation checkpointing acts on: transformers' ``GradientCheckpointingLayer`` modules, or
    where a model has none, every module of an ``nn.ModuleList``."""
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    stacks = [module for module in model.modules() if isinstance(module, torch.nn.ModuleList)]
    return layers or [layer for stack in stacks for layer in stack]


def sp_run(
    entry: ZooEntry,
    prepared: Prepared,
    world_size: int,
    sequence_mixers: SequenceMixers = "refuse",
    setting: str | None = None,
) -> Outcome:
    """Train the entry one step under UlyssesStrategy and compare it with its reference (this rank's view).

    ``setting`` None: the default set-up, on the model built from the config. A model refused only for token mixers
    outside attention is run again with ``sequence_mixers="gather"``: ``GATHER`` when that is exact. ``setting`` a
    key of :data:`OPTION_SETTINGS`: the model loaded from the ``save_pretrained`` folder (in eval mode, as
    ``from_pretrained`` gives it) with those options; ``REFUSED`` only when refused at set-up by a message that names
    an option asked for, and ``FAIL`` where the run is exact but an option shows no effect (activation checkpointing
    ran no decoder layer again in the backward, the tiled loss ``lm_head`` neither again in the backward nor with its
    backward inside the loss's forward)."""
    assert prepared.recipe is not None
    options = {} if setting is None else OPTION_SETTINGS[setting]
    strategy = UlyssesStrategy(
        sp_size=world_size,
        stage=2,
        attn_implementation="sdpa",
        timeout=COLLECTIVE_TIMEOUT,
        sequence_mixers=sequence_mixers,
        **options,
    )
    module: ZooModule | None = None
    refused: Outcome | None = None
    try:
        if setting is None:
            model = prepared.recipe.build(prepared.attn_implementation, SEED)
            model.load_state_dict(prepared.initial)
        else:
            model = load_pretrained(prepared.recipe, prepared.attn_implementation, prepared.folder)
        module = ZooModule(model, entry.sp_loss_scale)
        trainer = cpu_trainer(world_size, strategy, max_steps=1)
        trainer.fit(module, DataLoader(make_samples(prepared.recipe.token_ids), batch_size=ROWS, collate_fn=collate))
    except UnsupportedModelError as exc:
        if module is None or module.steps_started:
            return Outcome(ERROR, f"refused inside a training step, not at set-up: {_one_line(exc)}")
        if setting is not None:
            return option_refusal(exc, options)
        refused = Outcome(REFUSED, _refusal_reason(exc))
        if sequence_mixers != "refuse" or "sequence_mixers='gather'" not in str(exc):
            return refused
    except Exception as exc:  # noqa: BLE001 - any other failure of the SP run is the entry's ERROR
        if options and isinstance(exc, ValueError) and module is not None and not module.steps_started:
            return option_refusal(exc, options)  # the memory options refuse at set-up with a ValueError
        plain = f" (the plain model fails too: {prepared.reference_failed})" if prepared.reference_failed else ""
        return Outcome(ERROR, _one_line(exc) + plain)
    finally:
        _free_process_groups(strategy)
    if refused is not None:  # refused for its token mixers only: run them on the whole sequence
        gathered = sp_run(entry, prepared, world_size, "gather")
        if gathered.verdict != PASS:
            return gathered
        return replace(gathered, verdict=GATHER, reason=f"exact with sequence_mixers='gather' ({refused.reason})")
    if prepared.reference_failed:
        return Outcome(NOT_BUILT, f"the plain model ran no training step: {prepared.reference_failed}")
    if not module.losses:
        return Outcome(ERROR, "the Trainer ran no training step")
    outcome = _compare(module, prepared)
    outcome.sharded_mixers = module.sharded_mixers
    recomputed = module.recomputed()
    outcome.recomputed_layers = len(recomputed - {"lm_head"})
    outcome.loss_tiled = "lm_head" in recomputed or module.lm_head_backward_in_forward
    missing = _missing_effects(options, outcome)
    if outcome.verdict == PASS and missing:
        return replace(outcome, verdict=FAIL, reason=f"exact, but {missing}")
    return outcome


def _missing_effects(options: dict[str, Any], outcome: Outcome) -> str:
    """The asked options whose effect the run does not show, and why; ``""`` when none."""
    missing = []
    if options.get("activation_checkpointing") and not outcome.recomputed_layers:
        missing.append("activation_checkpointing recomputed no decoder layer in the backward")
    if options.get("tiled_loss") and not outcome.loss_tiled:
        missing.append("tiled_loss ran lm_head neither again in the backward nor with its backward in the forward")
    return "; ".join(missing)


def option_run_problem(outcome: Outcome, setting: str) -> str:
    """What is wrong with an entry's run of ``setting`` (``""``: nothing): it must be ``PASS``, or ``REFUSED`` by a
    message that names an option the setting asks for."""
    run = outcome.options[setting]
    if run.verdict == PASS:
        return ""
    named = run.reason.split(": ", 1)[0].split(", ")  # option_refusal puts the options the message names first
    if run.verdict == REFUSED and set(named) <= OPTION_SETTINGS[setting].keys():
        return ""
    return (
        f"{setting}: {run.verdict} (loss error {run.loss_error}, update error {run.update_error}, layers recomputed "
        f"{run.recomputed_layers}, loss tiled {run.loss_tiled}) {run.reason}"
    )


def option_refusal(exc: Exception, options: dict[str, Any]) -> Outcome:
    """A set-up refusal of a run with ``options``: ``REFUSED`` when the message names an option asked for (the one to
    drop), else ``ERROR``."""
    named = [name for name in options if name in str(exc)]
    if named:
        return Outcome(REFUSED, f"{', '.join(named)}: {_refusal_reason(exc)}")
    asked = ", ".join(options) or "no option"
    return Outcome(ERROR, f"refused at set-up, naming none of the options asked ({asked}): {_refusal_reason(exc)}")


def _compare(module: ZooModule, prepared: Prepared) -> Outcome:
    assert prepared.reference_loss is not None
    got = {name: p.detach() for name, p in module.model.named_parameters()}
    initial = {name: prepared.initial[name] for name in prepared.reference_params}
    loss_error = abs(module.losses[-1] - prepared.reference_loss) / abs(prepared.reference_loss)
    update_error = relative_update_error(initial, prepared.reference_params, got)
    # the plain model's own kernel noise, measured only where the update misses the base tolerance (a reference step)
    tolerance = UPDATE_TOLERANCE
    if update_error >= tolerance:
        tolerance = max(tolerance, KERNEL_NOISE_FACTOR * _kernel_noise(prepared))
    passed = loss_error <= LOSS_RTOL and update_error < tolerance
    return Outcome(PASS if passed else FAIL, "", loss_error, update_error)


def _free_process_groups(strategy: UlyssesStrategy) -> None:
    """The strategy makes a process group per axis of its mesh per fit (``dp``, ``ring``, ``ulysses`` and the
    flattened ``sp``); a run of hundreds of fits frees them after each. A gloo group keeps its threads until the object
    dies, and the fit's DeepSpeed engine holds it (through the strategy) in a cycle through its gradient hooks that
    ``gc`` cannot see: the engine's ``destroy`` removes those hooks."""
    from deepspeed import DeepSpeedEngine

    if isinstance(strategy.model, DeepSpeedEngine):
        strategy.model.destroy()
    try:
        mesh = strategy.device_mesh
    except RuntimeError:  # the run failed before the groups existed
        return
    groups = {id(group): group for group in (mesh.get_group(axis) for axis in (*(mesh.mesh_dim_names or ()), "sp"))}
    for group in groups.values():  # the flattened axis may reuse the group of the axis it equals
        dist.destroy_process_group(group)


def _refusal_reason(exc: Exception) -> str:
    """The refused layers and why (the ``- layer: reason`` lines of the message), else its first sentence."""
    lines = [line.strip()[2:] for line in str(exc).splitlines() if line.strip().startswith("- ")]
    return "; ".join(lines)[:600] if lines else str(exc).split(". ")[0] + "."


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


# ----------------------------------------------------------------------------------------------
# the launch
# ----------------------------------------------------------------------------------------------
def zoo_worker(args: dict[str, Any]) -> list[Outcome]:
    """One rank: prepare its share of the entries, then run every entry's SP steps with the other ranks: the default
    set-up, then each of ``args["settings"]`` (for the entries of ``args["option_entries"]``, None: all) unless the
    default set-up is refused or not built."""
    _quiet()
    entries: list[ZooEntry] = args["entries"]
    settings: list[str] = args["settings"]
    option_entries: set[str] | None = args["option_entries"]
    folder = Path(args["folder"])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for index in range(rank, len(entries), size):  # before torch.distributed: save_pretrained writes on its rank 0 only
        torch.save(prepare(entries[index], folder / str(index)), folder / f"{index}.pt")
    world = _World(rank, size)
    world.barrier()
    outcomes = []
    for index, entry in enumerate(entries):
        prepared: Prepared = torch.load(folder / f"{index}.pt", weights_only=False)
        if prepared.not_built:
            run = functools.partial(Outcome, NOT_BUILT, prepared.not_built, missing_package=prepared.missing_package)
        else:
            run = functools.partial(sp_run, entry, prepared, world.size)
        outcome = world.agree(run)
        outcome.features = prepared.features
        crossed = option_entries is None or entry.name in option_entries
        if crossed and outcome.verdict not in (REFUSED, NOT_BUILT):
            mixers: SequenceMixers = "gather" if outcome.verdict == GATHER else "refuse"
            for setting in settings:
                if prepared.pretrained_failed:
                    run = functools.partial(Outcome, NOT_BUILT, prepared.pretrained_failed)
                else:
                    run = functools.partial(sp_run, entry, prepared, world.size, mixers, setting)
                outcome.options[setting] = world.agree(run)
        outcomes.append(outcome)
    return outcomes


class _World:
    """The process groups of a zoo rank, on a store of its own that outlives them, so that they can be made afresh
    after an entry that failed on some ranks only.

    The default group (Lightning's, DeepSpeed's, the strategy's) and DeepSpeed's clone of it, through which ZeRO
    reduces gradients, time out after ``COLLECTIVE_TIMEOUT``: a rank whose entry failed alone holds its peers that
    long at most. DeepSpeed would otherwise make its clone with torch's default timeout of 30 minutes, whatever the
    strategy's ``timeout``. The harness's own group, which exchanges each entry's outcome, waits longer.
    """

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.generation = rank, size, 0
        self.store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            size,
            is_master=rank == 0,
            timeout=HARNESS_TIMEOUT,
        )
        self.harness = self._connect()

    def _connect(self) -> dist.ProcessGroup:
        from deepspeed.utils import groups

        store = dist.PrefixStore(f"world{self.generation}/", self.store)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.size, timeout=COLLECTIVE_TIMEOUT)
        groups._WORLD_GROUP = dist.new_group(ranks=list(range(self.size)), timeout=COLLECTIVE_TIMEOUT)
        return dist.new_group(backend="gloo", timeout=HARNESS_TIMEOUT)

    def renew(self) -> None:
        """Every group destroyed and made again (a failed entry may have left messages in flight)."""
        dist.destroy_process_group()
        self.generation += 1
        self.harness = self._connect()

    def barrier(self) -> None:
        dist.barrier(group=self.harness)

    def agree(self, run: Callable[[], Outcome]) -> Outcome:
        """``run()`` on every rank, timed, merged over the ranks (:func:`merge`)."""
        start = time.perf_counter()
        outcome = run()
        outcome.seconds = time.perf_counter() - start
        everyone: list[Any] = [None] * self.size
        dist.all_gather_object(everyone, outcome, group=self.harness)
        if any((o.verdict, o.reason) != (outcome.verdict, outcome.reason) for o in everyone):
            self.renew()  # the ranks parted ways: collectives one of them abandoned must not reach the next run
        return merge(everyone)


def merge(outcomes: list[Outcome]) -> Outcome:
    """One entry's result from every rank's: the worst verdict; errors the largest; each distinct reason once, a
    rank's collective timeout (waiting for a rank that failed) after the failure itself."""
    worst = max(outcomes, key=lambda o: SEVERITY.index(o.verdict))
    reasons = list(dict.fromkeys(o.reason for o in outcomes if o.verdict == worst.verdict and o.reason))
    reasons.sort(key=lambda reason: "Timed out" in reason)
    errors = [o for o in outcomes if o.loss_error is not None]
    return Outcome(
        worst.verdict,
        " | ".join(reasons),
        max((o.loss_error for o in errors), default=None),
        max((o.update_error for o in errors), default=None),
        worst.features,
        max(o.seconds for o in outcomes),
        worst.missing_package,
        max(o.sharded_mixers for o in outcomes),
        max(o.recomputed_layers for o in outcomes),
        any(o.loss_tiled for o in outcomes),
    )


def _quiet() -> None:
    """The table is the output: no per-fit banners from Lightning, DeepSpeed or transformers."""
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_zoo(
    entries: list[ZooEntry] | None = None,
    sp_size: int = SP_SIZE,
    settings: list[str] | tuple[str, ...] = (),
    option_entries: set[str] | None = None,
) -> dict[str, Outcome]:
    """Run the zoo on ``sp_size`` CPU processes (one SP group); entry name -> merged outcome, whose ``options`` hold
    the runs of each of ``settings`` (keys of :data:`OPTION_SETTINGS`) for the entries named in ``option_entries``
    (None: every entry)."""
    entries = zoo_entries() if entries is None else entries
    args = {"entries": entries, "settings": list(settings), "option_entries": option_entries}
    with tempfile.TemporaryDirectory() as folder:
        results = launch("tests.zoo:zoo_worker", sp_size, {**args, "folder": folder}, timeout=LAUNCH_TIMEOUT_S)
    return {entry.name: outcome for entry, outcome in zip(entries, results[0], strict=True)}


# ----------------------------------------------------------------------------------------------
# reports
# ----------------------------------------------------------------------------------------------
def format_table(results: dict[str, Outcome]) -> str:
    """A plain-text table: entry, features, verdict, loss and update errors, seconds, each option setting's verdict,
    reason; then the option runs that did not pass, and the verdict counts."""
    settings = _settings(results)
    header = ("entry", "features", "verdict", "loss err", "update err", "s", *settings, "reason")
    rows = [
        (
            name,
            o.features,
            o.verdict,
            _error(o.loss_error),
            _error(o.update_error),
            f"{o.seconds:.1f}",
            *[_cell(o, setting) for setting in settings],
            o.reason,
        )
        for name, o in results.items()
    ]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in [header, *rows]
    ]
    failed = [
        f"{name} / {setting}: {run.verdict} (loss err {_error(run.loss_error)}, update err {_error(run.update_error)}, "
        f"{run.seconds:.1f} s) {run.reason}"
        for name, setting, run in _option_runs(results)
        if run.verdict != PASS
    ]
    counts = [f"{setting}: {_counts(_column(results, setting))}" for setting in settings]
    return "\n".join([*lines, "", *failed, "", _counts(results), *counts])


def markdown_page(results: dict[str, Outcome]) -> str:
    """The generated model-support page: one row per family (and variant), its verdict and the reason, a column per
    option setting; then the option runs that did not pass, with their reasons."""
    controls = {entry.name for entry in CONTROL_ENTRIES}
    shown = {name: outcome for name, outcome in results.items() if name not in controls}
    settings = _settings(shown)
    rows = [
        f"| `{name}` | {o.features} | {o.verdict} | {' | '.join(_cell(o, s) for s in settings)}"
        f"{' | ' if settings else ''}{_page_reason(o)} |"
        for name, o in shown.items()
    ]
    option_rows = [
        f"| `{name}` | {setting} | {run.verdict} | {_page_reason(run)} |"
        for name, setting, run in _option_runs(shown)
        if run.verdict != PASS
    ]
    option_counts = [f"- {setting}: {_counts(_column(shown, setting))}" for setting in settings]
    return "\n".join(
        [
            "# Model support",
            "",
            "Generated by the model-zoo test (`tests/zoo.py`); do not edit by hand. Regenerate with",
            "",
            f"```bash\n{REGENERATE}\n```",
            "",
            f"Every causal-LM family that transformers {transformers.__version__} registers, as a tiny seeded model "
            "with the proportions of its default config (usually the flagship checkpoint's: head counts, per-head dims "
            "and widths each shrunk by one factor, so distinct dims stay distinct) and its features on (sliding "
            "windows, MoE, MLA, ...; `tests/zoo_configs.py`), trained one step with "
            "`UlyssesStrategy(sp_size=2)` and compared with one process of the plain model on the whole sequence. "
            "**PASS**: same loss (rtol 1e-5) and same weight update (relative error < 1e-4, or 10x the plain model's "
            "own eager-vs-SDPA difference where that is larger: deep Gemma 4 stacks amplify float rounding to 9e-5); "
            "the hybrid families whose token mixers run head-sharded (`docs/hybrid-models.md`) pass at sp_size=4 too. "
            "**GATHER**: refused by default for token mixers outside attention that have no sharded form, and exact "
            'with `UlyssesStrategy(sequence_mixers="gather")`, which runs those layers on the whole '
            "sequence on every rank (sp_size times their compute). "
            "**REFUSED**: the strategy refuses the model at set-up, for the reason given (the layer, then why). "
            "Anything else is a bug.",
            "",
            *_options_explained(settings),
            _counts(shown),
            *option_counts,
            "",
            f"| family | features | verdict | {''.join(f'{s} | ' for s in settings)}reason |",
            f"|---|---|---|{'---|' * len(settings)}---|",
            *rows,
            "",
            *(
                ["## Option runs that did not pass", "", "| family | option | verdict | reason |", "|---|---|---|---|"]
                + option_rows
                + [""]
                if option_rows
                else []
            ),
        ]
    )


def _options_explained(settings: list[str]) -> list[str]:
    if not settings:
        return []
    asked = "; ".join(
        f"**{name}**: " + (", ".join(f"`{k}={v!r}`" for k, v in OPTION_SETTINGS[name].items()) or "no option")
        for name in settings
    )
    return [
        "The option columns take the user's path: the tiny model (its seeded initial weights) written with "
        "`save_pretrained`, loaded on each rank with `from_pretrained` (in eval mode, as it comes) and trained one "
        "step with the strategy's memory options, against one process of the plain model loaded from the same folder "
        f"and trained in train mode (every zoo config has dropout 0). The settings: {asked}. Each is **PASS** "
        "(exact as above, and the option shows its effect: activation checkpointing runs decoder layers again in the "
        "backward, the tiled loss runs `lm_head` per tile with each tile's backward inside the loss's forward, as it "
        "does where `lm_head`'s weight is whole on the rank: ZeRO-2 here) or **REFUSED** at set-up by a message that "
        "names the option to drop; anything else is a bug. A family refused (or not built) in the default set-up has "
        "no option runs (-). The test suite runs every setting for every family (`tests/test_zoo.py`, in one launch).",
        "",
    ]


def _settings(results: dict[str, Outcome]) -> list[str]:
    """The option settings run for any entry, in the order of :data:`OPTION_SETTINGS`."""
    return [name for name in OPTION_SETTINGS if any(name in o.options for o in results.values())]


def _option_runs(results: dict[str, Outcome]) -> list[tuple[str, str, Outcome]]:
    return [(name, setting, run) for name, o in results.items() for setting, run in o.options.items()]


def _column(results: dict[str, Outcome], setting: str) -> dict[str, Outcome]:
    return {name: o.options[setting] for name, o in results.items() if setting in o.options}


def _cell(outcome: Outcome, setting: str) -> str:
    run = outcome.options.get(setting)
    return "-" if run is None else run.verdict


def _page_reason(outcome: Outcome) -> str:
    if outcome.verdict == FAIL and not outcome.reason:
        return f"loss error {_error(outcome.loss_error)}, update error {_error(outcome.update_error)}"
    return outcome.reason.replace("|", "/")


def _counts(results: dict[str, Outcome]) -> str:
    counts = {verdict: sum(o.verdict == verdict for o in results.values()) for verdict in SEVERITY}
    return ", ".join(f"{verdict}: {count}" for verdict, count in counts.items() if count)


def _error(value: float | None) -> str:
    return "" if value is None else f"{value:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", type=Path, help="also write the model-support page here")
    parser.add_argument("--sp-size", type=int, default=SP_SIZE, help="processes, all in one SP group (default: 2)")
    parser.add_argument(
        "--options",
        nargs="*",
        choices=list(OPTION_SETTINGS),
        default=list(OPTION_SETTINGS),
        help="option settings to run from the save_pretrained folder (default: all; none: --options with no name)",
    )
    parser.add_argument("families", nargs="*", help="entries to run (default: all)")
    args = parser.parse_args()
    wanted = set(args.families)
    entries = [e for e in zoo_entries() if not wanted or e.name in wanted or e.model_type in wanted]
    results = run_zoo(entries, args.sp_size, args.options)
    print(format_table(results))
    if args.markdown:
        args.markdown.write_text(markdown_page(results))


if __name__ == "__main__":
    from tests.zoo import main as zoo_main  # run as tests.zoo, the module whose classes the ranks pickle

    zoo_main()
