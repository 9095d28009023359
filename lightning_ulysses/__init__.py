"""Ulysses sequence parallelism for PyTorch Lightning."""

import importlib
import warnings
from typing import Any

from lightning_ulysses.attention import ulysses_attention
from lightning_ulysses.callbacks import SequenceParallelMonitor, SequenceParallelParityCheck
from lightning_ulysses.data import LongTextDataModule
from lightning_ulysses.finetune import DPO, PreferenceDataModule, SFTDataModule
from lightning_ulysses.fsdp_strategy import UlyssesFSDPStrategy
from lightning_ulysses.loss import UlyssesLossMixin
from lightning_ulysses.model import CausalLM, WarmupCosine
from lightning_ulysses.model_checkpoint import ModelCheckpoint
from lightning_ulysses.prediction import PredictionWriter
from lightning_ulysses.strategy import UlyssesStrategy
from lightning_ulysses.vision import VisionLanguageModel

__all__ = [
    # the strategies: one per engine
    "UlyssesStrategy",
    "UlyssesFSDPStrategy",
    # LightningModules and what a custom one mixes in
    "CausalLM",
    "DPO",
    "UlyssesLossMixin",
    "VisionLanguageModel",
    "WarmupCosine",
    # data modules
    "LongTextDataModule",
    "PreferenceDataModule",
    "SFTDataModule",
    # callbacks
    "ModelCheckpoint",
    "PredictionWriter",
    "SequenceParallelMonitor",
    "SequenceParallelParityCheck",
    # attention for a model written by hand
    "ulysses_attention",
]

_MOVED = {
    "lightning_ulysses.data": ("byte_tokenizer",),
    "lightning_ulysses.flops": ("TransformerFlops", "dense_peak_flops"),
    "lightning_ulysses.groups": ("SequenceParallelGroups",),
    "lightning_ulysses.heads": ("HeadLayout", "plan_heads"),
    "lightning_ulysses.hf": (
        "UnsupportedModelError",
        "apply_ulysses_attention",
        "remove_ulysses_attention",
        "sequence_parallel_disabled",
        "tiled_logit_map",
    ),
    "lightning_ulysses.logits": ("LogitMap", "TiledLogits", "tiled_cross_entropy_sum"),
    "lightning_ulysses.loss": ("token_cross_entropy",),
    "lightning_ulysses.memory": (
        "MemoryOptions",
        "apply_memory_options",
        "checkpoint_activations",
        "remove_memory_options",
        "tiled_map",
    ),
    "lightning_ulysses.metrics": ("Perplexity", "TokenAccuracy", "TokenCrossEntropy"),
    "lightning_ulysses.norms": ("layer_norm", "rms_norm"),
    "lightning_ulysses.offload": ("ActivationOffload",),
    "lightning_ulysses.prediction": ("gather_sequence", "token_log_probs"),
    "lightning_ulysses.runtime": (
        "CheckpointSaveError",
        "CorruptCheckpointError",
        "check_integrity",
        "check_resumable",
        "convert_checkpoint",
        "export_hf_model",
        "is_universal_checkpoint",
    ),
    "lightning_ulysses.sharding": ("IGNORE_INDEX", "prepare_batch", "shard_batch"),
    "lightning_ulysses.topology": ("SequenceParallelTopology",),
}
"""Where the names this namespace exported before the API was grouped by use now live (docs/api.md): each still
resolves here, with a ``DeprecationWarning`` naming its new home."""


def __getattr__(name: str) -> Any:
    home = next((module for module, names in _MOVED.items() if name in names), None)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"lightning_ulysses.{name} moved: import it from {home} (docs/api.md).", DeprecationWarning, stacklevel=2
    )
    return getattr(importlib.import_module(home), name)
