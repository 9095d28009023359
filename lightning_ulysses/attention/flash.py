"""flash-attn 2 and 3: one batched call, or the varlen kernel over the flattened tokens of packed rows."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_ulysses.attention.core import equal_head_dims, no_window_if_off, refuse_dropout_with_lse, softmax_scale
from lightning_ulysses.attention.documents import Documents

FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes flash-attn's kernels run."""


def refuse_unsupported_dtype(name: str, dtype: torch.dtype) -> None:
    """Raise, naming what to change, when flash backend ``name`` is asked to compute in ``dtype``."""
    if dtype not in FLASH_DTYPES:
        raise ValueError(
            f"attn_implementation={name!r} runs fp16 and bf16 only, and this run computes in {dtype}: train in bf16 "
            "(Trainer(precision='bf16-mixed')) or choose attn_implementation='sdpa' "
            "(or 'auto', which follows the dtype)."
        )


def _flash_window(window: int | None) -> tuple[int, int]:
    window = no_window_if_off(window)
    return (-1, -1) if window is None else (window - 1, 0)


def _flash(
    functions: tuple[Any, Any],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    documents: Documents | None,
    return_lse: bool,
    scale: float | None,
    **options: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """flash-attn 2 or 3 (``functions``: its ``flash_attn_func`` and ``flash_attn_varlen_func``): one batched call,
    or the varlen kernel over the flattened tokens of packed rows with ``cu_seqlens``. A value head size other than
    the query's (MLA) runs zero-padded to one (:func:`~lightning_ulysses.attention.core.equal_head_dims`), as
    transformers does for flash-attn: flash-attn 2 has one head size, flash-attn 3 only some pairs."""
    func, varlen_func = functions
    options["softmax_scale"], value_dim = softmax_scale(query, scale), value.shape[-1]
    query, key, value = equal_head_dims(query, key, value)
    if return_lse:
        options["return_attn_probs"] = True  # (out, softmax_lse, ...): flash-attn >= 2.6, FA3 since 2025-08
    if documents is None or documents.one_per_row:
        result = func(query, key, value, **options)
    else:
        result = varlen_func(
            *(t.flatten(0, 1) for t in (query, key, value)),
            cu_seqlens_q=documents.cu_seqlens,
            cu_seqlens_k=documents.cu_seqlens,
            max_seqlen_q=documents.max_seqlen,
            max_seqlen_k=documents.max_seqlen,
            **options,
        )
    out, lse = result[:2] if isinstance(result, tuple) else (result, None)  # early FA3 releases always return lse
    out = out.view_as(query)[..., :value_dim]  # [B, N, h, D_v]
    if not return_lse:
        return out
    lse = lse.transpose(1, 2) if lse.dim() == 3 else lse.t().view(query.shape[:3])  # [B, h, N] or varlen [h, B * N]
    # flash-attn's autograd drops any gradient that reaches its log-sum-exp: detached, so none is expected there
    return out, lse.detach()


def flash_attention_2(
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
    """flash-attn 2 (CUDA, fp16/bf16); packed rows use the varlen kernel with ``cu_seqlens``."""
    refuse_unsupported_dtype("flash_attention_2", query.dtype)
    import flash_attn

    refuse_dropout_with_lse(return_lse, dropout_p)
    return _flash(
        (flash_attn.flash_attn_func, flash_attn.flash_attn_varlen_func),
        query,
        key,
        value,
        documents,
        return_lse,
        scale,
        dropout_p=dropout_p,
        causal=True,
        window_size=_flash_window(window),
    )


def flash_attention_3(
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
    """flash-attn 3 (Hopper, ``flash_attn_interface``, fp16/bf16); no dropout."""
    refuse_unsupported_dtype("flash_attention_3", query.dtype)
    import flash_attn_interface

    if dropout_p:
        raise ValueError("flash_attention_3 has no attention dropout; set the model's attention_dropout to 0.")
    return _flash(
        (flash_attn_interface.flash_attn_func, flash_attn_interface.flash_attn_varlen_func),
        query,
        key,
        value,
        documents,
        return_lse,
        scale,
        causal=True,
        window_size=_flash_window(window),
    )
