"""SDPA's cuDNN backend (``SDPBackend.CUDNN_ATTENTION``): FlashAttention-3-class kernels on Hopper, through torch.

The ``sdpa_cudnn`` backend is the ``sdpa`` backend (:mod:`.sdpa`: length classes for packed rows, query blocks for
sliding windows, zero-padded MLA value heads) with each of its dense calls run by cuDNN where torch's own check,
``torch.backends.cuda.can_use_cudnn_attention``, says cuDNN covers it: CUDA, fp16/bf16, dense 4-D inputs with unit
stride in the head dimension, the head sizes the installed cuDNN takes, GQA, the mask's shape, a GPU cuDNN supports,
and not under ``torch.use_deterministic_algorithms`` (cuDNN's backward is not deterministic). A call it does not
cover runs as the ``sdpa`` backend runs it (flash or memory-efficient kernel): exact either way, never cuDNN on a call
torch does not vouch for. Calls that return the log-sum-exp (sinks, Ulysses x Ring) always run the ``sdpa`` way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_ulysses.attention.documents import Documents
from lightning_ulysses.attention.flash import FLASH_DTYPES
from lightning_ulysses.attention.sdpa import sdpa_attention

HOPPER = (9, 0)
"""The compute capability from which ``attn_implementation="auto"`` prefers cuDNN (H100, H200 and later)."""


def cudnn_attention_available() -> bool:
    """Whether this torch build has cuDNN and its SDPA backend is not switched off."""
    return torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()


def prefers_cudnn(dtype: torch.dtype | None, capability: tuple[int, int] | None) -> bool:
    """Whether ``"auto"`` picks cuDNN: fp16/bf16 on a GPU of compute capability :data:`HOPPER` or later."""
    return dtype in FLASH_DTYPES and capability is not None and capability >= HOPPER and cudnn_attention_available()


def cudnn_covers(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, dropout_p: float, gqa: bool) -> bool:
    """torch's own check that its cuDNN kernel runs this ``[b, h, n, d]`` call (``mask None``: causal). Host tensors
    are not asked about: a CUDA build of torch on a machine without a CUDA driver raises there instead of answering."""
    if not query.is_cuda:
        return False
    params = torch.backends.cuda.SDPAParams(query, key, value, mask, dropout_p, mask is None, gqa)
    return torch.backends.cuda.can_use_cudnn_attention(params)


def cudnn_dense(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float, dropout_p: float, gqa: bool
) -> Tensor | None:
    """One dense SDPA call on cuDNN alone (``[b, h, n, d]``), or ``None`` where cuDNN does not cover it."""
    if not cudnn_covers(query, key, value, mask, dropout_p, gqa):
        return None
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # only cuDNN: an error, never another kernel, if torch disagrees
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
        )


def sdpa_cudnn_attention(
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
    """The ``sdpa`` backend with every dense call that cuDNN covers run by cuDNN (see the module docstring)."""
    return sdpa_attention(
        query,
        key,
        value,
        documents,
        scale=scale,
        dropout_p=dropout_p,
        window=window,
        return_lse=return_lse,
        first_choice=cudnn_dense,
    )
