"""The interface every core attention backend implements: full sequence, local heads."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from lightning_ulysses.attention.documents import Documents


class CoreAttention(Protocol):
    """``query [B, N, h, D]``, ``key``/``value [B, N, kv_h, D]`` (``h`` a multiple of ``kv_h``, query head ``i``
    reading K/V head ``i // (h / kv_h)``), the document layout (``None``: one causal document per row) and an
    optional sliding ``window`` (a query attends to itself and the ``window - 1`` tokens before it) ->
    ``[B, N, h, D]``; with ``return_lse=True`` (``dropout_p=0`` only) also the log-sum-exp of each query's scaled,
    masked scores, ``[B, N, h]`` fp32."""

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None,
        dropout_p: float, window: int | None, return_lse: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]: ...


def refuse_dropout_with_lse(return_lse: bool, dropout_p: float) -> None:
    if return_lse and dropout_p:
        raise ValueError("The log-sum-exp is returned for attention without dropout only (dropout_p=0).")
