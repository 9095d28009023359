"""The collectives of Ulysses attention: the differentiable all-to-alls, the sequence gather, the ring layout of an
SP group and the ring's point-to-point exchange."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_ulysses.sharding import zigzag_order


def all_to_all(x: Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    """Split ``x`` into ``P`` chunks along ``scatter_dim``, send chunk ``j`` to rank ``j`` of ``group``,
    and concatenate the received chunks (in rank order) along ``gather_dim``. Not differentiable."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    send = torch.stack(x.tensor_split(world, dim=scatter_dim))
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send, group=group)
    return torch.cat(receive.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Differentiable :func:`all_to_all`: the gradient takes the inverse all-to-all back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return all_to_all(x.contiguous(), group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def sequence_to_heads(x: Tensor, group: ProcessGroup) -> Tensor:
    """``[B, N/P, H, D] -> [B, N, H/P, D]``: gather the sequence, scatter the heads."""
    return _AllToAll.apply(x, group, 2, 1)


def heads_to_sequence(x: Tensor, group: ProcessGroup) -> Tensor:
    """``[B, N, H/P, D] -> [B, N/P, H, D]``: gather the heads, scatter the sequence."""
    return _AllToAll.apply(x, group, 1, 2)


@dataclass(frozen=True)
class RingLayout:
    """How an SP group of ``sp = ring_size x ulysses_size`` ranks runs Ulysses x Ring (see
    :mod:`lightning_ulysses.topology`): this rank's Ulysses group (all-to-alls) and ring group (K/V blocks)."""

    ring_size: int
    ulysses_group: ProcessGroup
    ring_group: ProcessGroup


_RING_LAYOUTS: dict[ProcessGroup, RingLayout] = {}


def set_ring_layout(sp_group: ProcessGroup, layout: RingLayout | None) -> None:
    """Declare (``None``: remove) that the shards of ``sp_group`` are laid out for Ulysses x Ring. Every function
    that takes the SP group (the attention, :func:`gather_sequence`) then follows the zigzag shard order."""
    if layout is None:
        _RING_LAYOUTS.pop(sp_group, None)
    else:
        _RING_LAYOUTS[sp_group] = layout


def ring_layout(group: ProcessGroup | None) -> RingLayout | None:
    """The :class:`RingLayout` declared for the SP group ``group``; ``None`` for plain Ulysses."""
    return None if group is None else _RING_LAYOUTS.get(group)


def gather_from_ranks(x: Tensor, group: ProcessGroup | None) -> list[Tensor]:
    """``x`` of every rank of ``group`` (``None``: the default group), in rank order. Not differentiable."""
    x = x.contiguous()
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, x, group=group)
    return gathered


def gather_sequence(local: Tensor, group: ProcessGroup | None) -> Tensor:
    """``[B, N/P, ...]`` shards of ``group`` -> ``[B, N, ...]`` in sequence order on every rank of it
    (the inverse of :func:`~lightning_ulysses.shard_batch` for one tensor, zigzag order included; not
    differentiable)."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    return to_sequence_order(torch.cat(gather_from_ranks(local, group), dim=1), group)


def to_sequence_order(x: Tensor, group: ProcessGroup | None, dim: int = 1) -> Tensor:
    """The whole sequence ``x`` with its ``N`` tokens along ``dim`` as the shards of ``group`` concatenated in rank
    order (what an all-gather or :func:`sequence_to_heads` over ``group`` yields) -> in sequence order: the zigzag
    order undone under Ulysses x Ring, ``x`` itself otherwise. Differentiable."""
    layout = ring_layout(group)
    if layout is None:
        return x
    order = zigzag_order(x.shape[dim], layout.ring_size, x.device)
    return torch.empty_like(x).index_copy(dim, order, x)


def to_shard_order(x: Tensor, group: ProcessGroup | None, dim: int = 1) -> Tensor:
    """The inverse of :func:`to_sequence_order`: a whole sequence in sequence order -> the shards of ``group``
    concatenated in rank order (as :func:`heads_to_sequence` over ``group`` cuts it). Differentiable."""
    layout = ring_layout(group)
    if layout is None:
        return x
    return x.index_select(dim, zigzag_order(x.shape[dim], layout.ring_size, x.device))


def ring_exchange(tensors: list[Tensor], group: ProcessGroup) -> tuple[list[Tensor], list[dist.Work]]:
    """Start sending ``tensors`` to the next rank of the ring ``group`` and receiving the previous rank's
    (same shapes); returns the receive buffers and the requests to ``wait()`` on before reading them."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    send_to = dist.get_global_rank(group, (rank + 1) % size)
    receive_from = dist.get_global_rank(group, (rank - 1) % size)
    tensors = [t.contiguous() for t in tensors]  # gloo sends and receives contiguous buffers only
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, receive_from, group) for r in received]
    return received, dist.batch_isend_irecv(ops)
