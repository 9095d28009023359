"""Rotary embeddings whose frequencies depend on the sequence length, computed for the whole sequence.

transformers' ``"dynamic"`` (NTK) and ``"longrope"`` RoPE choose their frequencies from the largest
position id they are given (``torch.max(position_ids) + 1``). Under sequence parallelism each rank
holds one shard of the positions, so every rank but the last would pick the frequencies of a shorter
sequence. :func:`whole_sequence_rotary` makes such a module see the largest position of the whole
sequence: it appends that position (all-reduced over the SP group, no host sync) to the module's
``position_ids`` and drops the extra token from its outputs. The set-up check
(:mod:`lightning_ulysses.hf.check`) plans it only where a module's outputs depend on the
sequence length and verifies that it makes them exact; the applier (:mod:`lightning_ulysses.hf.apply`) installs it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_ulysses.hf.state import PatchState


def position_ids_index(module: nn.Module) -> int | None:
    """Where ``position_ids`` sits among the positional arguments of ``module.forward`` (None: keyword only)."""
    names = [
        name
        for name, p in inspect.signature(module.forward).parameters.items()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return names.index("position_ids") if "position_ids" in names else None


def whole_sequence_rotary(module: nn.Module, state: PatchState) -> tuple[RemovableHandle, RemovableHandle]:
    """Make ``module`` (``forward(x, position_ids, ...) -> (cos, sin)``, each ``[..., tokens, dim]``) compute its
    frequencies from the largest position id over the SP group: the two hooks that do it, registered on it."""
    index = position_ids_index(module)
    extended = [False]  # set by the pre-hook for the forward hook of the same call

    def extend_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not state.enabled or state.group.sp is None:
            return None
        positional = list(args)
        at = index if index is not None and index < len(positional) else None  # None: passed by keyword
        position_ids = kwargs["position_ids"] if at is None else positional[at]
        largest = position_ids.amax().reshape(1)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=state.group.sp)
        longer = torch.cat([position_ids, largest.expand(*position_ids.shape[:-1], 1)], dim=-1)
        if at is None:
            kwargs["position_ids"] = longer
        else:
            positional[at] = longer
        extended[0] = True
        return tuple(positional), kwargs

    def drop_extra_token(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not extended[0]:
            return None
        extended[0] = False
        return type(output)(t[..., :-1, :] if isinstance(t, Tensor) else t for t in output)

    return (
        module.register_forward_pre_hook(extend_positions, with_kwargs=True),
        module.register_forward_hook(drop_extra_token, with_kwargs=True),
    )
