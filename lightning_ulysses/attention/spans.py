"""Bidirectional spans: runs of tokens that attend to each other both ways inside causal attention.

Gemma 3 lets the placeholder tokens of one image see each other bidirectionally (transformers'
``create_masks_for_vision_model``): a query inside a span ``[s, e)`` sees the causal keys of its document and the rest
of its span. With a sliding window ``w`` transformers composes ``AND(kv > q - w, OR(causal, same span))``, so its keys
run from ``max(document start, q - w + 1)`` to ``e - 1``.

A span is a maximal run of flagged tokens inside one document (a run crossing a document start is two spans, as
one process computes each document alone). Causal attention is exact for every query outside the spans; the queries
of each span are computed once more against the keys ``[first, e)`` (no causal mask; a band mask only where the
window reaches inside them) and their rows replace the causal ones: ``O(span x keys)`` per span, one SDPA call per
span, no ``[N, N]`` mask. The spans are found on the host once per batch (one host sync, with the documents) and
kept with the documents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_ulysses.attention.collectives import gather_sequence
from lightning_ulysses.attention.documents import Documents
from lightning_ulysses.attention.sdpa import needs_repeated_kv
from lightning_ulysses.groups import SequenceParallelGroups


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of batch row ``row`` attend to each other; ``document`` is where their document
    starts (the first key any of them can see)."""

    row: int
    start: int
    end: int
    document: int


@dataclass(frozen=True)
class Spans:
    """The bidirectional spans of a ``[B, N]`` batch, and ``tokens [sum of span lengths]`` long, the flattened
    ``[B * N]`` index of each span token in span order (where the spans' outputs go)."""

    flags: Tensor  # [B, N/P] bool: the shard tensor they were found from (kept so that its id stays its own)
    spans: tuple[Span, ...]
    tokens: Tensor


def find_spans(flags: Tensor, documents: Documents) -> tuple[Span, ...]:
    """The maximal runs of ``flags [B, N]`` (whole rows) inside each document of ``documents`` (one host sync)."""
    starts_run = flags & ~F.pad(flags, (1, 0))[:, :-1]
    starts_run |= flags & documents.starts  # a document start inside a run starts a new span
    ends_run = flags & ~F.pad(flags, (0, 1))[:, 1:]
    ends_run |= flags & F.pad(documents.starts, (0, 1))[:, 1:]  # ... and ends the one before it
    columns = torch.arange(flags.shape[1], device=flags.device).expand_as(flags)
    document_start = torch.where(documents.starts, columns, 0).cummax(dim=1).values  # [B, N]: its document's start
    begins, ends = starts_run.nonzero(), ends_run.nonzero()
    firsts = document_start[begins[:, 0], begins[:, 1]]
    found = torch.stack([begins[:, 0], begins[:, 1], ends[:, 1] + 1, firsts], dim=1).tolist()  # one host copy
    return tuple(Span(row, start, end, first) for row, start, end, first in found)


def spans_of(flags: Tensor, documents: Documents, group: SequenceParallelGroups) -> Spans:
    """The :class:`Spans` of the ``[B, N/P]`` shard ``flags`` in the whole rows of ``documents``, found once per flags
    tensor and kept with the documents (the first call gathers the flags over ``group``: collective)."""

    def build(documents: Documents) -> Spans:
        whole = gather_sequence(flags, group).bool()
        # the spans are the flagged runs in row-major order, so their tokens are the flagged ones in that order
        return Spans(flags, find_spans(whole, documents), whole.flatten().nonzero().flatten())

    spans = documents.plan(("spans", id(flags)), build)
    assert spans.flags is flags
    return spans


def with_spans(
    out: Tensor, query: Tensor, key: Tensor, value: Tensor, spans: Spans, scale: float | None, window: int | None
) -> Tensor:
    """``out [B, N, h, D_v]`` of causal attention with each span's rows recomputed bidirectionally (see the module
    docstring); ``query [B, N, h, D]``, ``key [B, N, kv_h, D]``, ``value [B, N, kv_h, D_v]``: whole sequence, local
    heads. Differentiable; no host sync."""
    if not spans.spans:
        return out
    rows = []
    for span in spans.spans:
        first = span.document if window is None else max(span.document, span.start - window + 1)
        q = query[span.row, span.start : span.end].transpose(0, 1)  # [h, n, D]
        k, v = (t[span.row, first : span.end].transpose(0, 1) for t in (key, value))
        mask = None
        if window is not None and span.end - window > first:  # the window cuts into some span query's keys
            queries = torch.arange(span.start, span.end, device=query.device)
            keys = torch.arange(first, span.end, device=query.device)
            mask = queries[:, None] - keys[None, :] < window
        if needs_repeated_kv(q[None], k[None], mask):
            k, v = (t.repeat_interleave(q.shape[0] // k.shape[0], dim=0) for t in (k, v))
        attended = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[0] != k.shape[0]
        )
        rows.append(attended.transpose(0, 1))  # [n, h, D_v]
    flat = out.flatten(0, 1).index_copy(0, spans.tokens, torch.cat(rows))
    return flat.view_as(out)


def spanned(
    attend: Callable[..., Tensor], spans: Spans, scale: float | None, window: int | None
) -> Callable[..., Tensor]:
    """``attend`` (``query, key, value, *args -> [B, N, h, D_v]``, causal) with :func:`with_spans` applied to its
    output."""

    def run(query: Tensor, key: Tensor, value: Tensor, *args: object) -> Tensor:
        return with_spans(attend(query, key, value, *args), query, key, value, spans, scale, window)

    return run
