"""The SDPA backend: ``torch.nn.functional.scaled_dot_product_attention`` without masks wherever possible.

Packed rows run documents of one *length class* together: each document is padded at its end to the length of
its class and the class runs as one batched causal call ``[num_documents, length, h, D]``, with no mask. Padding
after the real tokens of a causal document changes nothing for them (no real query reaches a later key), and its
outputs are dropped, so it gets no gradient. Classes keep :data:`SIGNIFICANT_BITS` leading bits of the length
(less than 25% padding), so a row runs at most about ``4 * log2(N)`` calls per layer, and one call when its
documents have one length (a 128k row of 64-token documents: 1 call, where one call per document is 2048).
The plan (which token goes to which slot of which class) is built on the host once per batch and kept with the
:class:`~lightning_ulysses.attention.documents.Documents`; the token mixers of hybrid models run their packed
documents with the same plan and :func:`run_packed` (:mod:`lightning_ulysses.hf.mixers.core`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_ulysses.attention.core import equal_head_dims, no_window_if_off, refuse_dropout_with_lse, softmax_scale
from lightning_ulysses.attention.documents import Documents

SIGNIFICANT_BITS = 3
"""A document's length class keeps this many leading bits of its length: padding is below ``2 ** (1 - bits)``
of the length (25%)."""


def length_class(length: int, significant_bits: int | None) -> int:
    """``length`` rounded up to keep ``significant_bits`` leading bits (``None``: ``length`` itself)."""
    if significant_bits is None:
        return length
    step = 1 << max(length.bit_length() - significant_bits, 0)
    return -(-length // step) * step


@dataclass(frozen=True)
class LengthClass:
    """The documents of one length class: one batched causal call ``[num_documents, length, h, D]``."""

    length: int
    gather: Tensor  # [num_documents * length] long: the token of each slot (padding slots read token 0)
    keep: Tensor  # [real tokens] long: the slots that hold real tokens


@dataclass(frozen=True)
class PackedPlan:
    """How the flattened ``[B * N]`` tokens of packed rows run: the length classes, and ``order [B * N]`` long,
    each token's row in the concatenation of the classes' kept slots."""

    classes: tuple[LengthClass, ...]
    order: Tensor


def plan_packed(documents: Documents, significant_bits: int | None = SIGNIFICANT_BITS) -> PackedPlan:
    """The length classes of ``documents`` (built on the host from ``documents.offsets``; no host sync)."""
    offsets = torch.tensor(documents.offsets)
    begins, lengths = offsets[:-1], offsets.diff()
    classes = torch.tensor([length_class(n, significant_bits) for n in lengths.tolist()])
    device = documents.cu_seqlens.device
    planned, kept_tokens = [], []
    for length in classes.unique().tolist():
        members = (classes == length).nonzero().flatten()
        slots = torch.arange(length)
        tokens = begins[members, None] + slots  # [num_documents, length]
        real = (slots < lengths[members, None]).flatten()
        kept_tokens.append(tokens.flatten()[real])
        gather = torch.where(real, tokens.flatten(), 0)
        planned.append(LengthClass(length, gather.to(device), real.nonzero().flatten().to(device)))
    order = torch.empty(int(offsets[-1]), dtype=torch.long)
    order[torch.cat(kept_tokens)] = torch.arange(order.numel())
    return PackedPlan(tuple(planned), order.to(device))


def packed_plan(documents: Documents, significant_bits: int | None = SIGNIFICANT_BITS) -> PackedPlan:
    """The :func:`plan_packed` of ``documents``, built once and kept with them."""
    return documents.plan(("sdpa", significant_bits), lambda d: plan_packed(d, significant_bits))


def causal_mask(query_index: Tensor, key_index: Tensor, window: int | None) -> Tensor:
    """``[n_q]``, ``[n_k]`` token indices -> ``[n_q, n_k]`` bool: the key is the query or before it, and
    fewer than ``window`` tokens back."""
    distance = query_index[:, None] - key_index[None, :]
    mask = distance >= 0
    return mask if window is None else mask & (distance < window)


class DenseKernel(Protocol):
    """A kernel tried before SDPA's own choice on each dense call: ``[b, h, n, d]`` query, key and value (GQA when
    ``gqa``), ``mask`` bool ``[n_q, n_k]`` or ``None`` for causal -> ``[b, h, n_q, d]``, or ``None`` where it does not
    cover the call (which then runs as SDPA alone would run it)."""

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float, dropout_p: float, gqa: bool
    ) -> Tensor | None: ...


def needs_repeated_kv(query: Tensor, key: Tensor, mask: Tensor | None) -> bool:
    """On CUDA, GQA runs fused only in the flash kernel (fp16/bf16, no mask); otherwise SDPA would pick the math
    kernel (``[N, N]`` scores) for ``enable_gqa``, so the K/V heads are repeated for the memory-efficient one."""
    return query.is_cuda and query.shape[1] != key.shape[1] and (query.dtype == torch.float32 or mask is not None)


def sdpa_with_lse(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float | None
) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention without dropout that also returns the log-sum-exp.

    ``[b, h, n, d]`` layout, one head size for the query, key and value (see
    :func:`~lightning_ulysses.attention.core.equal_head_dims`), GQA allowed; ``mask``: bool ``[n_q, n_k]``, ``None``
    for causal. Returns the output and ``[b, h, n_q]`` fp32; only the output is differentiable. On CPU this is the
    flash kernel that ``F.scaled_dot_product_attention`` runs; on CUDA the memory-efficient one, which has no GQA
    (the K/V heads are repeated) and wants its additive mask 8-aligned and 4-D, as ``F.scaled_dot_product_attention``
    makes it.
    """
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, float("-inf"))
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, mask is None, attn_mask=bias, scale=scale
        )
    key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (key, value))
    if bias is not None:
        n_k = bias.shape[-1]
        bias = F.pad(bias, (0, -n_k % 8))[:, :n_k].expand(query.shape[0], query.shape[1], -1, -1)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, 0.0, mask is None, scale=scale
    )[:2]
    return out, lse[..., : query.shape[2]]  # the kernel pads it to a multiple of 32 queries


