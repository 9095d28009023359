"""The collectives of Ulysses attention: the differentiable all-to-alls (reported to an SP group's observer), the
sequence gather (in the zigzag order of a ring when the group is a
:class:`~lightning_ulysses.groups.SequenceParallelGroups` with one) and the ring's point-to-point exchange."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_ulysses.groups import CollectiveObserver, SequenceParallelGroup, process_group, ring_size_of
from lightning_ulysses.sharding import zigzag_order


def all_to_all(
    x: Tensor, group: ProcessGroup | None, scatter_dim: int, gather_dim: int, observer: CollectiveObserver | None = None
) -> Tensor:
    """Split ``x`` into ``P`` chunks along ``scatter_dim``, send chunk ``j`` to rank ``j`` of ``group`` (``None``: the
    default group), and concatenate the received chunks (in rank order) along ``gather_dim``. Not differentiable.
    The call runs inside ``observer.all_to_all`` while one is set (a measurement, see
    :class:`~lightning_ulysses.groups.CollectiveObserver`)."""
    if observer is not None and observer.all_to_all is not None:
        return observer.all_to_all(functools.partial(_exchange, x, group, scatter_dim, gather_dim))
    return _exchange(x, group, scatter_dim, gather_dim)


def _exchange(x: Tensor, group: ProcessGroup | None, scatter_dim: int, gather_dim: int) -> Tensor:
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
    def forward(
        ctx: Any,
        x: Tensor,
        group: ProcessGroup | None,
        scatter_dim: int,
        gather_dim: int,
        observer: CollectiveObserver | None,
    ) -> Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim, ctx.observer = group, scatter_dim, gather_dim, observer
        return all_to_all(x.contiguous(), group, scatter_dim, gather_dim, observer)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        grad = all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim, ctx.observer)
        return grad, None, None, None, None


def sequence_to_heads(x: Tensor, group: ProcessGroup | None, observer: CollectiveObserver | None = None) -> Tensor:
    """``[B, N/P, H, D] -> [B, N, H/P, D]``: gather the sequence, scatter the heads (forward and backward reported to
    ``observer``)."""
    return _AllToAll.apply(x, group, 2, 1, observer)


def heads_to_sequence(x: Tensor, group: ProcessGroup | None, observer: CollectiveObserver | None = None) -> Tensor:
    """``[B, N, H/P, D] -> [B, N/P, H, D]``: gather the heads, scatter the sequence (forward and backward reported to
    ``observer``)."""
    return _AllToAll.apply(x, group, 1, 2, observer)


def gather_from_ranks(x: Tensor, group: ProcessGroup | None) -> list[Tensor]:
    """``x`` of every rank of ``group`` (``None``: the default group), in rank order. Not differentiable."""
    x = x.contiguous()
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, x, group=group)
    return gathered


def gather_sequence(local: Tensor, group: SequenceParallelGroup) -> Tensor:
    """``[B, N/P, ...]`` shards of ``group`` -> ``[B, N, ...]`` in sequence order on every rank of it
    (the inverse of :func:`~lightning_ulysses.shard_batch` for one tensor, zigzag order included when ``group`` is a
    :class:`~lightning_ulysses.groups.SequenceParallelGroups` with a ring; not differentiable)."""
    sp_group = process_group(group)
    if sp_group is None or dist.get_world_size(sp_group) == 1:
        return local
    return to_sequence_order(torch.cat(gather_from_ranks(local, sp_group), dim=1), group)


def to_sequence_order(x: Tensor, group: SequenceParallelGroup, dim: int = 1) -> Tensor:
    """The whole sequence ``x`` with its ``N`` tokens along ``dim`` as the shards of ``group`` concatenated in rank
    order (what an all-gather or :func:`sequence_to_heads` over its SP group yields) -> in sequence order: the zigzag
    order undone under Ulysses x Ring, ``x`` itself otherwise. Differentiable."""
    ring_size = ring_size_of(group)
    if ring_size == 1:
        return x
    order = zigzag_order(x.shape[dim], ring_size, x.device)
    return torch.empty_like(x).index_copy(dim, order, x)


def to_shard_order(x: Tensor, group: SequenceParallelGroup, dim: int = 1) -> Tensor:
    """The inverse of :func:`to_sequence_order`: a whole sequence in sequence order -> the shards of ``group``
    concatenated in rank order (as :func:`heads_to_sequence` over its SP group cuts it). Differentiable."""
    ring_size = ring_size_of(group)
    if ring_size == 1:
        return x
    return x.index_select(dim, zigzag_order(x.shape[dim], ring_size, x.device))


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
