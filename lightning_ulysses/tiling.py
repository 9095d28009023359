"""Token tiles: a token-wise module run a few tokens at a time, each tile recomputed in the backward.

Tile counts must agree across ranks: under ZeRO-3 every call of a tiled module gathers its parameters
(a collective). An ``int`` is used as is, with empty tiles where a rank has fewer tokens
(:func:`split_tiles` always makes exactly that many); ``True`` picks ``ceil(tokens / tile_tokens)``
with the most tokens of any rank. A tiled MLP's tile is ``hidden_size`` tokens (its transient tensors are then about
the size of one weight matrix); in a patched model the token count is agreed once per batch by its forward
(``PatchState.forward.tokens``), so a tiled MLP call and its recomputation run no collective and no host sync. Loss
tiles are sized by bytes (:func:`lightning_ulysses.logits.resolve_loss_tiles`), agreed once per batch before the
first tile.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

TileSetting = bool | int
"""``False``: no tiling; ``True``: tile count from the number of tokens; ``int``: that many tiles."""


def agree_max_tokens(num_tokens: int, device: torch.device) -> int:
    """The largest ``num_tokens`` of all ranks (one ``all_reduce`` and one host sync when there are several)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        agreed = torch.tensor([num_tokens], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return int(agreed.item())
    return num_tokens


def resolve_num_tiles(
    setting: TileSetting, num_tokens: int, tile_tokens: int, device: torch.device, max_tokens: int | None = None
) -> int:
    """The number of tiles for ``num_tokens`` tokens: ``setting`` when an int, else
    ``ceil(max_tokens / tile_tokens)`` with ``max_tokens`` the most tokens of any rank (agreed here with one
    ``all_reduce`` unless given), so that every rank runs the same number of tiled calls."""
    if setting is False:
        return 1
    if setting is not True:
        return int(setting)
    if max_tokens is None:
        max_tokens = agree_max_tokens(num_tokens, device)
    return max(1, math.ceil(max_tokens / tile_tokens))


def tiled_map(fn: Callable[[Tensor], Any], x: Tensor, num_tiles: int) -> Any:
    """``fn(x)`` computed ``num_tiles`` tiles of the sequence at a time, each tile recomputed in the backward.

    Args:
        fn: a token-wise function (token ``t``'s outputs depend on token ``t`` alone, like an MLP or a
            mixture-of-experts block that routes each token on its own): ``[..., seq, dim_in] -> [..., seq, dim_out]``,
            or a tuple of such tensors and of per-token tensors flattened over the leading dimensions
            (``[prod(...) * seq, k]``, as MoE blocks return their router scores), and ``None``.
        x: ``[..., seq, dim_in]``, e.g. ``[batch, seq/sp, hidden]``; the tiles are ``x[..., tile, :]`` (``fn`` sees the
            rank it was written for).
        num_tiles: exactly this many calls of ``fn`` (tiles may be empty), on every rank alike.

    Returns:
        What ``fn(x)`` returns, each tensor the tiles' outputs put together along the sequence. Only one tile's
        intermediates are alive at a time, in the forward and in the backward.
    """
    tiles = split_tiles(x, num_tiles, dim=-2)
    # made contiguous inside the checkpoint region (modules view their input): what the region keeps is the view
    run = recomputed_in_backward(functools.partial(_on_contiguous, fn))
    return join_tiles([run(tile) for tile in tiles], x.shape[:-2], [tile.shape[-2] for tile in tiles])


def split_tiles(x: Tensor, num_tiles: int, dim: int) -> tuple[Tensor, ...]:
    """``x`` in exactly ``num_tiles`` views along ``dim``, sized as ``Tensor.tensor_split`` sizes them (the first
    ``len % num_tiles`` one longer; empty ones where ``num_tiles`` exceeds the length).

    One ``split_with_sizes``, so the backward puts the tiles' gradients together in one node (one ``cat``);
    ``tensor_split`` makes a slice node per tile, each of which writes its tile into a zero tensor of ``x``'s whole
    shape, and autograd runs them only after every tile's backward (they are older nodes): all tiles' gradients
    held at once, then ``num_tiles`` whole-shape buffers filled and added, quadratic in the length."""
    base, longer = divmod(x.shape[dim], num_tiles)
    return x.split([base + 1] * longer + [base] * (num_tiles - longer), dim=dim)


def join_tiles(outputs: Sequence[Any], leading: torch.Size, lengths: Sequence[int]) -> Any:
    """The tiles' ``outputs`` (of ``lengths`` tokens each, with the input's ``leading`` dimensions) put together."""
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        return _join_tensors(outputs, leading, lengths)
    if isinstance(first, tuple):
        joined = [join_tiles(part, leading, lengths) for part in zip(*outputs, strict=True)]
        return tuple(joined) if type(first) is tuple else type(first)(*joined)  # a named tuple takes fields
    raise TypeError(f"a tiled module returned {type(first).__name__}, not tensors")


def _join_tensors(parts: Sequence[Tensor], leading: torch.Size, lengths: Sequence[int]) -> Tensor:
    dim = len(leading)
    if all(p.shape[: dim + 1] == (*leading, n) for p, n in zip(parts, lengths, strict=True)):
        return torch.cat(list(parts), dim=dim)
    rows = leading.numel()
    if dim and all(p.dim() and p.shape[0] == rows * n for p, n in zip(parts, lengths, strict=True)):
        # per-token values flattened over [..., tile]: put the sequences together, then flatten again
        unflat = [p.unflatten(0, (*leading, n)) for p, n in zip(parts, lengths, strict=True)]
        return torch.cat(unflat, dim=dim).flatten(0, dim)
    raise ValueError(f"tile outputs shaped {[tuple(p.shape) for p in parts]} are not per-token tensors")


def _on_contiguous(fn: Callable[[Tensor], Any], tile: Tensor) -> Any:
    return fn(tile.contiguous())


def recomputed_in_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as one checkpoint region (its intermediates recomputed in the backward) when autograd records."""
    # one checkpoint region per tile: the backward reaches the tiles one after the other (autograd runs the most
    # recently created nodes first), so each tile's recomputed intermediates are freed before the next tile's
    return functools.partial(checkpoint, fn, use_reentrant=False) if torch.is_grad_enabled() else fn
