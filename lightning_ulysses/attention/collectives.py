"""The collectives of Ulysses attention: the differentiable all-to-alls and the sequence gather."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


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
        return all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def sequence_to_heads(x: Tensor, group: ProcessGroup) -> Tensor:
    """``[B, N/P, H, D] -> [B, N, H/P, D]``: gather the sequence, scatter the heads."""
    return _AllToAll.apply(x, group, 2, 1)


def heads_to_sequence(x: Tensor, group: ProcessGroup) -> Tensor:
    """``[B, N, H/P, D] -> [B, N/P, H, D]``: gather the heads, scatter the sequence."""
    return _AllToAll.apply(x, group, 1, 2)


def gather_sequence(local: Tensor, group: ProcessGroup | None) -> Tensor:
    """``[B, N/P, ...]`` shards of ``group`` -> ``[B, N, ...]`` in sequence order on every rank of it
    (the inverse of :func:`~lightning_ulysses.shard_batch` for one tensor; not differentiable)."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    return torch.cat(shards, dim=1)
