"""The collectives of Ulysses attention: the differentiable all-to-alls (reported to an SP group's observer), the
sequence gather (in the zigzag order of a ring when the group is a
:class:`~lightning_ulysses.groups.SequenceParallelGroups` has one) and the ring's point-to-point exchange."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_ulysses.groups import CollectiveObserver, SequenceParallelGroupLike, SequenceParallelGroups
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
    if scatter_dim == gather_dim == 0:  # blocks already rank-major: sent as they lie
        receive = torch.empty_like(x)
        dist.all_to_all_single(receive, x.contiguous(), group=group)
        return receive
    send = torch.stack(x.tensor_split(world, dim=scatter_dim))
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send, group=group)
    return torch.cat(receive.unbind(0), dim=gather_dim)


class Exchange:
    """One all-to-all of a ``[P, ...]`` buffer over ``group`` (block ``r`` to / from rank ``r``), started at once;
    :meth:`take` waits for it and hands over the received ``[P, ...]`` buffer (the exchange keeps no reference to it).

    Unobserved, it runs ``async_op`` (on CUDA, NCCL's own stream, ordered after the work already queued on the compute
    stream, its buffers kept alive until the wait), so the caller overlaps it with compute. While ``observer`` has an
    ``all_to_all`` set it runs through :func:`all_to_all`, there and then, so the observer sees (and times) it."""

    def __init__(self, send: Tensor, group: ProcessGroup, observer: CollectiveObserver | None = None) -> None:
        self.work: Any = None
        if observer is not None and observer.all_to_all is not None:
            self.receive: Tensor | None = all_to_all(send, group, 0, 0, observer)
            return
        self.receive = torch.empty_like(send)
        self.work = dist.all_to_all_single(self.receive, send, group=group, async_op=True)

    def take(self) -> Tensor:
        assert self.receive is not None, "taken twice"
        if self.work is not None:
            self.work.wait()  # CUDA: the compute stream waits for NCCL's (an event), the host does not
        # the work holds the send buffer (NCCL reads it until the wait): dropped with it
        receive, self.receive, self.work = self.receive, None, None
        return receive


def by_rank(tensors: Sequence[Tensor], world: int) -> Tensor:
    """Sequence-sharded ``[B, n, P * h_i, d_i]`` -> the send buffer ``[P, B, n, sum_i h_i * d_i]``: block ``r`` holds
    the ``h_i`` heads of each tensor that rank ``r`` attends, side by side (one copy)."""
    return torch.cat([t.unflatten(2, (world, -1)).flatten(3).movedim(2, 0) for t in tensors], dim=-1)


def whole_sequence(receive: Tensor, heads: Sequence[tuple[int, int]]) -> list[Tensor]:
    """A received ``[P, B, n, F]`` buffer (block ``r``: rank ``r``'s tokens) -> the whole sequence ``[B, P * n, h, d]``
    of each ``(h, d)`` of ``heads``, views into one ``[B, N, F]`` tensor (``receive`` itself when ``B == 1``)."""
    whole = receive.movedim(0, 1).flatten(1, 2)
    parts = whole.split([h * d for h, d in heads], dim=-1)
    return [p.unflatten(-1, shape) for p, shape in zip(parts, heads, strict=True)]


def by_sequence(tensors: Sequence[Tensor], world: int) -> Tensor:
    """Whole-sequence ``[B, N, h_i, d_i]`` -> the send buffer ``[P, B, N/P, sum_i h_i * d_i]``: block ``r`` holds rank
    ``r``'s tokens of each (one copy)."""
    return torch.cat([t.flatten(2).unflatten(1, (world, -1)).movedim(1, 0) for t in tensors], dim=-1)


def rank_slots(receive: Tensor, heads: Sequence[tuple[int, int]]) -> list[Tensor]:
    """A received ``[P, B, n, F]`` buffer of whole-sequence results (block ``r``: rank ``r``'s heads) -> this rank's
    tokens of every rank's heads ``[B, n, P * h, d]`` per ``(h, d)`` of ``heads``, rank-major."""
    parts = receive.split([h * d for h, d in heads], dim=-1)
    return [p.unflatten(-1, shape).movedim(0, 2).flatten(2, 3) for p, shape in zip(parts, heads, strict=True)]


class _SequenceToHeads(torch.autograd.Function):
    """``[B, N/P, P * h_i, d_i]`` each -> ``[B, N, h_i, d_i]`` each in one all-to-all; the gradients go back in one."""

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup | None, observer: CollectiveObserver | None, *tensors: Tensor) -> Any:
        world = dist.get_world_size(group)
        ctx.group, ctx.observer, ctx.world = group, observer, world
        ctx.heads = [(t.shape[2] // world, t.shape[3]) for t in tensors]
        receive = all_to_all(by_rank(tensors, world), group, 0, 0, observer)
        return tuple(whole_sequence(receive, ctx.heads))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        receive = all_to_all(by_sequence(grads, ctx.world), ctx.group, 0, 0, ctx.observer)
        return (None, None, *rank_slots(receive, ctx.heads))


class _HeadsToSequence(torch.autograd.Function):
    """``[B, N, h, d] -> [B, N/P, P * h, d]`` in one all-to-all; the gradient goes back in one."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None, observer: CollectiveObserver | None) -> Tensor:
        world = dist.get_world_size(group)
        ctx.group, ctx.observer, ctx.world = group, observer, world
        (out,) = rank_slots(all_to_all(by_sequence([x], world), group, 0, 0, observer), [(x.shape[2], x.shape[3])])
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        heads = [(grad.shape[2] // ctx.world, grad.shape[3])]
        (whole,) = whole_sequence(all_to_all(by_rank([grad], ctx.world), ctx.group, 0, 0, ctx.observer), heads)
        return whole, None, None


def sequence_to_heads(
    *tensors: Tensor, group: ProcessGroup | None, observer: CollectiveObserver | None = None
) -> tuple[Tensor, ...]:
    """``[B, N/P, H_i, D_i] -> [B, N, H_i/P, D_i]`` for each tensor, all in one all-to-all (query, key and value
    together): gather the sequence, scatter the heads; the backward sends their gradients back in one (both reported
    to ``observer``)."""
    return _SequenceToHeads.apply(group, observer, *tensors)


def heads_to_sequence(x: Tensor, group: ProcessGroup | None, observer: CollectiveObserver | None = None) -> Tensor:
    """``[B, N, H/P, D] -> [B, N/P, H, D]``: gather the heads, scatter the sequence (forward and backward reported to
    ``observer``)."""
    return _HeadsToSequence.apply(x, group, observer)


def gather_from_ranks(x: Tensor, group: ProcessGroup | None) -> list[Tensor]:
    """``x`` of every rank of ``group`` (``None``: the default group), in rank order. Not differentiable."""
    x = x.contiguous()
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, x, group=group)
    return gathered


def gather_sequence(local: Tensor, group: SequenceParallelGroupLike) -> Tensor:
    """``[B, N/P, ...]`` shards of ``group`` -> ``[B, N, ...]`` in sequence order on every rank of it
    (the inverse of :func:`~lightning_ulysses.sharding.shard_batch` for one tensor, zigzag order included when
    ``group`` has a ring; not differentiable). ``group``: the strategy's
    :class:`~lightning_ulysses.groups.SequenceParallelGroups` or what
    :meth:`~lightning_ulysses.groups.SequenceParallelGroups.of` takes."""
    groups = SequenceParallelGroups.of(group)
    if groups.sp is None or groups.topology.sp_size == 1:
        return local
    return to_sequence_order(torch.cat(gather_from_ranks(local, groups.sp), dim=1), groups)


def to_sequence_order(x: Tensor, group: SequenceParallelGroups, dim: int = 1) -> Tensor:
    """The whole sequence ``x`` with its ``N`` tokens along ``dim`` as the shards of ``group`` concatenated in rank
    order (what an all-gather or :func:`sequence_to_heads` over its SP group yields) -> in sequence order: the zigzag
    order undone under Ulysses x Ring, ``x`` itself otherwise. Differentiable."""
    ring_size = group.ring_size
    if ring_size == 1:
        return x
    order = zigzag_order(x.shape[dim], ring_size, x.device)
    return torch.empty_like(x).index_copy(dim, order, x)


def to_shard_order(x: Tensor, group: SequenceParallelGroups, dim: int = 1) -> Tensor:
    """The inverse of :func:`to_sequence_order`: a whole sequence in sequence order -> the shards of ``group``
    concatenated in rank order (as :func:`heads_to_sequence` over its SP group cuts it). Differentiable."""
    ring_size = group.ring_size
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
