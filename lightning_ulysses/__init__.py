"""Ulysses sequence parallelism for PyTorch Lightning."""

from lightning_ulysses.attention import ulysses_attention
from lightning_ulysses.callbacks import SequenceParallelMonitor, SequenceParallelParityCheck
from lightning_ulysses.compile import compile_decoder_layers, remove_compiled_layers
from lightning_ulysses.data import LongTextDataModule, byte_tokenizer
from lightning_ulysses.finetune import DPO, PreferenceDataModule, SFTDataModule
from lightning_ulysses.flops import TransformerFlops, dense_peak_flops
from lightning_ulysses.fsdp_strategy import UlyssesFSDPStrategy
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.heads import HeadLayout, plan_heads
from lightning_ulysses.hf import (
    UnsupportedModelError,
    apply_ulysses_attention,
    remove_ulysses_attention,
    sequence_parallel_disabled,
)
from lightning_ulysses.hf.check.logits import tiled_logit_map
from lightning_ulysses.liger import apply_liger_kernels, liger_loss_sum, remove_liger_kernels
from lightning_ulysses.logits import LogitMap, TiledLogits, tiled_cross_entropy_sum
from lightning_ulysses.loss import UlyssesLossMixin, token_cross_entropy
from lightning_ulysses.memory import (
    MemoryOptions,
    apply_memory_options,
    checkpoint_activations,
    remove_memory_options,
    tiled_map,
)
from lightning_ulysses.metrics import Perplexity, TokenAccuracy, TokenCrossEntropy
from lightning_ulysses.model import CausalLM, WarmupCosine
from lightning_ulysses.model_checkpoint import ModelCheckpoint
from lightning_ulysses.norms import layer_norm, rms_norm
from lightning_ulysses.offload import ActivationOffload
from lightning_ulysses.prediction import PredictionWriter, gather_sequence, token_log_probs
from lightning_ulysses.runtime import (
    CheckpointSaveError,
    CorruptCheckpointError,
    check_integrity,
    check_resumable,
    convert_checkpoint,
    export_hf_model,
    is_universal_checkpoint,
)
from lightning_ulysses.sequence_parallel import SequenceParallelMixin
from lightning_ulysses.sharding import IGNORE_INDEX, prepare_batch, shard_batch
from lightning_ulysses.strategy import UlyssesStrategy
from lightning_ulysses.topology import SequenceParallelTopology
from lightning_ulysses.vision import VisionLanguageModel

__all__ = [
    "ActivationOffload",
    "IGNORE_INDEX",
    "CausalLM",
    "CheckpointSaveError",
    "CorruptCheckpointError",
    "DPO",
    "HeadLayout",
    "LogitMap",
    "LongTextDataModule",
    "MemoryOptions",
    "ModelCheckpoint",
    "Perplexity",
    "PredictionWriter",
    "PreferenceDataModule",
    "SFTDataModule",
    "SequenceParallelMonitor",
    "SequenceParallelGroups",
    "SequenceParallelParityCheck",
    "SequenceParallelTopology",
    "TiledLogits",
    "TokenAccuracy",
    "TokenCrossEntropy",
    "TransformerFlops",
    "UlyssesLossMixin",
    "UlyssesFSDPStrategy",
    "UlyssesStrategy",
    "SequenceParallelMixin",
    "VisionLanguageModel",
    "UnsupportedModelError",
    "WarmupCosine",
    "apply_liger_kernels",
    "apply_memory_options",
    "apply_ulysses_attention",
    "byte_tokenizer",
    "check_integrity",
    "check_resumable",
    "checkpoint_activations",
    "compile_decoder_layers",
    "convert_checkpoint",
    "dense_peak_flops",
    "export_hf_model",
    "gather_sequence",
    "is_universal_checkpoint",
    "liger_loss_sum",
    "plan_heads",
    "prepare_batch",
    "remove_compiled_layers",
    "remove_liger_kernels",
    "remove_memory_options",
    "remove_ulysses_attention",
    "layer_norm",
    "rms_norm",
    "sequence_parallel_disabled",
    "shard_batch",
    "tiled_cross_entropy_sum",
    "tiled_logit_map",
    "tiled_map",
    "token_cross_entropy",
    "token_log_probs",
    "ulysses_attention",
]
