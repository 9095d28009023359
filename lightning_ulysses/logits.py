"""Per-token values of next-token logits, computed from the whole logits or one token tile at a time.

A rank's logits ``[B, n, V]`` are the largest tensor of long-context training *and* evaluation
(1M tokens x 128k vocabulary x 4 B = 512 GB in fp32). Every consumer of them in this package (the loss,
:class:`~lightning_ulysses.metrics.TokenCrossEntropy`, :class:`~lightning_ulysses.metrics.Perplexity`,
:class:`~lightning_ulysses.metrics.TokenAccuracy`, :func:`~lightning_ulysses.prediction.token_log_probs`) needs one
value per token, so each accepts either the logits tensor or :class:`TiledLogits`: the final hidden states and the
``lm_head`` that would make the logits. Those are turned into logits one token tile at a time and every
tile is reduced to its per-token values before the next tile exists, so at most one tile's
``[tile_tokens, V]`` logits (and their fp32 copy) are alive. The values equal those of the whole logits.

Under autograd each tile is a :func:`torch.utils.checkpoint.checkpoint` region recomputed in the backward
(see :mod:`lightning_ulysses.memory`), so the same code is the training loss's tiled path where an engine shards
``lm_head``'s parameters (ZeRO-3, FSDP2). Where they are whole on the rank (plain PyTorch, ZeRO 0-2) the training
loss sum runs each tile's backward inside its forward instead (:func:`fused_loss_sum`,
:mod:`lightning_ulysses.fused_loss`): the same tiles and values, ``lm_head`` called once per tile and step, not twice.

**Tile size** (``tiled_loss=True``, :func:`resolve_loss_tiles`): tiles are sized by bytes. While a tile's cross
entropy trains, three fp32 ``[tile, V]`` tensors are alive at once (:data:`CROSS_ENTROPY_BYTES_PER_LOGIT`), and they
are kept within what the rank holds anyway, and never above the former ``hidden``-token tile::

    tile * V * 12  <=  max(n, V) * hidden * itemsize,   tile <= hidden    (n: the most tokens of any rank)

``V * hidden * itemsize`` is ``lm_head``'s weight (resident under ZeRO 0-2, gathered for each tile's call under
ZeRO-3; its gradient is made in every tile's backward) and ``n * hidden * itemsize`` the rank's final hidden states
(the loss's input, which scales as ``1/sp``). Below ``n = V`` tokens a tile is ``hidden * itemsize / 12`` tokens
(hidden 128 in fp32: 42; Llama-3.1-8B in bf16: 682 tokens, 1 GiB of transients against the former 5.9 GiB), so the
fixed cost that set the peak of short shards is the weight's bytes, which every tile moves anyway: smaller tiles
would cost more in per-tile overhead than they save. Above, the tile grows with ``n`` (its transients one more copy
of the rank's hidden states) until it is ``hidden`` tokens again, from ``n = 12 V / itemsize`` (3 V in fp32, 6 V in
bf16): at long shards the tiles, their count and the peak are the former rule's. The count is capped so because every
tile costs a little besides its logits (its autograd nodes, its gradient piece until the tiles' gradients are joined;
on CPU these small buffers stay in the process's heap: 6-8 KiB a tile), which at long lengths would outgrow the
transients saved. Small tiles cost time too: each makes and adds a ``[V, hidden]`` weight gradient and runs narrower
matmuls. At 16384 tokens per rank of ``benchmarks.longest``'s model on CPU the 43-token tiles take about 2 s of a 28 s
step more than ``hidden``-token tiles would, which in turn raise the step's peak with head chunks by a quarter at 8192
tokens per rank (``docs/benchmarks/chunk_cost.md``): the memory is kept.

Some families make their logits from ``lm_head``'s output, or its input, with more than ``lm_head``: Granite divides
them by ``logits_scaling``, Cohere and Falcon-H1 multiply them by a constant, MiniCPM3 divides the hidden states before
``lm_head``, Gemma 3n and RecurrentGemma soft-cap them (``cap * tanh(logits / cap)``). Each of these acts on every logit
alone, so it applies per tile: a :class:`LogitMap`, which the set-up check finds by running the model
(:mod:`lightning_ulysses.hf.check.logits`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_ulysses.fused_loss import FusedCrossEntropySum, engine_shards
from lightning_ulysses.sharding import IGNORE_INDEX
from lightning_ulysses.tiling import (
    TileSetting,
    agree_max_tokens,
    recomputed_in_backward,
    resolve_num_tiles,
    split_tiles,
)

TokenFunction = Callable[[Tensor, Tensor], Tensor]
"""``(logits [tokens, V], labels [tokens]) -> [tokens]``: one value per token."""


@dataclass(frozen=True)
class LogitMap:
    """How a model's logits follow from its final hidden states ``h`` and its output embeddings ``lm_head``::

        logits = cap * tanh(scale * lm_head(input_scale * h) / cap)     (without the tanh where cap is None)

    Each factor is a Python float (fixed at set-up: no tensor, no host sync in a step); ``LogitMap()`` is
    ``lm_head(h)``. It acts on every token and every logit alone, so it applies to each token tile of the logits.
    """

    input_scale: float = 1.0
    scale: float = 1.0
    cap: float | None = None

    def head(self, lm_head: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        """``[tokens, hidden] -> [tokens, V]``: the model's logits of a tile of final hidden states (``lm_head`` itself
        where the map is the identity, else a :class:`MappedHead`)."""
        return lm_head if self == LogitMap() else MappedHead(lm_head, self)

    def __str__(self) -> str:
        hidden = "h" if self.input_scale == 1 else f"{self.input_scale:.6g} * h"
        logits = f"lm_head({hidden})" if self.scale == 1 else f"{self.scale:.6g} * lm_head({hidden})"
        return logits if self.cap is None else f"{self.cap:.6g} * tanh({logits} / {self.cap:.6g})"


@dataclass(frozen=True)
class MappedHead:
    """``logit_map`` applied to ``lm_head``: ``[tokens, hidden] -> [tokens, V]``, the model's logits; ``lm_head`` kept
    so that the fused loss (:func:`fused_loss_sum`) finds its parameters."""

    lm_head: Callable[[Tensor], Tensor]
    logit_map: LogitMap

    def __call__(self, hidden_states: Tensor) -> Tensor:
        scale, cap = self.logit_map.scale, self.logit_map.cap
        input_scale = self.logit_map.input_scale
        logits = self.lm_head(hidden_states if input_scale == 1 else hidden_states * input_scale)
        if scale != 1:
            logits = logits * scale
        if cap is not None:  # as transformers soft-caps: divide, tanh, multiply
            logits = torch.tanh(logits / cap) * cap
        return logits


LossSum = Callable[[Tensor, Tensor, int], Tensor]
"""``(hidden_states [tokens, hidden], labels [tokens], ignore_index) ->`` the fp32 sum of the token cross entropies."""


@dataclass(frozen=True)
class TiledLogits:
    """The logits ``lm_head(hidden_states)`` of this rank, ``[B, n, V]``, never materialised whole.

    Attributes:
        hidden_states: ``[B, n, hidden]``, the final (normed) hidden states.
        lm_head: ``[tokens, hidden] -> [tokens, V]``, e.g. ``model.get_output_embeddings()``, or
            ``LogitMap.head`` of it where the model makes its logits with more than ``lm_head``.
        num_tiles: exactly this many ``lm_head`` calls per consumer (tiles may be empty), on every rank alike:
            under ZeRO-3 each call gathers ``lm_head``'s weight collectively.
        loss_sum: the :data:`LossSum` of these logits by a fused computation, which the loss sum
            (:func:`cross_entropy_sum`) then takes instead of the checkpointed tiles: Liger's kernel
            (:func:`~lightning_ulysses.liger.liger_loss_sum`, where asked) or the tiles with each one's backward run
            in the forward (:func:`fused_loss_sum`, where ``lm_head``'s parameters are whole on the rank); ``None``:
            the checkpointed tiles.
    """

    hidden_states: Tensor
    lm_head: Callable[[Tensor], Tensor]
    num_tiles: int
    loss_sum: LossSum | None = None


CROSS_ENTROPY_BYTES_PER_LOGIT = 12
"""Bytes per logit alive at once while one tile of :func:`token_losses` trains: in the tile's backward the fp32
log-softmax kept by its recomputed forward, its gradient, and the gradient of the fp32 logits (three fp32 ``[tile, V]``
tensors). The forward holds fewer: the logits in their dtype, their fp32 copy (the logits themselves in fp32) and the
log-softmax, 10 bytes in bf16 and 8 in fp32."""


def loss_tile_tokens(max_tokens: int, hidden_size: int, vocab_size: int, itemsize: int) -> int:
    """The most tokens of a loss tile: the largest ``tile`` (at least 1, at most ``hidden_size``) with
    ``tile * vocab_size * CROSS_ENTROPY_BYTES_PER_LOGIT <= max(max_tokens, vocab_size) * hidden_size * itemsize``,
    the bytes of ``lm_head``'s ``[vocab_size, hidden_size]`` weight or of the ``[max_tokens, hidden_size]`` hidden
    states, whichever is larger (see the module docstring for why)."""
    budget = max(max_tokens, vocab_size) * hidden_size * itemsize
    return min(hidden_size, max(1, budget // (vocab_size * CROSS_ENTROPY_BYTES_PER_LOGIT)))


def resolve_loss_tiles(
    setting: TileSetting,
    hidden_states: Tensor,
    lm_head: Callable[[Tensor], Tensor] | None = None,
    vocab_size: int | None = None,
) -> int:
    """The number of loss tiles of ``hidden_states [..., hidden]``: ``setting`` when an int (1 when ``False``), else
    ``ceil(n / loss_tile_tokens(n, ...))`` with ``n`` the most tokens of any rank, agreed here with one ``all_reduce``
    (a host sync, once per batch, outside the layers), so that every rank makes the same number of ``lm_head`` calls
    (under ZeRO-3 each gathers its weight collectively). ``vocab_size`` (needed by ``True``): ``None`` reads it from
    ``lm_head``'s ``[vocab, hidden]`` weight."""
    if setting is not True:
        return resolve_num_tiles(setting, 0, 1, hidden_states.device)
    if vocab_size is None:
        vocab_size = _output_rows(lm_head)
    tokens = hidden_states.shape[:-1].numel()
    max_tokens = agree_max_tokens(tokens, hidden_states.device)
    tile_tokens = loss_tile_tokens(max_tokens, hidden_states.shape[-1], vocab_size, hidden_states.element_size())
    return resolve_num_tiles(True, tokens, tile_tokens, hidden_states.device, max_tokens)


def _output_rows(lm_head: Callable[[Tensor], Tensor] | None) -> int:
    """The vocabulary of an output embedding: the rows of its ``[vocab, hidden]`` weight (under ZeRO-3, whose
    partitioned weight is empty on the rank, the shape DeepSpeed records as ``ds_shape``)."""
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, Tensor):
        raise ValueError(
            f"tiled_loss=True sizes the loss tiles by the vocabulary, which {type(lm_head).__name__} does not show as "
            "a [vocab, hidden] weight: pass vocab_size=, or an int number of tiles."
        )
    return int(getattr(weight, "ds_shape", weight.shape)[0])


