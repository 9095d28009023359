"""All-to-all attention: sequence-sharded in, head-sharded local attention, sequence-sharded out.

Per attention layer, with ``P`` ranks in the SP group::

    q, k, v  [B, N/P, H, D]  --all-to-all #1-->  [B, N, h, D]   (all tokens, h = ceil(H/P) head slots)
                                                   |  core attention (SDPA, flash-attn, flex)
    out      [B, N/P, H, D]  <--all-to-all #2--  [B, N, h, D]

Heads are independent, so this is exact. Documents (packed samples, padding runs) are read from
the global ``position_ids``: a token starts a document when it is first in its row or its position
id is 0 (see :mod:`lightning_ulysses.sharding`); attention never crosses a document start.

Any head count: heads are laid out on ``sp_size`` equal groups of slots, padded with inert heads and
with K/V heads replicated where needed (:mod:`lightning_ulysses.heads`), so the all-to-alls are even
(gloo refuses uneven splits) and exact.

Each core backend takes ``query [B, N, h, D]``, ``key``/``value [B, N, kv_h, D]`` (``h`` a multiple
of ``kv_h``, query head ``i`` reading K/V head ``i // (h / kv_h)``), the document layout and an optional
sliding ``window`` (a query attends to itself and the ``window - 1`` tokens before it, as in Hugging
Face's Mistral/Qwen2), and returns ``[B, N, h, D]``.
"""

from __future__ import annotations

import importlib.util
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_ulysses.heads import plan_heads, select_heads
from lightning_ulysses.sharding import document_starts


# ----------------------------------------------------------------------------------------------
# document layout
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Documents:
    """Where the documents of a ``[B, N]`` batch start.

    ``cu_seqlens`` holds the offsets of every document in the flattened ``[B * N]`` token axis
    (row starts included) followed by ``B * N``: the varlen format of flash-attn.
    """

    starts: Tensor  # [B, N] bool
    cu_seqlens: Tensor  # [num_documents + 1] int32
    max_seqlen: int

    @classmethod
    def from_position_ids(cls, position_ids: Tensor) -> "Documents":
        starts = document_starts(position_ids)
        offsets = starts.flatten().nonzero().flatten()
        total = torch.tensor([starts.numel()], device=offsets.device, dtype=offsets.dtype)
        cu_seqlens = torch.cat([offsets, total]).to(torch.int32)
        return cls(starts=starts, cu_seqlens=cu_seqlens, max_seqlen=int(cu_seqlens.diff().max()))

    @property
    def one_per_row(self) -> bool:
        """True when every row is a single causal document (no packing, no padding runs)."""
        return self.cu_seqlens.numel() - 1 == self.starts.shape[0]

    @property
    def document_ids(self) -> Tensor:
        """``[B, N]`` long: the index of each token's document inside its row."""
        return self.starts.long().cumsum(dim=1)


# ----------------------------------------------------------------------------------------------
# core attention backends: full sequence, local heads
# ----------------------------------------------------------------------------------------------
class CoreAttention(Protocol):
    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None,
        dropout_p: float, window: int | None,
    ) -> Tensor: ...


SDPA_TILE_TOKENS = 256
"""Packed documents shorter than this share SDPA calls: consecutive documents are grouped into tiles of
at most this many tokens, each one call with a ``[tile, tile]`` block-diagonal causal mask (64 KiB),
instead of one call per document."""


def causal_mask(query_index: Tensor, key_index: Tensor, window: int | None) -> Tensor:
    """``[n_q]``, ``[n_k]`` token indices -> ``[n_q, n_k]`` bool: the key is the query or before it, and
    fewer than ``window`` tokens back."""
    distance = query_index[:, None] - key_index[None, :]
    mask = distance >= 0
    return mask if window is None else mask & (distance < window)


def document_tiles(cu_seqlens: list[int], max_tokens: int) -> list[tuple[int, int, int]]:
    """Group consecutive documents (offsets ``cu_seqlens``) into ``(start, end, num_documents)`` spans of at
    most ``max_tokens`` tokens; a longer document is a span of its own."""
    tiles, start, count = [], cu_seqlens[0], 0
    for begin, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if end - start > max_tokens and count:
            tiles.append((start, begin, count))
            start, count = begin, 0
        count += 1
    tiles.append((start, cu_seqlens[-1], count))
    return tiles


