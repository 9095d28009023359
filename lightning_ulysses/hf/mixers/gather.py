"""Token mixers other than attention, run exactly by gathering the whole sequence (an opt-in fallback).

A convolution over the sequence, a linear-attention, recurrent or state-space layer needs the tokens
before this rank's shard. :func:`gather_whole_sequence` makes such a module exact without knowing
what it computes: every rank all-gathers the module's per-token inputs along the sequence, runs the
module on the whole sequence and keeps its own shard of the outputs (under Ulysses x Ring, whose shards are zigzag,
the gathered sequence is put in sequence order and each rank keeps its zigzag shard)::

    x [B, N/sp, C] --all-gather--> [B, N, C] --module--> [B, N, C'] --keep this rank's rows--> [B, N/sp, C']

The inputs are found by parameter name (:func:`~lightning_ulysses.hf.plan.argument_keys`), however the caller passes
them: the set-up check sees a model call its decoder with ``input_ids`` by position, the tiled loss calls the decoder
by itself with them by name. A gathered model called by itself has its inputs gathered before its patched forward
reads the batch (:mod:`lightning_ulysses.hf.forward`), which then reads the whole sequence's: nothing inside a
gathered module runs sharded.

The backward is the matching reduce-scatter (an all-reduce of the whole gradient, then this rank's
rows: gloo has no reduce-scatter): every rank's output rows send their gradient to the inputs of every
shard, and each parameter's gradient is this rank's share, summed over the SP group by DeepSpeed's
gradient average like every other replicated weight. The price is the point of sequence
parallelism for these layers: each rank computes them for the whole sequence (``sp_size`` times the
FLOPs) and holds their inputs and intermediates at full length. Hence opt-in,
``UlyssesStrategy(sequence_mixers="gather")``, with the layers and their cost logged; the set-up check
(:mod:`lightning_ulysses.hf.check`) finds the modules and verifies that the wrapped model is exact; the applier
(:mod:`lightning_ulysses.hf.apply`) installs the hooks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_ulysses.attention.collectives import gather_from_ranks, to_sequence_order, to_shard_order
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf.plan import TokenDims, argument_keys, positional_parameters
from lightning_ulysses.hf.state import PatchState


class _GatherSequence(torch.autograd.Function):
    """``[..., N/P, ...]`` shards of the SP group of ``groups`` -> ``[..., N, ...]`` along ``dim`` (in sequence order);
    backward: sum of every rank's gradient, this rank's shard of it (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, groups: SequenceParallelGroups, dim: int) -> Tensor:
        ctx.groups, ctx.dim = groups, dim
        return to_sequence_order(torch.cat(gather_from_ranks(x, groups.sp), dim=dim), groups, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        grad, group = grad.contiguous(), ctx.groups.sp
        dist.all_reduce(grad, group=group)
        size = dist.get_world_size(group)
        grad = to_shard_order(grad, ctx.groups, ctx.dim)
        return grad.tensor_split(size, dim=ctx.dim)[dist.get_rank(group)], None, None


def gather_whole_sequence(
    module: nn.Module, state: PatchState, dims: TokenDims
) -> tuple[RemovableHandle, RemovableHandle]:
    """Run ``module`` on the whole sequence of the SP group (see the module docstring): the two hooks that do it,
    registered on it."""
    shard_length: list[int | None] = [None]  # this rank's tokens in the call, set by the pre-hook for the forward hook
    parameters = positional_parameters(module)

    def gather_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not state.enabled or state.group.sp is None:
            return None
        shard_length[0] = None
        keys = argument_keys(parameters, args, {})
        args = tuple(_gather_tree(a, key, dims.inputs, state.group, shard_length) for key, a in keys)
        kwargs = {k: _gather_tree(v, k, dims.inputs, state.group, shard_length) for k, v in kwargs.items()}
        return args, kwargs

    def keep_shard(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        length, shard_length[0] = shard_length[0], None
        groups = state.group
        if length is None or groups.sp is None:
            return None
        rank, counter, name = dist.get_rank(groups.sp), iter(range(1 << 30)), type(module).__name__

        def shard(t: Tensor) -> Tensor:
            return _shard(t, dims.outputs.get(next(counter)), length, rank, groups, name)

        return _map_tensors(output, shard)

    return (
        module.register_forward_pre_hook(gather_inputs, with_kwargs=True),
        module.register_forward_hook(keep_shard, with_kwargs=True),
    )


def _gather_tree(
    value: Any, key: str, dims: dict[str, int], group: SequenceParallelGroups, length: list[int | None]
) -> Any:
    """``value`` with every tensor that ``dims`` names gathered along its sequence dimension; ``length[0]``: the
    shard's length it had."""
    if isinstance(value, Tensor):
        dim = dims.get(key)
        if dim is None:
            return value
        length[0] = value.shape[dim]
        return _GatherSequence.apply(value, group, dim)
    if isinstance(value, (tuple, list)):
        return type(value)(_gather_tree(v, f"{key}.{i}", dims, group, length) for i, v in enumerate(value))
    return value


def _shard(
    tensor: Tensor, dim: int | None, length: int, rank: int, group: SequenceParallelGroups, module: str
) -> Tensor:
    """This rank's ``length`` rows of a whole-sequence output of ``module`` (its class name), plus the constant number
    an output longer than the sequence carries past it (a padded convolution's ``k - 1``; not under Ulysses x Ring,
    whose shards are zigzag)."""
    if dim is None:
        return tensor
    extra = tensor.shape[dim] - length * dist.get_world_size(group.sp)
    if extra and group.ring is not None:
        raise ValueError(
            f"The gathered token mixer {module} returns an output {extra} tokens longer than the sequence (a padded "
            "convolution's tail), which has no zigzag shard under Ulysses x Ring. Use ring_size=1 for this model."
        )
    return to_shard_order(tensor, group, dim).narrow(dim, rank * length, length + extra)


def _map_tensors(value: Any, fn: Any) -> Any:
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)({k: _map_tensors(v, fn) for k, v in value.items()})
    return value
