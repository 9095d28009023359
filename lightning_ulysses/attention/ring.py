"""Ring attention over the ranks of a ring group, on the heads that the Ulysses all-to-all gathered.

Ring rank ``r`` of ``R`` holds the queries, keys and values of two chunks of the sequence, chunks ``r`` and
``2R - 1 - r`` of ``2R`` (zigzag, :func:`~lightning_ulysses.sharding.zigzag_order`), each ``c = N / 2R`` tokens::

    query, key, value  [B, 2c, h, D]   (this rank's two chunks, concatenated; h = the Ulysses group's head slots;
                                        the value and the output may have a head size D_v of their own)

At step ``s`` it holds the K/V block of ring rank ``j = r - s`` (mod ``R``), attends its queries to it and passes
it on to rank ``r + 1`` while the next block arrives (point to point, overlapped with the compute). The partial
results of the blocks are merged with their log-sum-exps (online softmax), so the output is exact. The backward
runs the blocks again with the merged output and log-sum-exp (the flash-attention backward) and passes each
block's dK/dV accumulator around the ring with it: after ``R`` hops it is back at its owner, complete. No step
keeps more than the current and the next K/V block (and their gradients) alive, whatever ``R``.

Which ``(query chunk, key chunk)`` pairs run is planned on the host once per batch from the documents
(:class:`RingPlan`): a pair with no allowed ``(query, key)`` (a key chunk after the query chunk, a document border
or a sliding window between them) is skipped; a pair that every query may read whole runs without a mask; a
diagonal pair inside one document runs causal; a pair that a document border or a window edge crosses runs tile
by tile (:func:`plan_tiles`): each tile of ``MASK_TILE`` queries against only the keys it may read (from its first
query's document start, or its window, on), split into the keys before the tile and the tile's own, each part full,
causal or, where a border or an edge crosses it, with a mask of at most ``[B, MASK_TILE, c]`` built on the device
(``[B, MASK_TILE, MASK_TILE + window]`` for a window): never ``[c, c]``. With zigzag chunks and one document per row
every ring rank runs two chunk pairs per step (one per query chunk), so the ranks do the same work at every step.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_ulysses.attention.collectives import ring_exchange
from lightning_ulysses.attention.core import no_window_if_off, softmax_scale
from lightning_ulysses.attention.documents import Documents
from lightning_ulysses.attention.ring_blocks import BlockKind, block_backward, block_forward, merge_blocks

SameDocument = Callable[[int, int], Literal["all", "some", "none"]]

MASK_TILE = 1024
"""Queries per kernel call of a masked chunk pair: no mask is larger than ``[B, MASK_TILE, c]`` (never ``[c, c]``);
with a window, ``[B, MASK_TILE, MASK_TILE + window]``."""


@dataclass(frozen=True)
class Tile:
    """One kernel call of a masked chunk pair: its queries ``[q_lo, q_hi)`` against its keys ``[k_lo, k_hi)``
    (chunk-local indices), run as ``kind``."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    kind: BlockKind


@dataclass(frozen=True)
class BlockPair:
    """One ``(query chunk, key chunk)`` pair of a ring step: local chunk indices (0 or 1) and the global ones; a
    ``"masked"`` pair runs as its ``tiles`` (each query tile against the keys it may read, most without a mask)."""

    query: int
    key: int
    query_chunk: int  # of the 2R chunks of the whole sequence
    key_chunk: int
    kind: BlockKind
    tiles: tuple[Tile, ...] = ()


