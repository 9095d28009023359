"""Ring attention over the ranks of a ring group, on the heads that the Ulysses all-to-all gathered.

Ring rank ``r`` of ``R`` holds the queries, keys and values of two chunks of the sequence, chunks ``r`` and
``2R - 1 - r`` of ``2R`` (zigzag, :func:`~lightning_ulysses.sharding.zigzag_order`), each ``c = N / 2R`` tokens::

    query, key, value  [B, 2c, h, D]   (this rank's two chunks, concatenated; h = the Ulysses group's head slots)

At step ``s`` it holds the K/V block of ring rank ``j = r - s`` (mod ``R``), attends its queries to it and passes
it on to rank ``r + 1`` while the next block arrives (point to point, overlapped with the compute). The partial
results of the blocks are merged with their log-sum-exps (online softmax), so the output is exact. The backward
runs the blocks again with the merged output and log-sum-exp (the flash-attention backward) and passes each
block's dK/dV accumulator around the ring with it: after ``R`` hops it is back at its owner, complete. No step
keeps more than the current and the next K/V block (and their gradients) alive, whatever ``R``.

Which ``(query chunk, key chunk)`` pairs run is planned on the host once per batch from the documents
(:class:`RingPlan`): a pair with no allowed ``(query, key)`` (a key chunk after the query chunk, a document border
or a sliding window between them) is skipped; a pair that every query may read whole runs without a mask; a
diagonal pair inside one document runs causal; only a pair that a document border or a window edge crosses runs
with a ``[c, c]`` mask built on the device. With zigzag chunks and one document per row every ring rank runs two
chunk pairs per step (one per query chunk), so the ranks do the same work at every step.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_ulysses.attention.collectives import ring_exchange
from lightning_ulysses.attention.documents import Documents
from lightning_ulysses.attention.ring_blocks import BlockKind, block_backward, block_forward, merge_blocks

SameDocument = Callable[[int, int], Literal["all", "some", "none"]]


@dataclass(frozen=True)
class BlockPair:
    """One ``(query chunk, key chunk)`` pair of a ring step: local chunk indices (0 or 1) and the global ones."""

    query: int
    key: int
    query_chunk: int  # of the 2R chunks of the whole sequence
    key_chunk: int
    kind: BlockKind


@dataclass(frozen=True)
class RingPlan:
    """The chunk pairs ring rank ``ring_rank`` runs at each of the ``ring_size`` steps (diagonal pairs first, so the
    first pair a query chunk runs holds its own token), and what the masked pairs need: ``document_ids [B, N]``
    (``None``: one document per row), the chunk length and the window."""

    ring_size: int
    ring_rank: int
    chunk: int
    window: int | None
    steps: tuple[tuple[BlockPair, ...], ...]
    document_ids: Tensor | None

    def mask(self, pair: BlockPair, device: torch.device) -> Tensor:
        """``[B or 1, c, c]`` bool: where a query of ``pair.query_chunk`` may read a key of ``pair.key_chunk``."""
        c = self.chunk
        q_index = torch.arange(pair.query_chunk * c, (pair.query_chunk + 1) * c, device=device)
        k_index = torch.arange(pair.key_chunk * c, (pair.key_chunk + 1) * c, device=device)
        distance = q_index[:, None] - k_index[None, :]
        allowed = (distance >= 0)[None]
        if self.window is not None:
            allowed = allowed & (distance < self.window)
        if self.document_ids is not None:
            doc_q = self.document_ids[:, pair.query_chunk * c : (pair.query_chunk + 1) * c]
            doc_k = self.document_ids[:, pair.key_chunk * c : (pair.key_chunk + 1) * c]
            allowed = allowed & (doc_q[:, :, None] == doc_k[:, None, :])
        return allowed


def classify_pair(
    query_chunk: int, key_chunk: int, chunk: int, window: int | None, same_document: SameDocument
) -> BlockKind | None:
    """How the pair runs (``None``: skipped). ``same_document(x, y)`` tells, on the host, whether columns ``x`` and
    ``y`` are in the same document in every row (``"all"``), in some row (``"some"``) or in none (``"none"``)."""
    if key_chunk > query_chunk:
        return None
    q_first, q_last = query_chunk * chunk, (query_chunk + 1) * chunk - 1
    k_first, k_last = key_chunk * chunk, (key_chunk + 1) * chunk - 1
    if key_chunk == query_chunk:
        one_document = same_document(q_first, q_last) == "all"
        return "causal" if one_document and (window is None or window >= chunk) else "masked"
    if window is not None and q_first - k_last >= window:
        return None
    # documents are runs of columns: a document holding a key and a later query holds every column between them
    if same_document(k_last, q_first) == "none":
        return None
    whole = same_document(k_first, q_last) == "all" and (window is None or q_last - k_first < window)
    return "full" if whole else "masked"


def plan_ring(
    documents: Documents | None, batch: int, seq_len: int, ring_size: int, ring_rank: int, window: int | None
) -> RingPlan:
    """The :class:`RingPlan` of ring rank ``ring_rank`` for rows of ``seq_len`` whole-sequence tokens (host work on
    ``documents.offsets``; no host sync)."""
    chunk = seq_len // (2 * ring_size)
    if documents is None or documents.one_per_row:
        def same_document(x: int, y: int) -> str:
            return "all"
    else:
        offsets = documents.offsets

        def same_document(x: int, y: int) -> str:
            same = [
                bisect.bisect_right(offsets, row * seq_len + x) == bisect.bisect_right(offsets, row * seq_len + y)
                for row in range(batch)
            ]
            return "all" if all(same) else "some" if any(same) else "none"

    own = (ring_rank, 2 * ring_size - 1 - ring_rank)
    steps = []
    for step in range(ring_size):
        source = (ring_rank - step) % ring_size
        held = (source, 2 * ring_size - 1 - source)
        pairs = [
            BlockPair(q, k, own[q], held[k], kind)
            for q in range(2) for k in range(2)
            if (kind := classify_pair(own[q], held[k], chunk, window, same_document)) is not None
        ]
        steps.append(tuple(sorted(pairs, key=lambda p: p.query_chunk != p.key_chunk)))
    document_ids = None if documents is None or documents.one_per_row else documents.document_ids
    return RingPlan(ring_size, ring_rank, chunk, window, tuple(steps), document_ids)


def ring_plan(
    documents: Documents | None, batch: int, seq_len: int, ring_size: int, ring_rank: int, window: int | None
) -> RingPlan:
    """:func:`plan_ring`, built once per batch and kept with the documents (every layer reuses it)."""
    if documents is None:
        return plan_ring(None, batch, seq_len, ring_size, ring_rank, window)
    key = ("ring", ring_size, ring_rank, window)
    return documents.plan(key, lambda d: plan_ring(d, batch, seq_len, ring_size, ring_rank, window))


# ----------------------------------------------------------------------------------------------
# the ring
# ----------------------------------------------------------------------------------------------
def _attend_step(
    queries: tuple[Tensor, Tensor], kv: list[Tensor], pairs: tuple[BlockPair, ...], plan: RingPlan, scale: float,
    acc: list[tuple[Tensor, Tensor] | None],
) -> None:
    """Forward of one ring step: merge this rank's query chunks' attention to the K/V block ``kv`` into ``acc``.
    (A function of its own, so that no view of a block outlives the step.)"""
    keys, values = (t.chunk(2, dim=1) for t in kv)
    for pair in pairs:
        mask = plan.mask(pair, keys[0].device) if pair.kind == "masked" else None
        out, lse = block_forward(queries[pair.query], keys[pair.key], values[pair.key], pair.kind, mask, scale)
        acc[pair.query] = merge_blocks(acc[pair.query], out, lse)


def _gradient_step(
    split: list[tuple[Tensor, Tensor]], kv: list[Tensor], pairs: tuple[BlockPair, ...], plan: RingPlan, scale: float,
    grad_queries: tuple[Tensor, Tensor],
) -> list[Tensor]:
    """Backward of one ring step: add the query gradients into ``grad_queries``; return this rank's fp32 share of the
    gradient of the K/V block ``kv``."""
    grad_kv = [torch.zeros_like(t, dtype=torch.float32) for t in kv]
    keys, values = (t.chunk(2, dim=1) for t in kv)
    grad_keys, grad_values = (t.chunk(2, dim=1) for t in grad_kv)
    for pair in pairs:
        mask = plan.mask(pair, keys[0].device) if pair.kind == "masked" else None
        g, q, o, l = (t[pair.query] for t in split)
        dq, dk, dv = block_backward(g, q, keys[pair.key], values[pair.key], o, l, pair.kind, mask, scale)
        grad_queries[pair.query].add_(dq)
        grad_keys[pair.key].add_(dk)
        grad_values[pair.key].add_(dv)
    return grad_kv


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def _add_into(targets: list[Tensor], sources: list[Tensor]) -> None:
    """``targets[i] += sources[i]`` (a function, so that no loop variable keeps a source alive afterwards)."""
    for target, source in zip(targets, sources):
        target.add_(source)


class _RingAttention(torch.autograd.Function):
    """``query [B, 2c, h, D]``, ``key``/``value [B, 2c, kv_h, D]`` of this ring rank -> ``[B, 2c, h, D]``.

    At most two K/V blocks (the one attended, the one arriving) are alive in the forward; in the backward also
    this step's dK/dV share, the accumulator arriving and the one leaving.
    """

    @staticmethod
    def forward(
        ctx: Any, query: Tensor, key: Tensor, value: Tensor, sinks: Tensor | None, plan: RingPlan, group: ProcessGroup,
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
        received, waits = travelling
        _wait(waits)
        grad_key, grad_value = (g.to(t.dtype) for g, t in zip(received, (key, value)))
        return grad_query.to(query.dtype), grad_key, grad_value, grad_sinks, None, None, None


def ring_attention(
    query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, group: ProcessGroup, ring_size: int,
    ring_rank: int, *, scale: float | None = None, window: int | None = None, sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention of this ring rank's zigzag chunks against the whole sequence, exact (see the module docstring).

    Args:
        query: ``[B, 2c, h, D]``, this ring rank's chunks ``ring_rank`` and ``2 * ring_size - 1 - ring_rank``.
        key, value: ``[B, 2c, kv_h, D]``, ``h`` a multiple of ``kv_h``.
        documents: the documents of the whole rows, in sequence order (``None``: one per row).
        group: the ring group (``ring_size`` ranks, this one at ``ring_rank``).
        scale: softmax scale (``None``: ``D ** -0.5``); window: sliding window as in :func:`ulysses_attention`.
        sinks: ``[h]`` attention sink logits of the query heads (gpt-oss): merged after the blocks as one more
            logit per head whose value is zero; its gradient is this ring rank's queries' share.

    Returns ``[B, 2c, h, D]``; gradients flow to ``query``, ``key`` and ``value`` of every ring rank.
    """
    batch, local = query.shape[:2]
    plan = ring_plan(documents, batch, local * ring_size, ring_size, ring_rank, window)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(query, key, value, sinks, plan, group, scale)
