"""Ulysses sequence parallelism for PyTorch Lightning."""

from lightning_ulysses.attention import ulysses_attention
from lightning_ulysses.loss import UlyssesLossMixin
from lightning_ulysses.memory import (
    MemoryOptions,
    apply_memory_options,
    checkpoint_activations,
    remove_memory_options,
    tiled_cross_entropy_sum,
    tiled_map,
)
from lightning_ulysses.patching import apply_ulysses_attention, remove_ulysses_attention
from lightning_ulysses.sharding import IGNORE_INDEX, prepare_batch, shard_batch
from lightning_ulysses.strategy import UlyssesStrategy
from lightning_ulysses.topology import SequenceParallelTopology

__all__ = [
    "IGNORE_INDEX",
    "MemoryOptions",
    "SequenceParallelTopology",
    "UlyssesLossMixin",
    "UlyssesStrategy",
    "apply_memory_options",
    "apply_ulysses_attention",
    "checkpoint_activations",
    "prepare_batch",
    "remove_memory_options",
    "remove_ulysses_attention",
    "shard_batch",
    "tiled_cross_entropy_sum",
    "tiled_map",
    "ulysses_attention",
]