def _cat_tokens(pieces: list[tuple[Tensor, ...]], dim: int = 1) -> tuple[Tensor, ...]:
    """Concatenate the outputs (and log-sum-exps) of consecutive token spans."""
    return tuple(torch.cat(parts, dim=dim) for parts in zip(*pieces))


def run_packed(
    plan: PackedPlan, streams: Sequence[Tensor], run: Callable[..., tuple[Tensor, ...]]
) -> tuple[Tensor, ...]:
    """``run`` (causal along the sequence: ``[b, n, ...]`` streams -> ``[b, n, ...]`` results, as attention's query,
    key, value -> output and maybe log-sum-exp) on each length class of packed ``[B, N, ...]`` rows, each document
    a row of its own; results in token order, ``[B * N, ...]``."""
    flat = [t.flatten(0, 1) for t in streams]  # [B * N, ...]
    kept = []
    for cls in plan.classes:
        batch = (t.index_select(0, cls.gather).unflatten(0, (-1, cls.length)) for t in flat)
        kept.append(tuple(r.flatten(0, 1).index_select(0, cls.keep) for r in run(*batch)))
    return tuple(t.index_select(0, plan.order) for t in _cat_tokens(kept, dim=0))


def sdpa_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    documents: Documents | None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    return_lse: bool = False,
    significant_bits: int | None = SIGNIFICANT_BITS,
    first_choice: DenseKernel | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal attention with ``torch.nn.functional.scaled_dot_product_attention``.

    Single-document rows run one batched causal call; packed rows one batched causal call per length class
    (:func:`plan_packed`, built once per batch and ``significant_bits``). A document longer than a sliding
    ``window`` runs in query blocks of ``window`` tokens with ``[window, 2 * window]`` band masks: exact, no
    ``[N, N]`` mask. Every call holds all the keys of its queries, so with ``return_lse`` each returns its
    queries' log-sum-exp too (:func:`sdpa_with_lse`). No host sync once the plan exists. A value head size other
    than the query's (MLA) runs zero-padded to one head size
    (:func:`~lightning_ulysses.attention.core.equal_head_dims`): torch's flash kernels (CPU and CUDA) want one; on
    CPU SDPA would otherwise run its ``[N, N]`` math kernel, and on CUDA GQA would lose its fused kernel
    (:func:`needs_repeated_kv`). ``first_choice`` runs each call without the log-sum-exp that it covers (SDPA's cuDNN
    backend: :mod:`lightning_ulysses.attention.cudnn`).
    """
    refuse_dropout_with_lse(return_lse, dropout_p)
    window, scale, value_dim = no_window_if_off(window), softmax_scale(query, scale), value.shape[-1]
    query, key, value = equal_head_dims(query, key, value)

    def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, ...]:  # [b, n, h, d]; None: causal
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if return_lse:
            return tuple(t.transpose(1, 2) for t in sdpa_with_lse(q, k, v, mask, scale))
        gqa = q.shape[1] != k.shape[1]
        if first_choice is not None:
            out = first_choice(q, k, v, mask, scale, dropout_p, gqa)
            if out is not None:
                return (out.transpose(1, 2),)
        if needs_repeated_kv(q, k, mask):
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            gqa = False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
        )
        return (out.transpose(1, 2),)

    def causal(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        n = q.shape[1]
        if window is None or window >= n:
            return sdpa(q, k, v, None)
        # query blocks of `window` tokens, each against the keys it can reach: O(n * window) masks
        blocks = []
        for start in range(0, n, window):
            end, first = min(start + window, n), max(start - window + 1, 0)
            index = torch.arange(first, end, device=q.device)
            mask = causal_mask(index[start - first :], index, window)
            blocks.append(sdpa(q[:, start:end], k[:, first:end], v[:, first:end], mask))
        return _cat_tokens(blocks)

    if documents is None or documents.one_per_row:
        results = causal(query, key, value)
    else:
        results = run_packed(packed_plan(documents, significant_bits), (query, key, value), causal)
    out = results[0].view_as(query)[..., :value_dim]  # [B, N, h, D_v]
    return (out, results[1].view(query.shape[:3])) if return_lse else out
