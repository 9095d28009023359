"""A step that runs out of memory: one line that says what would make the sequence fit.

torch reports a failed allocation as ``torch.OutOfMemoryError`` on CUDA and as a ``RuntimeError`` of the CPU allocator
(``DefaultCPUAllocator: can't allocate memory``), several hundred lines of traceback on every rank. The strategy's
exception path (:meth:`~lightning_ulysses.UlyssesStrategy.on_exception`) adds :func:`out_of_memory_advice` on rank 0,
and the original exception is raised as it was.

Where the LightningModule holds one transformers model whose config states a decoder's sizes, the line also carries
an estimate for the failing training batch's tokens per rank: the activation memory per rank now, with the options it
suggests turned on, and with them at the next larger ``sp_size``. It is :mod:`lightning_ulysses.memory.estimate`'s
analytic model of what grows with the tokens (activations in the weights' dtype, the fp32 logits and loss), not a
measurement: weights, their gradients and the optimizer states (whatever ZeRO stage partitions them), per-tile and
all-to-all buffers are not counted, and ``head_chunks`` (which lowers the all-to-all buffers) does not change it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from lightning_ulysses.hf.state import outermost_models
from lightning_ulysses.memory import MemoryOptions
from lightning_ulysses.memory.estimate import DecoderShape, peak_bytes_per_token
from lightning_ulysses.sharding import padded_length, shard_multiple
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


@dataclass(frozen=True)
class StepShape:
    """What the estimate reads of the failing step: the decoder's sizes and the training batch that it sharded."""

    decoder: DecoderShape
    element_bytes: int
    """Bytes of an activation element: the weights' dtype (DeepSpeed runs the module in its bf16 / fp16 dtype)."""
    batch_size: int
    seq_len: int
    """Tokens of each whole sequence of the batch, before the padding to a multiple of the shards."""
    ring_size: int = 1

    def tokens_per_rank(self, sp_size: int) -> int:
        """``B * N' / sp_size`` with ``N'`` the sequence padded as :func:`~lightning_ulysses.sharding.prepare_batch`
        pads it for ``sp_size``."""
        return self.batch_size * padded_length(self.seq_len, shard_multiple(sp_size, self.ring_size)) // sp_size

    @classmethod
    def read(cls, module: nn.Module, batch_shape: tuple[int, int] | None, ring_size: int = 1) -> StepShape | None:
        """The shape of the step of ``module`` (a LightningModule) on a ``[B, N]`` batch, or ``None`` without a batch,
        without exactly one outermost transformers model, or where its config states no decoder sizes."""
        models = outermost_models(module)
        if batch_shape is None or len(models) != 1:
            return None
        decoder = DecoderShape.from_config(models[0].config)
        dtype = next((p.dtype for p in models[0].parameters() if p.is_floating_point()), None)
        if decoder is None or dtype is None:
            return None
        return cls(decoder, dtype.itemsize, batch_shape[0], batch_shape[1], ring_size)


def out_of_memory_advice(
    error: BaseException,
    memory: MemoryOptions,
    head_chunks: object,
    sp_size: int,
    world_size: int,
    on_cuda: bool,
    step: StepShape | None = None,
) -> str:
    """One line: the allocation that failed, the estimated activation memory per rank of ``step`` (if given) now and
    with the options it names, and the options of :class:`~lightning_ulysses.UlyssesStrategy` that are off and would
    lower the peak (each rank holds ``seq_len / sp_size`` tokens)."""
    offload_off = not memory.offload_activations and on_cuda  # on CPU there is nowhere to move
    memory_options = [
        name
        for name, on in (
            ("tiled_mlp", memory.tiled_mlp),
            ("tiled_loss", memory.tiled_loss),
            ("activation_checkpointing", memory.activation_checkpointing),
            ("offload_activations", not offload_off),
        )
        if not on
    ]
    options = [f"{name}=True" for name in memory_options]
    if head_chunks is None:
        options.append("head_chunks='auto'")
    larger = [size for size in divisors(world_size) if size > sp_size]
    more_ranks = f"a larger sp_size (one of {larger})" if larger else "more processes and a larger sp_size"
    turn_on = f"turn on UlyssesStrategy({', '.join(options)}), " if options else ""
    estimate = "" if step is None else _estimate(step, memory, on_cuda, memory_options, sp_size, larger[:1])
    return (
        f"lightning-ulysses: out of memory{_requested(str(error))} at sp_size={sp_size} (each rank holds 1/{sp_size} "
        f"of every sequence){estimate}. To fit the sequence, {turn_on}use {more_ranks}, or shorten it; docs/memory.md "
        "gives the peak per token under each option (python -m benchmarks.memory_model estimates it for a model's "
        "shape)."
    )


def _estimate(
    step: StepShape, memory: MemoryOptions, on_cuda: bool, turned_on: list[str], sp_size: int, next_sp: list[int]
) -> str:
    """``; estimated activations per rank at T tokens: X now, Y with <turned_on>, Z at sp_size=S`` (the last two
    where there is something to turn on and a larger ``sp_size``)."""
    now = {
        "tiled_mlp": bool(memory.tiled_mlp),
        "tiled_loss": bool(memory.tiled_loss),
        "checkpointing": memory.activation_checkpointing,
        "offload": memory.offload_activations and on_cuda,
    }
    suggested = dict(tiled_mlp=True, tiled_loss=True, checkpointing=True, offload=on_cuda)
    per_token_now = peak_bytes_per_token(step.decoder, step.element_bytes, **now)
    per_token = peak_bytes_per_token(step.decoder, step.element_bytes, **suggested)
    tokens = step.tokens_per_rank(sp_size)
    parts = [f"{_bytes(per_token_now * tokens)} now"]
    if turned_on:
        parts.append(f"{_bytes(per_token * tokens)} with {', '.join(turned_on)}")
    parts += [f"{_bytes(per_token * step.tokens_per_rank(size))} at sp_size={size}" for size in next_sp]
    return (
        f"; estimated activations per rank at {tokens:,} tokens (weights, gradients and optimizer states not "
        f"counted): {', '.join(parts)}"
    )


def _bytes(size: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size / 2**10:.1f} KiB"


def _requested(message: str) -> str:
    if match := _CPU_REQUEST.search(message):
        return f" (an allocation of {int(match.group(1)) / 2**30:.2f} GiB failed)"
    if match := _CUDA_REQUEST.search(message):
        return f" (an allocation of {match.group(1)} failed)"
    return ""
