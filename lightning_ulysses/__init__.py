"""Ulysses sequence parallelism for PyTorch Lightning."""

from lightning_ulysses.attention import ulysses_attention
from lightning_ulysses.heads import HeadLayout, plan_heads
from lightning_ulysses.loss import UlyssesLossMixin
from lightning_ulysses.patching import apply_ulysses_attention, remove_ulysses_attention
from lightning_ulysses.sharding import IGNORE_INDEX, prepare_batch, shard_batch
from lightning_ulysses.strategy import UlyssesStrategy
from lightning_ulysses.topology import SequenceParallelTopology

__all__ = [
    "HeadLayout",
    "IGNORE_INDEX",
    "SequenceParallelTopology",
    "UlyssesLossMixin",
    "UlyssesStrategy",
    "apply_ulysses_attention",
    "plan_heads",
    "prepare_batch",
    "remove_ulysses_attention",
    "shard_batch",
    "ulysses_attention",
]