def sdpa_attention(
    query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None = None,
    dropout_p: float = 0.0, window: int | None = None, tile_tokens: int = SDPA_TILE_TOKENS,
) -> Tensor:
    """Causal attention with ``torch.nn.functional.scaled_dot_product_attention``.

    Single-document rows run one batched call. Packed rows run one call per tile of consecutive
    documents (:func:`document_tiles`): a lone document uses SDPA's causal kernel, several use a
    block-diagonal mask of the tile only, so the mask never grows past ``tile_tokens ** 2``. A document
    longer than a sliding ``window`` runs in query blocks of ``window`` tokens with ``[window, 2 * window]``
    band masks: exact, no ``[N, N]`` mask.
    """
    gqa = query.shape[2] != key.shape[2]

    def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:  # [b, n, h, d]; None: causal
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
            scale=scale, dropout_p=dropout_p, enable_gqa=gqa,
        )
        return out.transpose(1, 2)

    def one_document(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
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
        return torch.cat(blocks, dim=1)

    def several_documents(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor) -> Tensor:
        index = torch.arange(q.shape[1], device=q.device)
        mask = causal_mask(index, index, window) & (document_ids[:, None] == document_ids[None, :])
        return sdpa(q, k, v, mask)

    if documents is None or documents.one_per_row:
        return one_document(query, key, value)
    flat = [t.flatten(0, 1)[None] for t in (query, key, value)]  # [1, B * N, h, d]
    document_ids = documents.starts.flatten().cumsum(0)
    pieces = [
        several_documents(*(t[:, s:e] for t in flat), document_ids[s:e]) if count > 1
        else one_document(*(t[:, s:e] for t in flat))
        for s, e, count in document_tiles(documents.cu_seqlens.tolist(), tile_tokens)
    ]
    return torch.cat(pieces, dim=1).view_as(query)


def _flash_window(window: int | None) -> tuple[int, int]:
    return (-1, -1) if window is None else (window - 1, 0)


def flash_attention_2(
    query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None = None,
    dropout_p: float = 0.0, window: int | None = None,
) -> Tensor:
    """flash-attn 2 (CUDA, fp16/bf16); packed rows use the varlen kernel with ``cu_seqlens``."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    options = dict(dropout_p=dropout_p, softmax_scale=scale, causal=True, window_size=_flash_window(window))
    if documents is None or documents.one_per_row:
        return flash_attn_func(query, key, value, **options)
    out = flash_attn_varlen_func(
        *(t.flatten(0, 1) for t in (query, key, value)),
        cu_seqlens_q=documents.cu_seqlens, cu_seqlens_k=documents.cu_seqlens,
        max_seqlen_q=documents.max_seqlen, max_seqlen_k=documents.max_seqlen, **options,
    )
    return out.view_as(query)


def flash_attention_3(
    query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None = None,
    dropout_p: float = 0.0, window: int | None = None,
) -> Tensor:
    """flash-attn 3 (Hopper, ``flash_attn_interface``); no dropout."""
    from flash_attn_interface import flash_attn_func, flash_attn_varlen_func

    if dropout_p:
        raise ValueError("flash_attention_3 has no attention dropout; set the model's attention_dropout to 0.")
    options = dict(softmax_scale=scale, causal=True, window_size=_flash_window(window))
    if documents is None or documents.one_per_row:
        out = flash_attn_func(query, key, value, **options)
    else:
        out = flash_attn_varlen_func(
            *(t.flatten(0, 1) for t in (query, key, value)),
            cu_seqlens_q=documents.cu_seqlens, cu_seqlens_k=documents.cu_seqlens,
            max_seqlen_q=documents.max_seqlen, max_seqlen_k=documents.max_seqlen, **options,
        )
    out = out[0] if isinstance(out, tuple) else out  # some releases also return the log-sum-exp
    return out.view_as(query)


def flex_attention(
    query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None = None,
    dropout_p: float = 0.0, window: int | None = None,
) -> Tensor:
    """``torch.nn.attention.flex_attention`` with a causal document block mask (no CPU backward in torch)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex

    if dropout_p:
        raise ValueError("flex_attention has no attention dropout; set the model's attention_dropout to 0.")
    batch, seq_len = query.shape[:2]
    document_ids = None if documents is None or documents.one_per_row else documents.document_ids

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        allowed = q >= kv
        if document_ids is not None:
            allowed = allowed & (document_ids[b, q] == document_ids[b, kv])
        if window is not None:
            allowed = allowed & (q - kv < window)
        return allowed

    block_mask = create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=str(query.device))
    out = flex(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), block_mask=block_mask, scale=scale,
        enable_gqa=query.shape[2] != key.shape[2],
    )
    return out.transpose(1, 2)

CORE_ATTENTION: dict[str, CoreAttention] = {
    "sdpa": sdpa_attention,
    "flash_attention_2": flash_attention_2,
    "flash_attention_3": flash_attention_3,
    "flex_attention": flex_attention,
}
_REQUIRED_MODULE = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def resolve_attn_implementation(name: str, device_type: str) -> str:
    """Validate a backend name; ``"auto"`` picks flash-attn 2 on CUDA when installed, else SDPA."""
    if name == "auto":
        if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        return "sdpa"
    if name not in CORE_ATTENTION:
        refused = " Eager attention materialises a [N, N] mask per head and is not supported." if name == "eager" else ""
        raise ValueError(
            f"Unsupported attn_implementation {name!r}.{refused} Choose one of: 'auto', "
            + ", ".join(repr(k) for k in CORE_ATTENTION) + "."
        )
    module = _REQUIRED_MODULE.get(name)
    if module is not None and importlib.util.find_spec(module) is None:
        raise ValueError(
            f"attn_implementation={name!r} needs the {module!r} package, which is not installed "
            "(pip install 'lightning-ulysses[flash]' on a CUDA machine), or choose 'sdpa'."
        )
    return name