# a runtime alias kept as typing.Union (``X | Y`` would make another object, a types.UnionType)
Logits = Union[Tensor, TiledLogits]  # noqa: UP007
"""``[B, n, V]`` logits, whole or as :class:`TiledLogits`."""


def per_token(logits: Logits, labels: Tensor, fn: TokenFunction) -> Tensor:
    """``fn`` of every token's logits and label, ``[B, n]`` (``labels [B, n]``).

    With :class:`TiledLogits` ``fn`` runs once per tile on that tile's logits only."""
    if not isinstance(logits, TiledLogits):
        return fn(logits.flatten(0, -2), labels.flatten()).view(labels.shape)
    run = recomputed_in_backward(lambda hidden, target: fn(logits.lm_head(hidden), target))
    tiles = zip(
        split_tiles(logits.hidden_states.reshape(-1, logits.hidden_states.shape[-1]), logits.num_tiles, dim=0),
        split_tiles(labels.reshape(-1), logits.num_tiles, dim=0),
        strict=True,
    )
    return torch.cat([run(hidden, target) for hidden, target in tiles]).view(labels.shape)


def token_losses(logits: Logits, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``[B, n]`` fp32 next-token cross entropy of each token (``-log p(label)``); 0 where ignored."""
    return per_token(
        logits, labels, lambda x, y: F.cross_entropy(x.float(), y, ignore_index=ignore_index, reduction="none")
    )


def token_hits(logits: Logits, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``[B, n]`` bool: the argmax of the logits is the label (``False`` where ``labels == ignore_index``)."""
    return per_token(logits, labels, lambda x, y: (x.argmax(dim=-1) == y) & (y != ignore_index))


def cross_entropy_sum(logits: Logits, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """The fp32 sum of the next-token cross entropies of ``logits [B, n, V]`` (whole or :class:`TiledLogits`) against
    ``labels [B, n]``: by :attr:`TiledLogits.loss_sum` where it is given, else of :func:`token_losses`."""
    if isinstance(logits, TiledLogits) and logits.loss_sum is not None:
        hidden_states = logits.hidden_states.reshape(-1, logits.hidden_states.shape[-1])
        return logits.loss_sum(hidden_states, labels.reshape(-1), ignore_index)
    return token_losses(logits, labels, ignore_index).sum()


def fused_loss_module(head: Callable[[Tensor], Tensor]) -> nn.Module | None:
    """The module whose parameters the fused loss (:func:`fused_loss_sum`) takes the gradients of, where it runs:
    ``head`` (or :class:`MappedHead`'s ``lm_head``) where it is an ``nn.Module`` whose parameters are whole on the
    rank; ``None`` (the checkpointed tiles) where an engine shards them or ``head`` is another callable."""
    module = head.lm_head if isinstance(head, MappedHead) else head
    if not isinstance(module, nn.Module) or engine_shards(module):
        return None
    return module


def fused_loss_sum(head: Callable[[Tensor], Tensor], num_tiles: int) -> LossSum | None:
    """The :attr:`TiledLogits.loss_sum` of ``head``'s logits in ``num_tiles`` tiles, each tile's backward run in the
    forward (:class:`~lightning_ulysses.fused_loss.FusedCrossEntropySum`), where ``head`` is an ``nn.Module`` or
    :meth:`LogitMap.head` of one whose parameters are whole on the rank (plain PyTorch, ZeRO 0-2). ``None`` (the
    checkpointed tiles) where an engine shards them (ZeRO-3, FSDP2: :func:`~lightning_ulysses.fused_loss.engine_shards`)
    or ``head`` is another callable, whose trainable tensors cannot be listed. Called without a gradient to make (no
    grad mode, nothing requiring one), the sum is the tiles' values alone."""
    module = fused_loss_module(head)
    if module is None:
        return None

    def loss_sum(hidden_states: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
        parameters = list(module.parameters())
        if torch.is_grad_enabled() and (hidden_states.requires_grad or any(p.requires_grad for p in parameters)):
            return FusedCrossEntropySum.apply(head, num_tiles, ignore_index, hidden_states, labels, *parameters)
        return token_losses(TiledLogits(hidden_states, head, num_tiles), labels, ignore_index).sum()

    return loss_sum


def tiled_cross_entropy_sum(
    hidden_states: Tensor,
    lm_head: Callable[[Tensor], Tensor],
    labels: Tensor,
    num_tiles: int,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Sum of the token cross entropies of ``lm_head(hidden_states)`` without materialising the logits: fused
    (:func:`fused_loss_sum`) where ``lm_head`` is a module with whole parameters, else the checkpointed tiles.

    Args:
        hidden_states: ``[batch, seq/sp, hidden]``, the final (normed) hidden states of this rank's tokens.
        lm_head: ``[tokens, hidden] -> [tokens, vocab]``, e.g. ``model.get_output_embeddings()``.
        labels: ``[batch, seq/sp]`` targets of each token (``shift_labels``); ``ignore_index`` is left out.
        num_tiles: exactly this many ``lm_head`` calls, on every rank alike.

    Returns:
        a scalar fp32 sum (0 with a zero gradient when no label is valid). At most one tile's
        ``[tile_tokens, vocab]`` logits and their gradient exist at a time.
    """
    tiled = TiledLogits(hidden_states, lm_head, num_tiles, fused_loss_sum(lm_head, num_tiles))
    return cross_entropy_sum(tiled, labels, ignore_index)
