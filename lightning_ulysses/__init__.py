"""Ulysses sequence parallelism for PyTorch Lightning."""

from lightning_ulysses.attention import ulysses_attention
from lightning_ulysses.callbacks import SequenceParallelMonitor, SequenceParallelParityCheck
from lightning_ulysses.data import ByteTokenizer, LongTextDataModule
from lightning_ulysses.flops import TransformerFlops
from lightning_ulysses.loss import UlyssesLossMixin
from lightning_ulysses.model import CausalLM
from lightning_ulysses.patching import apply_ulysses_attention, remove_ulysses_attention, sequence_parallel_disabled
from lightning_ulysses.sharding import IGNORE_INDEX, prepare_batch, shard_batch
from lightning_ulysses.strategy import UlyssesStrategy
from lightning_ulysses.topology import SequenceParallelTopology

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "CausalLM",
    "LongTextDataModule",
    "SequenceParallelMonitor",
    "SequenceParallelParityCheck",
    "SequenceParallelTopology",
    "TransformerFlops",
    "UlyssesLossMixin",
    "UlyssesStrategy",
    "apply_ulysses_attention",
    "prepare_batch",
    "remove_ulysses_attention",
    "sequence_parallel_disabled",
    "shard_batch",
    "ulysses_attention",
]
