"""The interface every core attention backend implements: full sequence, local heads."""

from __future__ import annotations

from typing import Protocol

import torch.nn.functional as F
from torch import Tensor

from lightning_ulysses.attention.documents import Documents


class CoreAttention(Protocol):
    """``query``/``key [B, N, h or kv_h, D]``, ``value [B, N, kv_h, D_v]`` (``h`` a multiple of ``kv_h``, query head
    ``i`` reading K/V head ``i // (h / kv_h)``; ``D_v`` any value head size, DeepSeek's MLA has 192 / 128), the
    document layout (``None``: one causal document per row) and an optional sliding ``window`` (a query attends to
    itself and the ``window - 1`` tokens before it; ``None`` or ``0``: no window) -> ``[B, N, h, D_v]``; with
    ``return_lse=True`` (``dropout_p=0`` only) also the log-sum-exp of each query's scaled, masked scores,
    ``[B, N, h]`` fp32. ``scale=None`` is ``D ** -0.5``."""

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        documents: Documents | None,
        *,
        scale: float | None,
        dropout_p: float,
        window: int | None,
        return_lse: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]: ...


def refuse_dropout_with_lse(return_lse: bool, dropout_p: float) -> None:
    if return_lse and dropout_p:
        raise ValueError("The log-sum-exp is returned for attention without dropout only (dropout_p=0).")


def softmax_scale(query: Tensor, scale: float | None) -> float:
    """The softmax scale of ``query [..., D]``: ``scale``, or ``D ** -0.5`` when it is ``None``."""
    return query.shape[-1] ** -0.5 if scale is None else scale


def no_window_if_off(window: int | None) -> int | None:
    """A sliding window as the kernels read it: ``None`` for a window switched off, which configs write as ``None``
    or ``0`` (Qwen2-MoE's ``sliding_window`` with ``use_sliding_window=False``)."""
    return window if window else None


def equal_head_dims(query: Tensor, key: Tensor, value: Tensor, *like_value: Tensor) -> tuple[Tensor, ...]:
    """``query``/``key [..., D]`` and ``value [..., D_v]`` zero-padded to one head size ``max(D, D_v)``, for the kernels
    that want one (torch's flash kernels, flash-attn 2); ``like_value`` (an output, its gradient) padded as the value.

    Zero columns add nothing to ``q . k``, and a zero value column gives a zero output column: the scores, the
    log-sum-exp and the first ``D_v`` output columns are the unpadded call's, provided the softmax scale is passed
    explicitly (:func:`softmax_scale` of the unpadded query), and ``F.pad``'s backward drops the padding's gradient.
    """
    qk_dim, value_dim = query.shape[-1], value.shape[-1]
    if qk_dim < value_dim:
        query, key = (F.pad(t, (0, value_dim - qk_dim)) for t in (query, key))
    elif value_dim < qk_dim:
        value, *padded = (F.pad(t, (0, qk_dim - value_dim)) for t in (value, *like_value))
        like_value = tuple(padded)  # as typed (a starred target makes a list); unpacked below either way
    return (query, key, value, *like_value)


def pad_head_dims(
    query: Tensor, key: Tensor, value: Tensor, scale: float | None, minimum: int
) -> tuple[Tensor, Tensor, Tensor, float]:
    """``query``/``key [..., D]`` and ``value [..., D_v]`` zero-padded to head sizes of at least ``minimum`` (for a
    kernel with a smallest head size, like inductor's CUDA flex kernel), and the :func:`softmax_scale` of the unpadded
    query; exact for the reasons :func:`equal_head_dims` gives (the caller cuts the output back to ``D_v``)."""
    scale = softmax_scale(query, scale)
    if query.shape[-1] < minimum:
        query, key = (F.pad(t, (0, minimum - query.shape[-1])) for t in (query, key))
    if value.shape[-1] < minimum:
        value = F.pad(value, (0, minimum - value.shape[-1]))
    return query, key, value, scale