@dataclass(frozen=True)
class RingPlan:
    """The chunk pairs ring rank ``ring_rank`` runs at each of the ``ring_size`` steps (diagonal pairs first, so the
    first pair a query chunk runs holds its own token), and what the masked tiles need: ``document_ids [B, N]``
    (``None``: one document per row), the chunk length and the window."""

    ring_size: int
    ring_rank: int
    chunk: int
    window: int | None
    steps: tuple[tuple[BlockPair, ...], ...]
    document_ids: Tensor | None

    def mask(self, pair: BlockPair, tile: Tile, device: torch.device) -> Tensor:
        """``[B or 1, q_hi - q_lo, k_hi - k_lo]`` bool: where a query of ``tile`` may read a key of it."""
        q_first, k_first = pair.query_chunk * self.chunk + tile.q_lo, pair.key_chunk * self.chunk + tile.k_lo
        q_index = torch.arange(q_first, q_first + tile.q_hi - tile.q_lo, device=device)
        k_index = torch.arange(k_first, k_first + tile.k_hi - tile.k_lo, device=device)
        distance = q_index[:, None] - k_index[None, :]
        allowed = (distance >= 0)[None]
        if self.window is not None:
            allowed = allowed & (distance < self.window)
        if self.document_ids is not None:
            doc_q = self.document_ids[:, q_first : q_first + tile.q_hi - tile.q_lo]
            doc_k = self.document_ids[:, k_first : k_first + tile.k_hi - tile.k_lo]
            allowed = allowed & (doc_q[:, :, None] == doc_k[:, None, :])
        return allowed


def classify_span(
    q_first: int, q_last: int, k_first: int, k_last: int, window: int | None, same_document: SameDocument
) -> BlockKind | None:
    """How queries ``[q_first, q_last]`` run against keys ``[k_first, k_last]`` (whole-sequence columns, the keys
    either the queries' own columns or all before them; ``None``: skipped). ``same_document(x, y)`` tells, on the
    host, whether columns ``x`` and ``y`` are in the same document in every row (``"all"``), in some row
    (``"some"``) or in none (``"none"``)."""
    if k_first > q_last:
        return None
    if (k_first, k_last) == (q_first, q_last):  # diagonal
        one_document = same_document(q_first, q_last) == "all"
        return "causal" if one_document and (window is None or window > q_last - q_first) else "masked"
    if window is not None and q_first - k_last >= window:
        return None
    # documents are runs of columns: a document holding a key and a later query holds every column between them
    if same_document(k_last, q_first) == "none":
        return None
    whole = same_document(k_first, q_last) == "all" and (window is None or q_last - k_first < window)
    return "full" if whole else "masked"


def classify_pair(
    query_chunk: int, key_chunk: int, chunk: int, window: int | None, same_document: SameDocument
) -> BlockKind | None:
    """:func:`classify_span` of a whole chunk pair (``None``: skipped)."""
    if key_chunk > query_chunk:
        return None
    return classify_span(
        query_chunk * chunk,
        (query_chunk + 1) * chunk - 1,
        key_chunk * chunk,
        (key_chunk + 1) * chunk - 1,
        window,
        same_document,
    )


def plan_tiles(
    query_chunk: int,
    key_chunk: int,
    chunk: int,
    window: int | None,
    same_document: SameDocument,
    first_column: Callable[[int], int],
    tile: int,
) -> tuple[Tile, ...]:
    """The kernel calls of a masked chunk pair: each tile of ``tile`` queries against the keys it may read from the
    first column of its first query's document (``first_column``, over all rows) or its window on, split into the
    keys before the tile and, in a diagonal pair, the tile's own (causal) columns; each part classified on its own,
    so that only the parts a document border or a window edge crosses build a mask."""
    q_base, k_base = query_chunk * chunk, key_chunk * chunk
    tiles = []
    for lo in range(0, chunk, tile):
        hi = min(lo + tile, chunk)
        q_first, q_last = q_base + lo, q_base + hi - 1
        earliest = first_column(q_first) if window is None else max(first_column(q_first), q_first - window + 1)
        k_first = max(k_base, earliest)
        spans = (
            [(k_first, q_first - 1), (q_first, q_last)] if key_chunk == query_chunk else [(k_first, k_base + chunk - 1)]
        )
        for first, last in spans:
            if first <= last and (kind := classify_span(q_first, q_last, first, last, window, same_document)):
                tiles.append(Tile(lo, hi, first - k_base, last + 1 - k_base, kind))
    return tuple(tiles)