# ----------------------------------------------------------------------------------------------
# all-to-all
# ----------------------------------------------------------------------------------------------
def all_to_all(x: Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    """Split ``x`` into ``P`` chunks along ``scatter_dim``, send chunk ``j`` to rank ``j`` of ``group``,
    and concatenate the received chunks (in rank order) along ``gather_dim``. Not differentiable."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    send = torch.stack(x.tensor_split(world, dim=scatter_dim))
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send, group=group)
    return torch.cat(receive.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Differentiable :func:`all_to_all`: the gradient takes the inverse all-to-all back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def sequence_to_heads(x: Tensor, group: ProcessGroup) -> Tensor:
    """``[B, N/P, H, D] -> [B, N, H/P, D]``: gather the sequence, scatter the heads."""
    return _AllToAll.apply(x, group, 2, 1)


def heads_to_sequence(x: Tensor, group: ProcessGroup) -> Tensor:
    """``[B, N, H/P, D] -> [B, N/P, H, D]``: gather the heads, scatter the sequence."""
    return _AllToAll.apply(x, group, 1, 2)


def gather_sequence(local: Tensor, group: ProcessGroup | None) -> Tensor:
    """``[B, N/P, ...]`` shards of ``group`` -> ``[B, N, ...]`` in sequence order on every rank of it
    (the inverse of :func:`~lightning_ulysses.shard_batch` for one tensor; not differentiable)."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    return torch.cat(shards, dim=1)


_last_documents: tuple[weakref.ref[Tensor], int, ProcessGroup | None, Documents] | None = None


def documents_of(position_ids: Tensor, group: ProcessGroup | None) -> Documents:
    """The documents of the whole rows whose ``[B, N/P]`` shard of global position ids is ``position_ids``.

    Every attention layer of a forward (and its recomputation under activation checkpointing) receives
    the same ``position_ids`` tensor, so the all-gather and the host sync of finding the document starts
    run once per batch, not once per layer. The last result is kept for the same tensor object at the same
    version (an in-place edit recomputes); every rank of the group sees the same sequence of tensors and
    so takes the same branch, collectives included.
    """
    global _last_documents
    if _last_documents is not None:
        tensor, version, cached_group, documents = _last_documents
        if tensor() is position_ids and version == position_ids._version and cached_group is group:
            return documents
    documents = Documents.from_position_ids(gather_sequence(position_ids, group))
    _last_documents = (weakref.ref(position_ids), position_ids._version, group, documents)
    return documents


# ----------------------------------------------------------------------------------------------
# the public entry point
# ----------------------------------------------------------------------------------------------
def ulysses_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: ProcessGroup | None,
    attn_fn: str | CoreAttention = "sdpa",
    position_ids: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
) -> Tensor:
    """Causal attention over a sequence sharded across the ranks of ``group``, any head count.

    Args:
        query: ``[B, N/P, H, D]``, this rank's tokens, all heads.
        key, value: ``[B, N/P, H_kv, D]``, ``H`` a multiple of ``H_kv``.
        group: the sequence-parallel process group (``strategy.sp_group``); ``None`` runs locally.
        attn_fn: a core backend name (``"sdpa"``, ``"flash_attention_2"``, ``"flash_attention_3"``,
            ``"flex_attention"``) or a callable with the :class:`CoreAttention` signature.
        position_ids: ``[B, N/P]`` global position ids of this rank's tokens. They delimit packed
            documents; ``None`` treats every row as one document.
        scale: softmax scale (``None``: ``D ** -0.5``).
        dropout_p: attention dropout probability.
        window: sliding window; a token attends to itself and the ``window - 1`` tokens before it
            (``None``: unbounded).

    Returns:
        ``[B, N/P, H, D]``: the attention output of this rank's tokens. Gradients flow back to
        ``query``, ``key`` and ``value`` on every rank through the inverse all-to-alls.
    """
    core = CORE_ATTENTION[attn_fn] if isinstance(attn_fn, str) else attn_fn
    sp_size = 1 if group is None else dist.get_world_size(group)
    layout = plan_heads(query.shape[2], key.shape[2], sp_size)
    documents = None if position_ids is None else documents_of(position_ids, group)
    if sp_size == 1:
        return core(query, key, value, documents, scale=scale, dropout_p=dropout_p, window=window)

    query = sequence_to_heads(select_heads(query, layout.query_slots), group)  # [B, N, h, D]
    key, value = (sequence_to_heads(select_heads(t, layout.kv_slots), group) for t in (key, value))
    out = core(query, key, value, documents, scale=scale, dropout_p=dropout_p, window=window)
    return select_heads(heads_to_sequence(out, group), layout.output_slots)  # [B, N/P, H, D]
