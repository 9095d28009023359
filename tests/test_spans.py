"""Bidirectional spans (lightning_ulysses.attention.spans) against a dense mask built as transformers builds Gemma 3's.

Whole sequence, one process: packed documents, a span cut by a document start, spans at a row's start and end,
windows wider than, cutting into and narrower than a span, GQA; outputs and the gradients of q, k and v.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_ulysses.attention import Documents, ulysses_attention
from lightning_ulysses.attention.spans import find_spans

# [B=2, N=24]: row 0 holds documents [0, 10) and [10, 24), row 1 one document
POSITIONS = torch.tensor([[*range(10), *range(14)], list(range(24))])
FLAGS = torch.zeros(2, 24, dtype=torch.bool)
FLAGS[0, 2:6] = True  # inside the first document
FLAGS[0, 8:13] = True  # crosses the document start at 10: two spans
FLAGS[0, 20:24] = True  # ends the row
FLAGS[1, 0:3] = True  # starts the row
FLAGS[1, 9:19] = True  # longer than the small windows


def dense_mask(positions: torch.Tensor, flags: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[B, 1, N, N]``: OR(causal, same span) inside each document, AND the window's lower bound (Gemma 3)."""
    n = positions.shape[1]
    q, kv = torch.arange(n)[:, None], torch.arange(n)[None, :]
    documents = (positions == 0).long().cumsum(1)
    same_document = documents[:, :, None] == documents[:, None, :]
    run_start = flags & ~F.pad(flags, (1, 0))[:, :-1] | (flags & (positions == 0))
    span_ids = torch.where(flags, run_start.long().cumsum(1), -1)
    same_span = (span_ids[:, :, None] == span_ids[:, None, :]) & (span_ids[:, :, None] >= 0)
    allowed = ((kv <= q) | same_span) & same_document
    if window is not None:
        allowed &= kv > q - window
    return allowed[:, None]


def test_spans_are_the_runs_inside_each_document() -> None:
    spans = find_spans(FLAGS, Documents.from_position_ids(POSITIONS))
    assert [(s.row, s.start, s.end, s.document) for s in spans] == [
        (0, 2, 6, 0),
        (0, 8, 10, 0),
        (0, 10, 13, 10),
        (0, 20, 24, 10),
        (1, 0, 3, 0),
        (1, 9, 19, 0),
    ]


@pytest.mark.parametrize("window", [None, 64, 6, 3])
def test_spans_equal_the_dense_bidirectional_mask(window: int | None) -> None:
    torch.manual_seed(0)
    query = torch.randn(2, 24, 4, 8, requires_grad=True)
    key, value = (torch.randn(2, 24, 2, 8, requires_grad=True) for _ in range(2))
    out = ulysses_attention(
        query, key, value, group=None, position_ids=POSITIONS, window=window, bidirectional=FLAGS, scale=0.3
    )
    q, k, v = (t.detach().clone().requires_grad_() for t in (query, key, value))
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=dense_mask(POSITIONS, FLAGS, window),
        scale=0.3,
        enable_gqa=True,
    ).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for got, want in ((query, q), (key, k), (value, v)):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    causal = ulysses_attention(query, key, value, group=None, position_ids=POSITIONS, window=window, scale=0.3)
    assert not torch.allclose(causal, out, rtol=1e-3, atol=1e-3)  # the spans change the result


def test_spans_refuse_what_they_do_not_run_with() -> None:
    query = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="position_ids"):
        ulysses_attention(query, query, query, group=None, bidirectional=torch.ones(1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="chunked attention"):
        ulysses_attention(
            query,
            query,
            query,
            group=None,
            position_ids=torch.arange(8)[None],
            chunk=4,
            bidirectional=torch.ones(1, 8, dtype=torch.bool),
        )
