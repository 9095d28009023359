"""Attention sinks (gpt-oss): a kernel's output rescaled by its log-sum-exp, with that log-sum-exp's exact gradient."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from lightning_ulysses.attention.core import CoreAttention, softmax_scale
from lightning_ulysses.attention.documents import Documents


class _ExactLogSumExp(torch.autograd.Function):
    """Identity on a kernel's log-sum-exp ``lse [B, N, h]`` of ``query [B, N, h, D]`` against ``key [B, N, kv_h, D]``,
    with the exact gradient that kernels do not give it.

    With ``p_ij`` the attention probabilities and ``g_i`` the incoming gradient,
    ``d lse_i / d q_i = scale * sum_j p_ij k_j`` and ``d lse_i / d k_j = scale * p_ij q_i``: the first is attention
    with the keys as values, ``T = attend(q, k, k)``; the second, summed over queries, is the value gradient
    of that call for the output gradient ``scale * g_i * q_i`` (GQA: summed over each K/V head's queries). Both
    come from one more attention forward and backward, run in backward; forward keeps only ``query`` and ``key``,
    which the attention keeps anyway.
    """

    @staticmethod
    def forward(ctx: Any, lse: Tensor, query: Tensor, key: Tensor, attend: Any, scale: float) -> Tensor:
        ctx.save_for_backward(query, key)
        ctx.attend, ctx.scale = attend, scale
        return lse

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        query, key = ctx.saved_tensors
        as_values = key.detach().requires_grad_()
        with torch.enable_grad():
            mean_key = ctx.attend(query.detach(), key.detach(), as_values)  # [B, N, h, D]: sum_j p_ij k_j
        weight = (ctx.scale * grad)[..., None]
        grad_query = (weight * mean_key.detach()).to(query.dtype)
        grad_key = None
        if ctx.needs_input_grad[2]:
            (grad_key,) = torch.autograd.grad(mean_key, as_values, (weight * query).to(mean_key.dtype))
        return None, grad_query, grad_key, None, None


def sink_attention(
    core: CoreAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    documents: Documents | None,
    sinks: Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> Tensor:
    """Attention with sinks (gpt-oss, transformers' ``s_aux``): each query's softmax also runs over one logit
    ``sinks[h]`` whose value is zero, so ``out' = out * sigmoid(lse - sinks[h])``.

    Shapes as the core backends (``query``/``key [B, N, h or kv_h, D]``, ``value [B, N, kv_h, D_v]``), ``sinks [h]``;
    no dropout.
    Exact in the output and in every gradient (``query``, ``key``, ``value``, ``sinks``) with every backend: the
    log-sum-exp gets its gradient from the kernel (flex) or from :class:`_ExactLogSumExp`.
    """
    out, lse = core(query, key, value, documents, scale=scale, dropout_p=0.0, window=window, return_lse=True)
    if not lse.requires_grad:
        attend = functools.partial(core, documents=documents, scale=scale, dropout_p=0.0, window=window)
        lse = _ExactLogSumExp.apply(lse, query, key, attend, softmax_scale(query, scale))
    kept = torch.sigmoid(lse - sinks)  # [B, N, h] (fp32 or wider): the share of the softmax left to the real keys
    return out * kept[..., None].to(out.dtype)
