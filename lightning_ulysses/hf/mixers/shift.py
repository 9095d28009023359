"""Token shifts across sequence shards: a halo of ``k`` tokens from the rank that holds them.

A token shift (RWKV's ``time_shift``, ZAYA's delayed value heads) reads the token ``k`` places earlier:
``y[t] = x[t - k]``, a fill value where ``t - k`` lies before the row's or the document's start. On a sequence
shard only the first ``k`` tokens of each contiguous piece need another rank's tokens, so the shift needs no
all-to-all: every rank all-gathers the last ``k`` tokens of each of its pieces (``P x pieces x k`` tokens, each of
``C`` channels), takes its halo from the rank holding the tokens just before each piece, and shifts locally::

    x [B, N/P, C] (this rank's shard)  --all-gather of each piece's last k tokens-->  halo [P, B, pieces * k, C]
    y [B, N/P, C] = per piece: cat(halo of the piece before it, piece[:-k]), the fill where the source lies before
                    the row start or a document start

Differentiable: the halo's gradient goes back to its owner (an all-to-all, summed there). Exact under Ulysses x Ring,
whose shards hold two chunks of the sequence (:func:`~lightning_ulysses.sharding.zigzag_order`): each chunk is a
piece of its own. Packed documents (:class:`~lightning_ulysses.attention.Documents`, read from the position ids
before the first layer) start afresh: a token whose source lies in an earlier document gets the fill. The pieces and
their halo sources follow from ``(N, P, ring_size)`` alone (integer arithmetic on the host, no host sync).

:func:`is_sequence_shift` recognises a module that shifts the sequence dimension by constant padding
(``nn.ZeroPad2d((0, 0, k, -k))`` on ``[B, N, C]``, RWKV's ``time_shift``), whose forward
:func:`sharded_shift_forward` replaces under sequence parallelism.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_ulysses.attention import Documents
from lightning_ulysses.attention.collectives import all_to_all, gather_from_ranks
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.sharding import zigzag_order

Piece = tuple[int, int, int]
"""A contiguous run of a shard: ``(first local index, first whole-sequence column, length)``."""


@functools.lru_cache(maxsize=64)
def shard_pieces(seq_len: int, sp_size: int, ring_size: int) -> tuple[tuple[Piece, ...], ...]:
    """The contiguous pieces of every SP rank's shard, in shard order (one per rank for plain Ulysses; a shard
    spanning the two zigzag chunks of a ring rank has two)."""
    local, chunk = seq_len // sp_size, seq_len // (2 * ring_size)

    def column(position: int) -> int:  # the whole-sequence column at ``position`` of the shard order
        index, offset = divmod(position, chunk)
        ring_rank, second = divmod(index, 2)
        return (2 * ring_size - 1 - ring_rank if second else ring_rank) * chunk + offset

    shards = []
    for rank in range(sp_size):
        pieces: list[list[int]] = []
        position, end = rank * local, (rank + 1) * local
        while position < end:  # cut at the chunk borders, contiguous runs merged
            start, length = column(position), min(chunk - position % chunk, end - position)
            if pieces and pieces[-1][1] + pieces[-1][2] == start:
                pieces[-1][2] += length
            else:
                pieces.append([position - rank * local, start, length])
            position += length
        shards.append(tuple((a, b, c) for a, b, c in pieces))
    return tuple(shards)


def all_gather(x: Tensor, group: ProcessGroup) -> Tensor:
    """``x`` of every rank of ``group``, stacked in rank order: ``[P, *x.shape]``. Not differentiable. (A name of this
    module's own, which ``benchmarks.mixer_cost`` counts.)"""
    return torch.stack(gather_from_ranks(x, group))


class _GatherTails(torch.autograd.Function):
    """All-gather ``[B, T, ...]`` from every rank of ``group`` -> ``[P, B, T, ...]``; the gradient of each rank's part
    goes back to it, summed over the ranks that read it."""

    @staticmethod
    def forward(ctx: Any, tails: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return all_gather(tails, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_to_all(grad.contiguous(), ctx.group, 0, 0).sum(0), None


def shift_sequence(
    x: Tensor, shift: int, group: SequenceParallelGroups, documents: Documents | None, fill: float | Tensor = 0.0
) -> Tensor:
    """``x [B, N/P, ...]``, this rank's shard of ``group`` -> the shard of the whole sequence shifted ``shift`` tokens
    later: ``y[t] = x[t - shift]`` in whole-sequence order, ``fill`` (a scalar, or a tensor broadcasting against
    ``x``'s per-token shape) where ``t - shift`` lies before the row's start or, with packed ``documents``, before
    the start of ``t``'s document. Collective over ``group``; differentiable (``fill`` included)."""
    ring_size, sp_group = group.ring_size, group.sp
    rank, sp_size = dist.get_rank(sp_group), dist.get_world_size(sp_group)
    local = x.shape[1]
    seq_len = local * sp_size
    shards = shard_pieces(seq_len, sp_size, ring_size)
    shortest = min(length for pieces in shards for _, _, length in pieces)
    if not 0 < shift <= shortest:
        raise ValueError(
            f"A token shift by {shift} under sequence parallelism needs shards of at least {shift} contiguous tokens "
            f"(the shortest here has {shortest}, sequence length {seq_len} over sp_size={sp_size}, "
            f"ring_size={ring_size}): use longer sequences or a smaller sp_size."
        )
    slots = max(len(pieces) for pieces in shards)
    tails = [x[:, start + length - shift : start + length] for start, _, length in shards[rank]]
    tails += [tails[0]] * (slots - len(tails))  # equal shapes on every rank; the copies are never read
    halo = _GatherTails.apply(torch.cat(tails, dim=1), sp_group)  # [P, B, slots * shift, ...]
    ends = {
        column + length: (owner, slot)
        for owner, pieces in enumerate(shards)
        for slot, (_, column, length) in enumerate(pieces)
    }
    shifted = []
    for start, column, length in shards[rank]:
        # the row's first tokens read any halo slot, replaced by the fill below: every rank reads the halo, so
        # every rank's backward takes part in its gradient's all-to-all
        owner, slot = ends.get(column, (rank, 0))
        shifted.append(halo[owner, :, slot * shift : (slot + 1) * shift])
        shifted.append(x[:, start : start + length - shift])
    y = torch.cat(shifted, dim=1)
    keep = _same_document(seq_len, shift, rank, sp_size, ring_size, documents, x.device)  # [B or 1, N/P]
    keep = keep.view(*keep.shape, *([1] * (x.dim() - 2)))
    return torch.where(keep, y, fill.to(y.dtype) if isinstance(fill, Tensor) else fill)


def _same_document(
    seq_len: int,
    shift: int,
    rank: int,
    sp_size: int,
    ring_size: int,
    documents: Documents | None,
    device: torch.device,
) -> Tensor:
    """``[B, N/P]`` (``[1, N/P]`` without documents) bool: this rank's tokens whose source ``shift`` tokens earlier
    lies in the same row and document."""
    local = seq_len // sp_size
    columns = zigzag_order(seq_len, ring_size, device)[rank * local : (rank + 1) * local]
    keep = (columns >= shift).unsqueeze(0)
    if documents is None or documents.one_per_row:
        return keep
    document_ids = documents.document_ids
    return keep & (document_ids[:, columns] == document_ids[:, (columns - shift).clamp(min=0)])


CONSTANT_PADDINGS = (nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d)
"""The constant-padding modules (``nn.ZeroPad*d`` subclass them), torch's public names for its private
``_ConstantPadNd``."""


def sequence_shift_of(module: nn.Module) -> int | None:
    """The shift ``k`` of a constant-padding module that moves the sequence dimension of a ``[B, N, C]`` input ``k``
    tokens later (``nn.ZeroPad2d((0, 0, k, -k))``: ``k`` fill rows before the sequence, its last ``k`` dropped);
    ``None`` for any other module."""
    if not isinstance(module, CONSTANT_PADDINGS):
        return None
    padding = tuple(module.padding)
    if len(padding) != 4 or padding[:2] != (0, 0) or padding[2] <= 0 or padding[3] != -padding[2]:
        return None
    return padding[2]


def sharded_shift_forward(
    module: nn.Module,
    group: Callable[[], SequenceParallelGroups],
    documents: Callable[[], Documents | None],
    local_tokens: Callable[[], int | None],
) -> Callable[[Tensor], Tensor]:
    """The shift module's forward on this rank's ``[B, N/P, C]`` tokens (:func:`shift_sequence`, filled with the
    module's constant); any other input (not 3-D, or not ``local_tokens()`` long) runs the module's own forward."""
    shift, forward = sequence_shift_of(module), module.forward
    # hook.py shards the modules that sequence_shift_of recognises: constant-padding ones
    assert shift is not None and isinstance(module, CONSTANT_PADDINGS)

    def sharded(x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[1] != local_tokens():
            return forward(x)
        return shift_sequence(x, shift, group(), documents(), float(module.value))

    return sharded
