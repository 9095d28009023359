"""A step that runs out of memory: one line that says what would make the sequence fit.

torch reports a failed allocation as ``torch.OutOfMemoryError`` on CUDA and as a ``RuntimeError`` of the CPU allocator
(``DefaultCPUAllocator: can't allocate memory``), several hundred lines of traceback on every rank. The strategy's
exception path (:meth:`~lightning_ulysses.UlyssesStrategy.on_exception`) adds :func:`out_of_memory_advice` on rank 0,
and the original exception is raised as it was.
"""

from __future__ import annotations

import re

import torch

from lightning_ulysses.memory import MemoryOptions
from lightning_ulysses.topology import divisors

_CPU_REQUEST = re.compile(r"tried to allocate (\d+) bytes")
_CUDA_REQUEST = re.compile(r"Tried to allocate ([\d.]+ [KMGTP]?i?B)")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a failed allocation of torch's CUDA or CPU allocator."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, torch.OutOfMemoryError) or (
            isinstance(cause, RuntimeError) and "can't allocate memory" in str(cause)
        ):
            return True
        cause = cause.__cause__
    return False


def out_of_memory_advice(
    error: BaseException, memory: MemoryOptions, head_chunks: object, sp_size: int, world_size: int, on_cuda: bool
) -> str:
    """One line: the allocation that failed, and the options of :class:`~lightning_ulysses.UlyssesStrategy` that are
    off and would lower the peak (each rank holds ``seq_len / sp_size`` tokens)."""
    options = [
        f"{name}=True"
        for name, on in (
            ("tiled_mlp", memory.tiled_mlp),
            ("tiled_loss", memory.tiled_loss),
            ("activation_checkpointing", memory.activation_checkpointing),
            ("offload_activations", memory.offload_activations or not on_cuda),  # on CPU there is nowhere to move
        )
        if not on
    ]
    if head_chunks is None:
        options.append("head_chunks='auto'")
    larger = [size for size in divisors(world_size) if size > sp_size]
    more_ranks = f"a larger sp_size (one of {larger})" if larger else "more processes and a larger sp_size"
    turn_on = f"turn on UlyssesStrategy({', '.join(options)}), " if options else ""
    return (
        f"lightning-ulysses: out of memory{_requested(str(error))} at sp_size={sp_size} (each rank holds 1/{sp_size} "
        f"of every sequence). To fit the sequence, {turn_on}use {more_ranks}, or shorten it; docs/memory.md gives the "
        "peak per token under each option (python -m benchmarks.memory_model estimates it for a model's shape)."
    )


def _requested(message: str) -> str:
    if match := _CPU_REQUEST.search(message):
        return f" (an allocation of {int(match.group(1)) / 2**30:.2f} GiB failed)"
    if match := _CUDA_REQUEST.search(message):
        return f" (an allocation of {match.group(1)} failed)"
    return ""
