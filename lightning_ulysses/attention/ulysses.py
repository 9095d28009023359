"""The public entry point: causal attention over a sequence sharded across the ranks of an SP group."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import cast

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_ulysses.attention.backends import CORE_ATTENTION, prepare_plans
from lightning_ulysses.attention.collectives import heads_to_sequence, sequence_to_heads
from lightning_ulysses.attention.core import CoreAttention, no_window_if_off
from lightning_ulysses.attention.documents import Documents, documents_of
from lightning_ulysses.attention.head_chunks import HeadChunks, chunked_ulysses
from lightning_ulysses.attention.ring import ring_attention, ring_plan
from lightning_ulysses.attention.sinks import sink_attention
from lightning_ulysses.attention.spans import Spans, spanned, spans_of
from lightning_ulysses.groups import SequenceParallelGroupLike, SequenceParallelGroups
from lightning_ulysses.heads import HeadLayout, plan_heads, select_heads


def plan_batch(
    position_ids: Tensor,
    group: SequenceParallelGroups,
    attn_implementation: str,
    patterns: Iterable[tuple[int | None, int | None]],
) -> None:
    """Find the documents of a batch and build backend ``attn_implementation``'s plans for every ``(chunk, window)``
    pattern its layers use, before the first layer (collective over ``group``: the position ids are gathered).

    ``position_ids`` is the ``[B, N/P]`` shard tensor the layers will receive (see
    :func:`~lightning_ulysses.attention.documents.documents_of`); afterwards no layer, forward, backward or
    recomputation, synchronises with the host. Under Ulysses x Ring the plans are the ring's chunk pairs.
    """
    for chunk, window in patterns:
        window = no_window_if_off(window)
        documents = documents_of(position_ids, group, chunk)
        if group.ring is None:
            prepare_plans(attn_implementation, documents, window)
        else:
            batch, seq_len = documents.starts.shape
            ring_plan(documents, batch, seq_len, group.ring_size, dist.get_rank(group.ring), window)


def ulysses_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: SequenceParallelGroupLike,
    attn_implementation: str | CoreAttention = "sdpa",
    position_ids: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    chunk: int | None = None,
    sinks: Tensor | None = None,
    head_chunks: HeadChunks | None = None,
    bidirectional: Tensor | None = None,
    attn_fn: str | CoreAttention | None = None,
) -> Tensor:
    """Causal attention over a sequence sharded across the ranks of ``group``, any head count.

    Args:
        query: ``[B, N/P, H, D]``, this rank's tokens, all heads.
        key: ``[B, N/P, H_kv, D]``, ``H`` a multiple of ``H_kv``.
        value: ``[B, N/P, H_kv, D_v]``: any value head size (MLA: DeepSeek V3's is 128, its ``D`` 192).
        group: the SP groups (``strategy.groups``, a :class:`~lightning_ulysses.groups.SequenceParallelGroups`), a
            ``DeviceMesh`` (``strategy.device_mesh``; a 1-D mesh: plain Ulysses over its ranks), or ``None``: locally
            (a ``ProcessGroup`` is deprecated, see :meth:`~lightning_ulysses.groups.SequenceParallelGroups.of`). With
            a ring (``UlyssesStrategy(ring_size > 1)``), Ulysses runs inside its Ulysses group and ring attention
            across its ring (:mod:`lightning_ulysses.attention.ring`); the shards are then the zigzag ones of
            :func:`~lightning_ulysses.sharding.shard_index`. The groups object also keeps the batch's documents (one
            all-gather per batch, not per layer) and reports the all-to-alls to its observer.
        attn_implementation: the core attention backend, by name (``"sdpa"``, ``"flash_attention_2"``,
            ``"flash_attention_3"``, ``"flex_attention"``: ``UlyssesStrategy(attn_implementation=...)``'s) or a
            callable with the :class:`CoreAttention` signature.
        position_ids: ``[B, N/P]`` global position ids of this rank's tokens. They delimit packed
            documents; ``None`` treats every row as one document.
        scale: softmax scale (``None``: ``D ** -0.5``).
        dropout_p: attention dropout probability.
        window: sliding window; a token attends to itself and the ``window - 1`` tokens before it
            (``None`` or ``0``: unbounded).
        chunk: chunked attention (Llama 4's ``attention_chunk_size``): a token attends only to the tokens of
            its document whose position ids fall in its chunk (``position_id // chunk``); needs ``position_ids``.
        sinks: ``[H]`` attention sink logits, one per query head (gpt-oss's ``s_aux``; see
            :func:`sink_attention`); no dropout with them.
        head_chunks: run the all-to-alls and the attention in that many chunks of each rank's heads, one fused
            all-to-all per chunk and direction, recomputed in the backward (``"auto"``: from the shapes; ``None``:
            all heads at once, one all-to-all in (q, k and v together) and one out). See
            :mod:`~lightning_ulysses.attention.head_chunks`.
        bidirectional: ``[B, N/P]`` bool, this rank's tokens that belong to bidirectional spans: each maximal run of
            them inside a document attends to itself both ways (Gemma 3's image tokens; see
            :mod:`~lightning_ulysses.attention.spans`); needs ``position_ids``; not with ``chunk``, ``sinks``,
            attention dropout or a ring.
        attn_fn: deprecated name of ``attn_implementation``.

    Returns:
        ``[B, N/P, H, D_v]``: the attention output of this rank's tokens. Gradients flow back to
        ``query``, ``key`` and ``value`` on every rank through the inverse all-to-alls. ``sinks`` receives on
        each rank the gradient of the heads that rank attended (for the tokens of every rank): summed over the
        group, as replicated weights are, it is whole.
    """
    if attn_fn is not None:
        warnings.warn(
            "ulysses_attention(attn_fn=...) is deprecated: pass attn_implementation=...",
            DeprecationWarning,
            stacklevel=2,
        )
        attn_implementation = attn_fn
    core = CORE_ATTENTION[attn_implementation] if isinstance(attn_implementation, str) else attn_implementation
    groups = SequenceParallelGroups.of(group)
    if chunk is not None and position_ids is None:
        raise ValueError("Chunked attention needs the position_ids that number the chunks.")
    if sinks is not None and (sinks.shape != (query.shape[2],) or dropout_p):
        raise ValueError(
            f"Attention sinks are one logit per query head, shape ({query.shape[2]},), and run without attention "
            f"dropout; got shape {tuple(sinks.shape)} and dropout_p={dropout_p}."
        )
    window = no_window_if_off(window)
    documents = None if position_ids is None else documents_of(position_ids, groups, chunk)
    if bidirectional is not None:
        if documents is None:
            raise ValueError("Bidirectional spans need the position_ids that delimit the documents they live in.")
        spans = spans_of(bidirectional, documents, groups)
        check_spans_supported(spans, chunk, sinks, dropout_p, groups.ring is not None)
    if groups.ring is not None:
        check_ring_supported(attn_implementation, dropout_p)
        return _ulysses_x_ring(query, key, value, groups, documents, scale, window, sinks, head_chunks)
    observer, sp_group, sp_size = groups.observer, groups.sp, groups.topology.sp_size
    layout = plan_heads(query.shape[2], key.shape[2], sp_size)

    def attend(q: Tensor, k: Tensor, v: Tensor, head_sinks: Tensor | None) -> Tensor:
        if head_sinks is None:
            # without return_lse: the output alone
            return cast(Tensor, core(q, k, v, documents, scale=scale, dropout_p=dropout_p, window=window))
        return sink_attention(core, q, k, v, documents, head_sinks, scale=scale, window=window)

    if bidirectional is not None and spans.spans:
        attend = spanned(attend, spans, scale, window)

    if sp_size == 1:
        return attend(query, key, value, sinks)
    assert sp_group is not None  # sp_size > 1: a process group of that many ranks
    if head_chunks is not None:
        return chunked_ulysses(
            query, key, value, sinks, layout, sp_group, attend, head_chunks, random=dropout_p > 0, observer=observer
        )
    sinks = _sinks_of_rank(sinks, layout, sp_group)
    query, key, value = sequence_to_heads(  # [B, N, h, D], [B, N, kv, D], [B, N, kv, D_v]: one all-to-all
        *(select_heads(t, slots) for t, slots in _slots(query, key, value, layout)), group=sp_group, observer=observer
    )
    out = attend(query, key, value, sinks)  # [B, N, h, D_v]
    return select_heads(heads_to_sequence(out, sp_group, observer), layout.output_slots)  # [B, N/P, H, D_v]


def check_ring_supported(attn_implementation: str | CoreAttention, dropout_p: float) -> None:
    """Refuse what Ulysses x Ring does not run (yet): core backends other than SDPA (the ring runs its own block
    kernels, :mod:`~lightning_ulysses.attention.ring_blocks`, which return the log-sum-exp and take it back in their
    backward) and attention dropout."""
    unsupported = []
    if attn_implementation not in ("sdpa", CORE_ATTENTION["sdpa"]):
        unsupported.append(
            f"the attention backend {attn_implementation!r} (the ring runs SDPA-equivalent block kernels)"
        )
    if dropout_p:
        unsupported.append(f"attention dropout (dropout_p={dropout_p})")
    if unsupported:
        raise ValueError(
            f"Ulysses x Ring (ring_size > 1) does not support {' or '.join(unsupported)}. Use ring_size=1 (Ulysses "
            "only), or attn_implementation='sdpa' without attention dropout."
        )


def plan_spans(flags: Tensor, position_ids: Tensor, group: SequenceParallelGroups) -> None:
    """Find the batch's bidirectional spans (:mod:`~lightning_ulysses.attention.spans`) from the ``[B, N/P]`` shard
    ``flags`` before the first layer (collective over ``group``; one host sync), and refuse them under a ring."""
    spans = spans_of(flags, documents_of(position_ids, group), group)
    check_spans_supported(spans, None, None, 0.0, group.ring is not None)


def check_spans_supported(spans: Spans, chunk: int | None, sinks: Tensor | None, dropout_p: float, ring: bool) -> None:
    """Refuse what bidirectional spans (:mod:`~lightning_ulysses.attention.spans`) do not run with (yet); a batch
    without any span runs everywhere."""
    if not spans.spans:
        return
    unsupported = [
        name
        for name, present in (
            ("chunked attention", chunk is not None),
            ("attention sinks", sinks is not None),
            (f"attention dropout (dropout_p={dropout_p})", bool(dropout_p)),
            ("Ulysses x Ring (ring_size > 1)", ring),
        )
        if present
    ]
    if unsupported:
        raise ValueError(
            "Bidirectional spans (image tokens that attend to each other both ways, as Gemma 3's) do not run with "
            f"{' or '.join(unsupported)}; use ring_size=1 and no attention dropout, or train on text only."
        )


def _slots(query: Tensor, key: Tensor, value: Tensor, layout: HeadLayout) -> list[tuple[Tensor, tuple[int, ...]]]:
    return [(query, layout.query_slots), (key, layout.kv_slots), (value, layout.kv_slots)]


def _sinks_of_rank(sinks: Tensor | None, layout: HeadLayout, group: ProcessGroup) -> Tensor | None:
    """The sinks ``[H] -> [h]`` of this rank's query slots in ``group``, inert copies included (their outputs are
    dropped, so no gradient reaches them)."""
    if sinks is None:
        return None
    first = dist.get_rank(group) * layout.heads_per_rank
    return select_heads(sinks, layout.query_slots[first : first + layout.heads_per_rank], dim=0)


def _ulysses_x_ring(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    groups: SequenceParallelGroups,
    documents: Documents | None,
    scale: float | None,
    window: int | None,
    sinks: Tensor | None,
    head_chunks: HeadChunks | None = None,
) -> Tensor:
    """Ulysses inside ``groups.ulysses`` (all-to-alls to the ring rank's two zigzag chunks, its share of the heads),
    ring attention across ``groups.ring``, and back: ``[B, N/P, H, D]`` queries and keys, ``[B, N/P, H, D_v]`` values
    -> ``[B, N/P, H, D_v]``."""
    ulysses, ring, observer = groups.ulysses, groups.ring, groups.observer
    assert ring is not None  # called with a ring only
    layout = plan_heads(query.shape[2], key.shape[2], dist.get_world_size(ulysses))
    if head_chunks is not None:

        def attend(q: Tensor, k: Tensor, v: Tensor, head_sinks: Tensor | None) -> Tensor:
            return ring_attention(
                q,
                k,
                v,
                documents,
                ring,
                groups.ring_size,
                dist.get_rank(ring),
                scale=scale,
                window=window,
                sinks=head_sinks,
            )

        # ulysses: a mesh with a ring has a ulysses axis (were it None, dist's default group)
        return chunked_ulysses(
            query,
            key,
            value,
            sinks,
            layout,
            ulysses,  # type: ignore[arg-type]
            attend,
            head_chunks,
            observer=observer,
        )
    sinks = _sinks_of_rank(sinks, layout, ulysses)  # type: ignore[arg-type]  # as above
    query, key, value = sequence_to_heads(  # [B, N/R, h, D] ...: one all-to-all
        *(select_heads(t, slots) for t, slots in _slots(query, key, value, layout)), group=ulysses, observer=observer
    )
    out = ring_attention(
        query,
        key,
        value,
        documents,
        ring,
        groups.ring_size,
        dist.get_rank(ring),
        scale=scale,
        window=window,
        sinks=sinks,
    )
    return select_heads(heads_to_sequence(out, ulysses, observer), layout.output_slots)  # [B, N/P, H, D_v]