def plan_ring(
    documents: Documents | None,
    batch: int,
    seq_len: int,
    ring_size: int,
    ring_rank: int,
    window: int | None,
    tile: int = MASK_TILE,
) -> RingPlan:
    """The :class:`RingPlan` of ring rank ``ring_rank`` for rows of ``seq_len`` whole-sequence tokens (host work on
    ``documents.offsets``; no host sync); masked pairs cut into query tiles of ``tile``."""
    chunk = seq_len // (2 * ring_size)
    if documents is None or documents.one_per_row:

        def same_document(x: int, y: int) -> Literal["all", "some", "none"]:
            return "all"

        def first_column(x: int) -> int:
            return 0
    else:
        offsets = documents.offsets

        def same_document(x: int, y: int) -> Literal["all", "some", "none"]:
            same = [
                bisect.bisect_right(offsets, row * seq_len + x) == bisect.bisect_right(offsets, row * seq_len + y)
                for row in range(batch)
            ]
            return "all" if all(same) else "some" if any(same) else "none"

        def first_column(x: int) -> int:
            return min(
                offsets[bisect.bisect_right(offsets, row * seq_len + x) - 1] - row * seq_len for row in range(batch)
            )

    own = (ring_rank, 2 * ring_size - 1 - ring_rank)
    steps = []
    for step in range(ring_size):
        source = (ring_rank - step) % ring_size
        held = (source, 2 * ring_size - 1 - source)
        pairs = []
        for q, k in itertools.product(range(2), range(2)):
            kind = classify_pair(own[q], held[k], chunk, window, same_document)
            if kind == "masked":
                tiles = plan_tiles(own[q], held[k], chunk, window, same_document, first_column, tile)
                pairs.append(BlockPair(q, k, own[q], held[k], kind, tiles))
            elif kind is not None:
                pairs.append(BlockPair(q, k, own[q], held[k], kind))
        steps.append(tuple(sorted(pairs, key=lambda p: p.query_chunk != p.key_chunk)))
    document_ids = None if documents is None or documents.one_per_row else documents.document_ids
    return RingPlan(ring_size, ring_rank, chunk, window, tuple(steps), document_ids)


def ring_plan(
    documents: Documents | None, batch: int, seq_len: int, ring_size: int, ring_rank: int, window: int | None
) -> RingPlan:
    """:func:`plan_ring`, built once per batch and kept with the documents (every layer reuses it)."""
    if documents is None:
        return plan_ring(None, batch, seq_len, ring_size, ring_rank, window, MASK_TILE)
    key = ("ring", ring_size, ring_rank, window, MASK_TILE)
    return documents.plan(key, lambda d: plan_ring(d, batch, seq_len, ring_size, ring_rank, window, MASK_TILE))


# ----------------------------------------------------------------------------------------------
# the ring
# ----------------------------------------------------------------------------------------------
def _pair_forward(
    query: Tensor, key: Tensor, value: Tensor, pair: BlockPair, plan: RingPlan, scale: float
) -> tuple[Tensor, Tensor]:
    """One chunk pair: ``[B, c, h, D_v]`` output and ``[B, c, h]`` log-sum-exp (``-inf`` where a query reads nothing);
    a masked pair tile by tile (a query tile's parts merged: its own token's part always reads a key)."""
    if pair.kind != "masked":
        return block_forward(query, key, value, pair.kind, None, scale)
    out = query.new_zeros((*query.shape[:3], value.shape[-1]), dtype=torch.float32)
    lse = query.new_full(query.shape[:3], float("-inf"), dtype=torch.float32)
    for (lo, hi), parts in itertools.groupby(pair.tiles, key=lambda t: (t.q_lo, t.q_hi)):
        acc = None
        for tile in parts:
            mask = plan.mask(pair, tile, query.device) if tile.kind == "masked" else None
            keys, values = key[:, tile.k_lo : tile.k_hi], value[:, tile.k_lo : tile.k_hi]
            acc = merge_blocks(acc, *block_forward(query[:, lo:hi], keys, values, tile.kind, mask, scale))
        assert acc is not None  # groupby's groups are never empty
        out[:, lo:hi], lse[:, lo:hi] = acc
    return out, lse


