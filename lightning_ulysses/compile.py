"""Regional ``torch.compile``: each decoder layer compiled on its own, as torchtitan compiles per block.

Compiling the whole model traces every layer, the loss and the data path into one program and recompiles whenever
one of them changes; compiling each decoder layer (``nn.Module.compile``, in place: parameter names, the state dict,
DeepSpeed's hooks and checkpoints are unchanged) compiles one layer's code once, reused by every layer of the same
class (dynamo takes the layer's parameters as inputs). Inside a layer, what dynamo cannot trace (the Ulysses
all-to-alls, the per-batch document plans) runs eagerly between compiled regions (graph breaks): the projections,
norms, rotary embedding and feed-forward around them are fused by inductor. Activation checkpointing wraps the
compiled layer (its recomputation runs the compiled code again). The decoder layers are the modules transformers
checkpoints (``GradientCheckpointingLayer``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from lightning_ulysses.hf.ledger import Ledger
from lightning_ulysses.hf.state import outermost_models
from lightning_ulysses.memory.report import OptionReport, summarize

COMPILE_ATTRIBUTE = "_ulysses_compiled"
"""Where a transformers model holds the :class:`~lightning_ulysses.hf.ledger.Ledger` of its compiled layers."""


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder layers of every transformers model inside ``model``: ``(path, layer)``."""
    return [(name, layer) for name, layer in model.named_modules() if isinstance(layer, GradientCheckpointingLayer)]


def compiled_regions(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """What :func:`compile_decoder_layers` compiles of decoder ``layer``: the layer itself, or, when it is
    checkpointed (transformers' ``gradient_checkpointing`` flag), each of its children. Dynamo compiles nothing of a
    frame that breaks its graph inside a checkpointed region (the saved-tensor hooks of the checkpoint), and the
    Ulysses all-to-alls break it: children without a break (norms, feed-forward) still compile there."""
    if getattr(layer, "gradient_checkpointing", False):
        return [(f".{name}", child) for name, child in layer.named_children()]
    return [("", layer)]


def compile_decoder_layers(model: nn.Module, **compile_options: Any) -> OptionReport:
    """Compile each decoder layer of every transformers model inside ``model`` in place, or each child of a
    checkpointed one (:func:`compiled_regions`): its ``forward`` replaced by ``torch.compile(forward,
    **compile_options)``, so that its hooks (ZeRO's, checkpointing's) run outside the compiled code. Reports the
    regions compiled.

    Raises when ``model`` holds no decoder layer. The first call of a region compiles it (once per class and input
    shape; a second sequence length compiles once more with dynamic shapes); :func:`remove_compiled_layers` makes
    them run eagerly again.
    """
    remove_compiled_layers(model)
    regions = []
    for hf_model in outermost_models(model):
        ledger = Ledger()
        for name, layer in decoder_layers(hf_model):
            for suffix, region in compiled_regions(layer):
                ledger.set(name + suffix, region, "forward", torch.compile(region.forward, **compile_options))
                regions.append((name + suffix, region))
        ledger.set("compile", hf_model, COMPILE_ATTRIBUTE, ledger)
    if not regions:
        raise ValueError(
            "compile_layers compiles the decoder layers of transformers models (GradientCheckpointingLayer), and "
            "this LightningModule holds none: set compile_layers=False, or call torch.compile on your own blocks."
        )
    return OptionReport("compile_layers", f"{summarize(regions)} compiled (torch.compile, one region each)")


def remove_compiled_layers(model: nn.Module) -> None:
    """Undo :func:`compile_decoder_layers` on every module inside ``model``."""
    for sub in model.modules():
        ledger = sub.__dict__.get(COMPILE_ATTRIBUTE)
        if ledger is not None:
            ledger.undo()
