"""The memory options of :class:`~lightning_ulysses.UlyssesStrategy`: validated, applied to every transformers model
of a LightningModule in one ledger per model, reported, and refused where they would apply to nothing."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from lightning_ulysses.engines import transformers as transformers_engine
from lightning_ulysses.hf.ledger import Ledger
from lightning_ulysses.hf.state import PatchState, outermost_models
from lightning_ulysses.memory.feed_forward import (
    FeedForward,
    candidate_modules,
    judge_feed_forwards,
    tile_feed_forwards,
)
from lightning_ulysses.memory.norms import Norm, find_norms, fuse_norms, with_call_signatures
from lightning_ulysses.memory.probe import probe_calls, probing
from lightning_ulysses.memory.report import MemoryReport, OptionReport, summarize, summarize_names
from lightning_ulysses.offload import ActivationOffload, default_offload
from lightning_ulysses.replay import replayable
from lightning_ulysses.tiling import TileSetting


@dataclass(frozen=True)
class MemoryOptions:
    """The long-context memory options of :class:`~lightning_ulysses.UlyssesStrategy` (validated here)."""

    tiled_mlp: TileSetting = False
    tiled_loss: TileSetting = False
    activation_checkpointing: bool = False
    offload_activations: bool = False
    fused_norms: bool = False

    def __post_init__(self) -> None:
        for name in ("tiled_mlp", "tiled_loss"):
            value = getattr(self, name)
            if not isinstance(value, (bool, int)) or (not isinstance(value, bool) and value < 1):
                raise ValueError(f"{name} must be True, False or a positive number of tiles, got {value!r}.")
        if self.offload_activations and not self.activation_checkpointing:
            raise ValueError(
                "offload_activations=True moves the inputs that activation checkpointing keeps to CPU memory; "
                "set activation_checkpointing=True as well."
            )


def checkpoint_activations(
    function: Callable[..., Any], *args: Any, offload: bool | ActivationOffload = False, **kwargs: Any
) -> Any:
    """``function(*args, **kwargs)`` keeping only its tensor ``args`` for the backward, which recomputes the rest.

    With ``offload=True`` the kept ``args`` wait in pinned host memory, copied there on a side CUDA stream that
    overlaps the following compute (:mod:`lightning_ulysses.offload`; an :class:`ActivationOffload` instance
    chooses its own streams) and copied back for the recomputation; tensors already on the host stay where
    they are. ``kwargs`` are not offloaded: pass the large per-layer input (the hidden states) positionally.
    Offloaded off the device, head chunks inside ``function`` are recomputed once, not again in the layer's
    recomputation (:mod:`lightning_ulysses.replay`).
    """
    if not offload:
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    offloading = default_offload() if offload is True else offload
    with offloading.hooks():
        return checkpoint(replayable(function, offloading), *args, use_reentrant=False, **kwargs)


MEMORY_ATTRIBUTE = "_ulysses_memory"
"""Where a transformers model holds the :class:`~lightning_ulysses.hf.ledger.Ledger` of its memory options."""


@dataclass
class _Found:
    """What the options of one model apply to."""

    model: PreTrainedModel
    feed_forwards: list[FeedForward]
    norms: list[Norm]
    layers: list[tuple[str, nn.Module]]  # the layers that checkpoint_activations wraps


def apply_memory_options(model: nn.Module, options: MemoryOptions, fitting: bool = True) -> MemoryReport:
    """Apply ``options.tiled_mlp``, activation checkpointing and ``options.fused_norms`` to every transformers model
    inside ``model``, and report what each applies to.

    ``options.tiled_loss`` is read by :class:`~lightning_ulysses.UlyssesLossMixin` instead (the loss is the
    LightningModule's). Raises before any change when an asked option finds nothing to act on, or when ``fitting``
    and activation checkpointing would be switched off by the layers' eval mode (transformers checkpoints a layer only
    while it trains). Finding the feed-forwards and norms runs the model once on a few tokens (collective under
    ZeRO-3, as every forward). Every change is recorded in one ledger per model, which :func:`remove_memory_options`
    undoes; applied again, the new options replace the old.
    """
    hf_models = outermost_models(model)
    if (options.tiled_mlp or options.activation_checkpointing or options.fused_norms) and not hf_models:
        raise ValueError(
            "tiled_mlp, activation_checkpointing and fused_norms act on transformers models, and this "
            "LightningModule holds none. For a custom model call lightning_ulysses.memory.tiled_map on its MLP, "
            "lightning_ulysses.memory.checkpoint_activations on its layers and lightning_ulysses.norms.rms_norm in its "
            "norms."
        )
    for hf_model in hf_models:
        _undo_memory_options(hf_model)
    found = [_find(hf_model, options) for hf_model in hf_models]
    report = _report(found, options, fitting)
    for item in found:
        _apply(item, options)
    return report


def _find(model: PreTrainedModel, options: MemoryOptions) -> _Found:
    if options.activation_checkpointing and not model.supports_gradient_checkpointing:
        raise ValueError(
            f"{type(model).__name__} does not support activation checkpointing (transformers' "
            "supports_gradient_checkpointing is False): set activation_checkpointing=False (and "
            "offload_activations=False)."
        )
    candidates = candidate_modules(model) if options.tiled_mlp else {}
    norms = find_norms(model) if options.fused_norms else []
    feed_forwards: list[FeedForward] = []
    if candidates or norms:
        with probing(model):
            try:
                calls = probe_calls(model, [*candidates, *(n.module for n in norms)])
            except Exception as error:
                raise ValueError(
                    f"tiled_mlp and fused_norms find what they act on by running {type(model).__name__} on a few "
                    f"tokens (input_ids and position_ids), which failed: {error}. Set tiled_mlp=False and "
                    "fused_norms=False."
                ) from error
            feed_forwards = judge_feed_forwards(candidates, calls)
        norms = with_call_signatures(norms, calls)
    layers: list[tuple[str, nn.Module]] = (
        [(name, m) for name, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
        if options.activation_checkpointing
        else []
    )
    return _Found(model, feed_forwards, norms, layers)


def _report(found: list[_Found], options: MemoryOptions, fitting: bool) -> MemoryReport:
    """The rows of the asked options; raises where one applies to nothing."""
    rows = []
    if options.activation_checkpointing:
        rows.append(_checkpointing_row(found, options, fitting))
    if options.tiled_mlp:
        tiled = [(ff.name, ff.module) for item in found for ff in item.feed_forwards if ff.problem is None]
        left = tuple(
            f"{ff.name} ({type(ff.module).__name__}): {ff.problem}"
            for i in found
            for ff in i.feed_forwards
            if ff.problem is not None
        )
        if not tiled:
            raise ValueError(
                "tiled_mlp found no decoder-layer feed-forward that can be tiled exactly in "
                f"{_model_names(found)}"
                + (
                    f" ({'; '.join(left)})"
                    if left
                    else " (no child of a decoder layer maps the hidden states alone to hidden states)"
                )
                + ". Set tiled_mlp=False."
            )
        rows.append(OptionReport(f"tiled_mlp={options.tiled_mlp}", f"{summarize(tiled)} tiled", left))
    if options.fused_norms:
        norms = [n for item in found for n in item.norms]
        fused = [(n.name, n.module) for n in norms if n.fused and not n.runs_own_forward]
        native = [(n.name, n.module) for n in norms if not n.fused]
        gated = tuple(f"{n.name}: called with a gate, runs its own forward there" for n in norms if n.runs_own_forward)
        if not fused and not native:
            raise ValueError(
                f"fused_norms found no RMSNorm or LayerNorm in {_model_names(found)} whose forward a fused norm "
                "reproduces bit for bit (a module with a 1-D 'weight', maybe a 'bias', and an 'eps' or "
                f"'variance_epsilon'){' called without a gate' if gated else ''}. Set fused_norms=False."
            )
        applies = "; ".join(
            [f"{summarize(fused)} fused"] * bool(fused)
            + [f"{summarize(native)}: torch's kernel, kept (it saves only the same)"] * bool(native)
        )
        rows.append(OptionReport("fused_norms", applies, gated))
    return MemoryReport(rows)


def _checkpointing_row(found: list[_Found], options: MemoryOptions, fitting: bool) -> OptionReport:
    layers = [(name, layer) for item in found for name, layer in item.layers]
    if not layers:
        raise ValueError(
            f"activation_checkpointing found no layer that transformers checkpoints (GradientCheckpointingLayer) in "
            f"{_model_names(found)}. Set activation_checkpointing=False."
        )
    on = [(name, layer) for name, layer in layers if layer.training or not fitting]
    # a frozen model kept in eval on purpose (a DPO reference) is not trained: its layers lose nothing
    off = [name for name, layer in layers if fitting and not layer.training and _trainable(layer)]
    if off or not on:
        names = off or [name for name, _ in layers]
        raise ValueError(
            "activation_checkpointing is switched off by eval mode: transformers checkpoints a layer only while it "
            f"trains, and {len(names)} layers are in eval mode ({summarize_names(names)}). from_pretrained returns "
            "a model in eval mode and Lightning keeps the mode it finds: call model.train() after loading it, or "
            "set activation_checkpointing=False."
        )
    what = (
        "checkpointed, their inputs kept in pinned CPU memory (from a GPU)"
        if options.offload_activations
        else "checkpointed"
    )
    option = "activation_checkpointing" + (" + offload_activations" if options.offload_activations else "")
    return OptionReport(option, f"{summarize(on)} {what}")


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _model_names(found: list[_Found]) -> str:
    return ", ".join(type(item.model).__name__ for item in found)


def _apply(item: _Found, options: MemoryOptions) -> None:
    model = item.model
    ledger = Ledger()
    if options.tiled_mlp:
        state: PatchState | None = model.__dict__.get("_ulysses_state")
        tile_feed_forwards(item.feed_forwards, options.tiled_mlp, state, ledger)
    fuse_norms(item.norms, ledger)
    if options.activation_checkpointing:
        checkpointed = functools.partial(checkpoint_activations, offload=options.offload_activations)
        transformers_engine.enable_gradient_checkpointing(model, checkpointed)
        ledger.record(
            "activation_checkpointing", functools.partial(transformers_engine.disable_gradient_checkpointing, model)
        )
    ledger.set("memory", model, MEMORY_ATTRIBUTE, ledger)


def remove_memory_options(model: nn.Module) -> None:
    """Undo :func:`apply_memory_options` on every module inside ``model``."""
    for sub in model.modules():
        _undo_memory_options(sub)


def _undo_memory_options(module: nn.Module) -> None:
    ledger = module.__dict__.get(MEMORY_ATTRIBUTE)
    if ledger is not None:
        ledger.undo()