def _pair_backward(
    grad: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    pair: BlockPair,
    plan: RingPlan,
    scale: float,
) -> tuple[list[tuple[slice, Tensor]], list[tuple[slice, Tensor, Tensor]]]:
    """The gradients of one chunk pair: ``(query rows, dQ)`` and ``(key rows, dK, dV)`` per kernel call."""
    if pair.kind != "masked":
        dq, dk, dv = block_backward(grad, query, key, value, out, lse, pair.kind, None, scale)
        return [(slice(None), dq)], [(slice(None), dk, dv)]
    grad_queries, grad_keys = [], []
    for tile in pair.tiles:
        rows, columns = slice(tile.q_lo, tile.q_hi), slice(tile.k_lo, tile.k_hi)
        mask = plan.mask(pair, tile, query.device) if tile.kind == "masked" else None
        dq, dk, dv = block_backward(
            grad[:, rows],
            query[:, rows],
            key[:, columns],
            value[:, columns],
            out[:, rows],
            lse[:, rows],
            tile.kind,
            mask,
            scale,
        )
        grad_queries.append((rows, dq))
        grad_keys.append((columns, dk, dv))
    return grad_queries, grad_keys


def _attend_step(
    queries: tuple[Tensor, ...],
    kv: list[Tensor],
    pairs: tuple[BlockPair, ...],
    plan: RingPlan,
    scale: float,
    acc: list[tuple[Tensor, Tensor] | None],
) -> None:
    """Forward of one ring step: merge this rank's query chunks' attention to the K/V block ``kv`` into ``acc``.
    (A function of its own, so that no view of a block outlives the step.)"""
    keys, values = (t.chunk(2, dim=1) for t in kv)
    for pair in pairs:
        out, lse = _pair_forward(queries[pair.query], keys[pair.key], values[pair.key], pair, plan, scale)
        acc[pair.query] = merge_blocks(acc[pair.query], out, lse)


def _gradient_step(
    split: list[tuple[Tensor, ...]],
    kv: list[Tensor],
    pairs: tuple[BlockPair, ...],
    plan: RingPlan,
    scale: float,
    grad_queries: tuple[Tensor, ...],
) -> list[Tensor]:
    """Backward of one ring step: add the query gradients into ``grad_queries``; return this rank's fp32 share of the
    gradient of the K/V block ``kv``."""
    grad_kv = [torch.zeros_like(t, dtype=torch.float32) for t in kv]
    keys, values = (t.chunk(2, dim=1) for t in kv)
    grad_keys, grad_values = (t.chunk(2, dim=1) for t in grad_kv)
    for pair in pairs:
        g, q, o, lse = (t[pair.query] for t in split)
        query_parts, key_parts = _pair_backward(g, q, keys[pair.key], values[pair.key], o, lse, pair, plan, scale)
        for rows, dq in query_parts:
            grad_queries[pair.query][:, rows] += dq
        for columns, dk, dv in key_parts:
            grad_keys[pair.key][:, columns] += dk
            grad_values[pair.key][:, columns] += dv
    return grad_kv


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def _add_into(targets: list[Tensor], sources: list[Tensor]) -> None:
    """``targets[i] += sources[i]`` (a function, so that no loop variable keeps a source alive afterwards)."""
    for target, source in zip(targets, sources):
        target.add_(source)


