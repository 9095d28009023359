"""Rotary embeddings whose frequencies depend on the sequence length, computed for the whole sequence.

transformers' ``"dynamic"`` (NTK) and ``"longrope"`` RoPE choose their frequencies from the largest
position id they are given (``torch.max(position_ids) + 1``). Under sequence parallelism each rank
holds one shard of the positions, so every rank but the last would pick the frequencies of a shorter
sequence. :func:`whole_sequence_rotary` makes such a module see the largest position of the whole
sequence: it appends that position (all-reduced over the SP group, no host sync) to the module's
``position_ids`` and drops the extra token from its outputs. The set-up check
(:mod:`lightning_ulysses.hf.check`) installs it only where a module's outputs depend on the
sequence length and verifies that it makes them exact.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_ulysses.hf.patching import PatchState


def position_ids_index(module: nn.Module) -> int | None:
    """Where ``position_ids`` sits among the positional arguments of ``module.forward`` (None: keyword only)."""
    names = [
        name for name, p in inspect.signature(module.forward).parameters.items()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return names.index("position_ids") if "position_ids" in names else None


def whole_sequence_rotary(module: nn.Module, state: PatchState) -> None:
    """Make ``module`` (``forward(x, position_ids, ...) -> (cos, sin)``, each ``[..., tokens, dim]``) compute its
    frequencies from the largest position id over the SP group. Idempotent."""
    if "_ulysses_rotary_hooks" in module.__dict__:
        return
    index = position_ids_index(module)

    def extend_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not state.enabled or state.group is None:
            return None
        args = list(args)
        in_kwargs = index is None or index >= len(args)
        position_ids = kwargs["position_ids"] if in_kwargs else args[index]
        largest = position_ids.amax().reshape(1)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=state.group)
        extended = torch.cat([position_ids, largest.expand(*position_ids.shape[:-1], 1)], dim=-1)
        if in_kwargs:
            kwargs["position_ids"] = extended
        else:
            args[index] = extended
        module._ulysses_extended = True
        return tuple(args), kwargs

    def drop_extra_token(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not module.__dict__.pop("_ulysses_extended", False):
            return None
        return type(output)(t[..., :-1, :] if isinstance(t, Tensor) else t for t in output)

    module._ulysses_rotary_hooks = (
        module.register_forward_pre_hook(extend_positions, with_kwargs=True),
        module.register_forward_hook(drop_extra_token, with_kwargs=True),
    )


def remove_whole_sequence_rotary(model: nn.Module) -> None:
    for module in model.modules():
        for handle in module.__dict__.pop("_ulysses_rotary_hooks", ()):
            handle.remove()
