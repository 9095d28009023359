"""The flex backend: ``torch.nn.attention.flex_attention`` through ``torch.compile``, block mask once per batch.

Run eagerly, ``create_block_mask`` builds a dense ``[B, 1, N, N]`` mask and ``flex_attention`` materialises the
scores: quadratic memory. Both run compiled here. The first call compiles for its shapes; the first call with
another sequence length or batch size compiles once more with those dimensions dynamic, and every later shape
reuses that code (``dynamic=True`` from the start would also make the head count symbolic, which inductor's CPU
flex kernel fails to compile for 6 heads in torch 2.13). A new window size compiles once more: it is a constant of
the mask. The ``BlockMask`` is built once per batch and window and kept with the documents. On CUDA the kernel
(``tl.dot``) takes head sizes of 16 and more: smaller ones are zero-padded to 16 (:func:`pad_head_dims`, exact).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from lightning_ulysses.attention.core import no_window_if_off, pad_head_dims
from lightning_ulysses.attention.documents import Documents

CUDA_MIN_HEAD_DIM = 16  # inductor's CUDA flex kernel refuses smaller query/key or value head sizes


@functools.cache
def compiled_flex() -> tuple[Any, Any]:
    """``torch.compile``-d ``create_block_mask`` and ``flex_attention`` (automatic dynamic shapes)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(create_block_mask), torch.compile(flex_attention)


def block_mask(document_ids: Tensor | None, seq_len: int, window: int | None, device: torch.device) -> Any:
    """The causal ``BlockMask`` of ``[B, N]`` rows: inside documents (``document_ids [B, N]``, ``None``: one document
    per row, broadcast over the batch) and, with ``window``, fewer than ``window`` tokens back."""

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        allowed = q >= kv
        if document_ids is not None:
            allowed = allowed & (document_ids[b, q] == document_ids[b, kv])
        if window is not None:
            allowed = allowed & (q - kv < window)
        return allowed

    batch = None if document_ids is None else document_ids.shape[0]
    return compiled_flex()[0](mask_mod, batch, None, seq_len, seq_len, device=device)


def document_block_mask(documents: Documents, window: int | None) -> Any:
    """The :func:`block_mask` of ``documents`` and ``window``, built once and kept with the documents."""
    return documents.plan(
        ("flex", window),
        lambda d: block_mask(None if d.one_per_row else d.document_ids, d.starts.shape[1], window, d.starts.device),
    )


@functools.lru_cache(maxsize=8)
def _rows_block_mask(seq_len: int, window: int | None, device: torch.device) -> Any:
    return block_mask(None, seq_len, window, device)


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    documents: Documents | None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Compiled ``flex_attention`` with a causal document block mask; its log-sum-exp is differentiable.

    The block mask is built once per batch (kept with ``documents``; without documents, once per length and
    window). torch has no flex backward on CPU, and its compiled CPU kernel no log-sum-exp: with ``return_lse`` on
    CPU the kernel runs eagerly (quadratic memory; CPU flex is for tests). flex takes a value head size other than
    the query's (MLA) as it is; on CUDA, head sizes under 16 are zero-padded to 16 (:func:`pad_head_dims`)."""
    if dropout_p:
        raise ValueError("flex_attention has no attention dropout; set the model's attention_dropout to 0.")
    window = no_window_if_off(window)
    if documents is None:
        mask = _rows_block_mask(query.shape[1], window, query.device)
    else:
        mask = document_block_mask(documents, window)
    options: dict[str, Any] = {}
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    if return_lse:
        from torch.nn.attention.flex_attention import AuxRequest

        options["return_aux"] = AuxRequest(lse=True)
    # inductor's CPU flex kernel is inference-only and has no log-sum-exp: there (sinks on CPU) flex runs eagerly
    eager = query.device.type == "cpu" and return_lse
    value_dim = value.shape[-1]
    if query.is_cuda:
        query, key, value, scale = pad_head_dims(query, key, value, scale, CUDA_MIN_HEAD_DIM)
    result = (eager_flex if eager else compiled_flex()[1])(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        block_mask=mask,
        scale=scale,
        enable_gqa=query.shape[2] != key.shape[2],
        **options,
    )
    if return_lse:
        out, aux = result
        return out[..., :value_dim].transpose(1, 2), aux.lse.transpose(1, 2)
    return result[..., :value_dim].transpose(1, 2)