class _RingAttention(torch.autograd.Function):
    """``query [B, 2c, h, D]``, ``key [B, 2c, kv_h, D]``, ``value [B, 2c, kv_h, D_v]`` of this ring rank ->
    ``[B, 2c, h, D_v]``.

    At most two K/V blocks (the one attended, the one arriving) are alive in the forward; in the backward also
    this step's dK/dV share, the accumulator arriving and the one leaving.
    """

    @staticmethod
    def forward(
        ctx: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        sinks: Tensor | None,
        plan: RingPlan,
        group: ProcessGroup,
        scale: float,
    ) -> Tensor:
        queries = query.chunk(2, dim=1)
        acc: list[tuple[Tensor, Tensor] | None] = [None, None]
        kv = [key, value]
        for step, pairs in enumerate(plan.steps):
            last = step + 1 == plan.ring_size
            if not last:
                incoming, requests = ring_exchange(kv, group)
            _attend_step(queries, kv, pairs, plan, scale, acc)
            if not last:
                _wait(requests)
                kv = incoming
        out, lse = (torch.cat(parts, dim=1) for parts in zip(*acc))
        if sinks is not None:  # one more logit per head whose value is zero: a block of its own, merged last
            with_sinks = torch.logaddexp(lse, sinks.float())
            out, lse = out * torch.exp(lse - with_sinks)[..., None], with_sinks
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, sinks, out, lse)
        ctx.plan, ctx.group, ctx.scale = plan, group, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, sinks, out, lse = ctx.saved_tensors
        plan, group, scale = ctx.plan, ctx.group, ctx.scale
        grad_sinks = None
        if sinks is not None:  # d out / d sink_h = -p_sink * out, p_sink = exp(sink_h - lse) (lse with the sinks)
            grad_sinks = -(torch.exp(sinks.float() - lse) * (grad.float() * out.float()).sum(-1)).sum((0, 1))
            grad_sinks = grad_sinks.to(sinks.dtype)
        split = [t.chunk(2, dim=1) for t in (grad.contiguous(), query, out, lse)]
        grad_query = torch.zeros_like(query, dtype=torch.float32)
        kv = [key, value]
        travelling: tuple[list[Tensor], list[Any]] | None = None  # the dK/dV accumulator coming from the previous rank
        for step, pairs in enumerate(plan.steps):
            last = step + 1 == plan.ring_size
            if not last:
                incoming, requests = ring_exchange(kv, group)
            grad_kv = _gradient_step(split, kv, pairs, plan, scale, grad_query.chunk(2, dim=1))
            if travelling is not None:
                _wait(travelling[1])
                _add_into(grad_kv, travelling[0])
            # on to the next rank; after the last step it goes home (a ring of one keeps it)
            travelling = ring_exchange(grad_kv, group) if plan.ring_size > 1 else (grad_kv, [])
            del grad_kv
            if not last:
                _wait(requests)
                kv = incoming
        assert travelling is not None  # a ring of any size runs at least one step
        received, waits = travelling
        _wait(waits)
        grad_key, grad_value = (g.to(t.dtype) for g, t in zip(received, (key, value)))
        return grad_query.to(query.dtype), grad_key, grad_value, grad_sinks, None, None, None


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    documents: Documents | None,
    group: ProcessGroup,
    ring_size: int,
    ring_rank: int,
    *,
    scale: float | None = None,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention of this ring rank's zigzag chunks against the whole sequence, exact (see the module docstring).

    Args:
        query: ``[B, 2c, h, D]``, this ring rank's chunks ``ring_rank`` and ``2 * ring_size - 1 - ring_rank``.
        key, value: ``[B, 2c, kv_h, D]`` and ``[B, 2c, kv_h, D_v]``, ``h`` a multiple of ``kv_h``.
        documents: the documents of the whole rows, in sequence order (``None``: one per row).
        group: the ring group (``ring_size`` ranks, this one at ``ring_rank``).
        scale: softmax scale (``None``: ``D ** -0.5``); window: sliding window as in :func:`ulysses_attention`
            (``None`` or ``0``: none).
        sinks: ``[h]`` attention sink logits of the query heads (gpt-oss): merged after the blocks as one more
            logit per head whose value is zero; its gradient is this ring rank's queries' share.

    Returns ``[B, 2c, h, D_v]``; gradients flow to ``query``, ``key`` and ``value`` of every ring rank.
    """
    batch, local = query.shape[:2]
    plan = ring_plan(documents, batch, local * ring_size, ring_size, ring_rank, no_window_if_off(window))
    scale = softmax_scale(query, scale)
    return _RingAttention.apply(query, key, value, sinks, plan, group, scale)
