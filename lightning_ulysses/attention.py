"""All-to-all attention: sequence-sharded in, head-sharded local attention, sequence-sharded out.

Per attention layer, with ``P`` ranks in the SP group::

    q, k, v  [B, N/P, H, D]  --all-to-all #1-->  [B, N, h, D]   (all tokens, h = ceil(H/P) head slots)
                                                   |  core attention (SDPA, flash-attn, flex)
    out      [B, N/P, H, D]  <--all-to-all #2--  [B, N, h, D]

Heads are independent, so this is exact. Documents (packed samples, padding runs) are read from
the global ``position_ids``: a token starts a document when it is first in its row or its position
id is 0 (see :mod:`lightning_ulysses.sharding`); attention never crosses a document start. Chunked
attention (Llama 4) is more documents: every position id divisible by the chunk size starts one.

Any head count: heads are laid out on ``sp_size`` equal groups of slots, padded with inert heads and
with K/V heads replicated where needed (:mod:`lightning_ulysses.heads`), so the all-to-alls are even
(gloo refuses uneven splits) and exact.

Each core backend takes ``query [B, N, h, D]``, ``key``/``value [B, N, kv_h, D]`` (``h`` a multiple
of ``kv_h``, query head ``i`` reading K/V head ``i // (h / kv_h)``), the document layout and an optional
sliding ``window`` (a query attends to itself and the ``window - 1`` tokens before it, as in Hugging
Face's Mistral/Qwen2), and returns ``[B, N, h, D]``; with ``return_lse=True`` (asked with
``dropout_p=0`` only) also the log-sum-exp of each query's scaled, masked scores, ``[B, N, h]`` fp32,
which attention sinks (gpt-oss) need (:func:`sink_attention`).
"""

from __future__ import annotations

import functools
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
    (row starts included) followed by ``B * N``: the varlen format of flash-attn. ``max_position`` is the
    largest position id of the whole rows (a 0-d tensor on their device, read without a host sync): what
    a RoPE whose frequencies depend on the sequence length (dynamic NTK, longrope) must see on every rank.
    """

    starts: Tensor  # [B, N] bool
    cu_seqlens: Tensor  # [num_documents + 1] int32
    max_seqlen: int
    max_position: Tensor  # [] long

    @classmethod
    def from_position_ids(cls, position_ids: Tensor, chunk: int | None = None) -> "Documents":
        """The documents of whole ``[B, N]`` rows of position ids; with ``chunk``, every position id divisible
        by it also starts one, so that a token attends only inside its chunk (Llama 4's chunked attention)."""
        starts = document_starts(position_ids)
        if chunk is not None:
            starts |= position_ids % chunk == 0
        offsets = starts.flatten().nonzero().flatten()
        total = torch.tensor([starts.numel()], device=offsets.device, dtype=offsets.dtype)
        cu_seqlens = torch.cat([offsets, total]).to(torch.int32)
        return cls(starts, cu_seqlens, int(cu_seqlens.diff().max()), position_ids.max())

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
        dropout_p: float, window: int | None, return_lse: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]: ...


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


def _refuse_dropout_with_lse(return_lse: bool, dropout_p: float) -> None:
    if return_lse and dropout_p:
        raise ValueError("The log-sum-exp is returned for attention without dropout only (dropout_p=0).")


def sdpa_with_lse(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float | None
) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention without dropout that also returns the log-sum-exp.

    ``[b, h, n, d]`` layout, GQA allowed; ``mask``: bool ``[n_q, n_k]``, ``None`` for causal. Returns the output
    and ``[b, h, n_q]`` fp32; only the output is differentiable. On CPU this is the flash kernel that
    ``F.scaled_dot_product_attention`` runs; on CUDA the memory-efficient one, which has no GQA (the K/V heads
    are repeated) and wants its additive mask 8-aligned and 4-D, as ``F.scaled_dot_product_attention`` makes it.
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


def _cat_tokens(pieces: list[tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """Concatenate the outputs (and log-sum-exps) of consecutive token spans."""
    return tuple(torch.cat(parts, dim=1) for parts in zip(*pieces))


def sdpa_attention(
    query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None = None,
    dropout_p: float = 0.0, window: int | None = None, return_lse: bool = False, tile_tokens: int = SDPA_TILE_TOKENS,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal attention with ``torch.nn.functional.scaled_dot_product_attention``.

    Single-document rows run one batched call. Packed rows run one call per tile of consecutive
    documents (:func:`document_tiles`): a lone document uses SDPA's causal kernel, several use a
    block-diagonal mask of the tile only, so the mask never grows past ``tile_tokens ** 2``. A document
    longer than a sliding ``window`` runs in query blocks of ``window`` tokens with ``[window, 2 * window]``
    band masks: exact, no ``[N, N]`` mask. Every call holds all the keys of its queries, so with
    ``return_lse`` each returns its queries' log-sum-exp too (:func:`sdpa_with_lse`).
    """
    _refuse_dropout_with_lse(return_lse, dropout_p)
    gqa = query.shape[2] != key.shape[2]

    def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, ...]:  # [b, n, h, d]; None: causal
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if return_lse:
            return tuple(t.transpose(1, 2) for t in sdpa_with_lse(q, k, v, mask, scale))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
        )
        return (out.transpose(1, 2),)

    def one_document(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
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

    def several_documents(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor) -> tuple[Tensor, ...]:
        index = torch.arange(q.shape[1], device=q.device)
        mask = causal_mask(index, index, window) & (document_ids[:, None] == document_ids[None, :])
        return sdpa(q, k, v, mask)

    if documents is None or documents.one_per_row:
        results = one_document(query, key, value)
    else:
        flat = [t.flatten(0, 1)[None] for t in (query, key, value)]  # [1, B * N, h, d]
        document_ids = documents.starts.flatten().cumsum(0)
        results = _cat_tokens([
            several_documents(*(t[:, s:e] for t in flat), document_ids[s:e]) if count > 1
            else one_document(*(t[:, s:e] for t in flat))
            for s, e, count in document_tiles(documents.cu_seqlens.tolist(), tile_tokens)
        ])
    out = results[0].view_as(query)
    return (out, results[1].view(query.shape[:3])) if return_lse else out


def _flash_window(window: int | None) -> tuple[int, int]:
    return (-1, -1) if window is None else (window - 1, 0)


def _flash(
    functions: tuple[Any, Any], query: Tensor, key: Tensor, value: Tensor, documents: Documents | None,
    return_lse: bool, **options: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """flash-attn 2 or 3 (``functions``: its ``flash_attn_func`` and ``flash_attn_varlen_func``): one batched call,
    or the varlen kernel over the flattened tokens of packed rows with ``cu_seqlens``."""
    func, varlen_func = functions
    if return_lse:
        options["return_attn_probs"] = True  # (out, softmax_lse, ...): flash-attn >= 2.6, FA3 since 2025-08
    if documents is None or documents.one_per_row:
        result = func(query, key, value, **options)
    else:
        result = varlen_func(
            *(t.flatten(0, 1) for t in (query, key, value)),
            cu_seqlens_q=documents.cu_seqlens, cu_seqlens_k=documents.cu_seqlens,
            max_seqlen_q=documents.max_seqlen, max_seqlen_k=documents.max_seqlen, **options,
        )
    out, lse = result[:2] if isinstance(result, tuple) else (result, None)  # early FA3 releases always return lse
    out = out.view_as(query)
    if not return_lse:
        return out
    lse = lse.transpose(1, 2) if lse.dim() == 3 else lse.t().view(query.shape[:3])  # [B, h, N] or varlen [h, B * N]
    # flash-attn's autograd drops any gradient that reaches its log-sum-exp: detached, so none is expected there
    return out, lse.detach()


def flash_attention_2(
    query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None = None,
    dropout_p: float = 0.0, window: int | None = None, return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """flash-attn 2 (CUDA, fp16/bf16); packed rows use the varlen kernel with ``cu_seqlens``."""
    import flash_attn

    _refuse_dropout_with_lse(return_lse, dropout_p)
    return _flash(
        (flash_attn.flash_attn_func, flash_attn.flash_attn_varlen_func), query, key, value, documents, return_lse,
        dropout_p=dropout_p, softmax_scale=scale, causal=True, window_size=_flash_window(window),
    )


def flash_attention_3(
    query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None = None,
    dropout_p: float = 0.0, window: int | None = None, return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """flash-attn 3 (Hopper, ``flash_attn_interface``); no dropout."""
    import flash_attn_interface

    if dropout_p:
        raise ValueError("flash_attention_3 has no attention dropout; set the model's attention_dropout to 0.")
    return _flash(
        (flash_attn_interface.flash_attn_func, flash_attn_interface.flash_attn_varlen_func), query, key, value,
        documents, return_lse, softmax_scale=scale, causal=True, window_size=_flash_window(window),
    )


def flex_attention(
    query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None = None,
    dropout_p: float = 0.0, window: int | None = None, return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``torch.nn.attention.flex_attention`` with a causal document block mask (no CPU backward in torch).

    Its log-sum-exp is differentiable (torch >= 2.9 for ``return_aux``)."""
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
    options: dict[str, Any] = {}
    if return_lse:
        from torch.nn.attention.flex_attention import AuxRequest

        options["return_aux"] = AuxRequest(lse=True)
    result = flex(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), block_mask=block_mask, scale=scale,
        enable_gqa=query.shape[2] != key.shape[2], **options,
    )
    if return_lse:
        out, aux = result
        return out.transpose(1, 2), aux.lse.transpose(1, 2)
    return result.transpose(1, 2)


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
# attention sinks
# ----------------------------------------------------------------------------------------------
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
    core: CoreAttention, query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, sinks: Tensor, *,
    scale: float | None = None, window: int | None = None,
) -> Tensor:
    """Attention with sinks (gpt-oss, transformers' ``s_aux``): each query's softmax also runs over one logit
    ``sinks[h]`` whose value is zero, so ``out' = out * sigmoid(lse - sinks[h])``.

    Shapes as the core backends (``query [B, N, h, D]``, ``key``/``value [B, N, kv_h, D]``), ``sinks [h]``; no dropout.
    Exact in the output and in every gradient (``query``, ``key``, ``value``, ``sinks``) with every backend: the
    log-sum-exp gets its gradient from the kernel (flex) or from :class:`_ExactLogSumExp`.
    """
    out, lse = core(query, key, value, documents, scale=scale, dropout_p=0.0, window=window, return_lse=True)
    if not lse.requires_grad:
        attend = functools.partial(core, documents=documents, scale=scale, dropout_p=0.0, window=window)
        lse = _ExactLogSumExp.apply(lse, query, key, attend, query.shape[-1] ** -0.5 if scale is None else scale)
    kept = torch.sigmoid(lse - sinks)  # [B, N, h] (fp32 or wider): the share of the softmax left to the real keys
    return out * kept[..., None].to(out.dtype)


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


@dataclass
class _GatheredPositions:
    """The whole rows of one ``[B, N/P]`` shard tensor of position ids, and their documents per chunk size."""

    shard: weakref.ref[Tensor]
    version: int
    group: ProcessGroup | None
    position_ids: Tensor  # [B, N]
    documents: dict[int | None, Documents]

    def gathered_from(self, shard: Tensor, group: ProcessGroup | None) -> bool:
        return self.shard() is shard and self.version == shard._version and self.group is group


_last_gathered: _GatheredPositions | None = None


def documents_of(position_ids: Tensor, group: ProcessGroup | None, chunk: int | None = None) -> Documents:
    """The documents (cut into chunks of ``chunk`` positions, see :meth:`Documents.from_position_ids`) of the whole
    rows whose ``[B, N/P]`` shard of global position ids is ``position_ids``.

    Every attention layer of a forward (and its recomputation under activation checkpointing) receives
    the same ``position_ids`` tensor, so the all-gather runs once per batch and the host sync of finding the
    document starts once per batch and chunk size, not once per layer (layers may alternate chunked and
    global attention). The gathered ids and their documents are kept for the same tensor object at the same
    version (an in-place edit recomputes); every rank of the group sees the same sequence of tensors and so
    takes the same branch, collectives included.
    """
    global _last_gathered
    if _last_gathered is None or not _last_gathered.gathered_from(position_ids, group):
        gathered = gather_sequence(position_ids, group)
        _last_gathered = _GatheredPositions(weakref.ref(position_ids), position_ids._version, group, gathered, {})
    documents = _last_gathered.documents
    if chunk not in documents:
        documents[chunk] = Documents.from_position_ids(_last_gathered.position_ids, chunk)
    return documents[chunk]


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
    chunk: int | None = None,
    sinks: Tensor | None = None,
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
        chunk: chunked attention (Llama 4's ``attention_chunk_size``): a token attends only to the tokens of
            its document whose position ids fall in its chunk (``position_id // chunk``); needs ``position_ids``.
        sinks: ``[H]`` attention sink logits, one per query head (gpt-oss's ``s_aux``; see
            :func:`sink_attention`); no dropout with them.

    Returns:
        ``[B, N/P, H, D]``: the attention output of this rank's tokens. Gradients flow back to
        ``query``, ``key`` and ``value`` on every rank through the inverse all-to-alls. ``sinks`` receives on
        each rank the gradient of the heads that rank attended (for the tokens of every rank): summed over the
        group, as replicated weights are, it is whole.
    """
    core = CORE_ATTENTION[attn_fn] if isinstance(attn_fn, str) else attn_fn
    if chunk is not None and position_ids is None:
        raise ValueError("Chunked attention needs the position_ids that number the chunks.")
    if sinks is not None and (sinks.shape != (query.shape[2],) or dropout_p):
        raise ValueError(
            f"Attention sinks are one logit per query head, shape ({query.shape[2]},), and run without attention "
            f"dropout; got shape {tuple(sinks.shape)} and dropout_p={dropout_p}."
        )
    sp_size = 1 if group is None else dist.get_world_size(group)
    layout = plan_heads(query.shape[2], key.shape[2], sp_size)
    documents = None if position_ids is None else documents_of(position_ids, group, chunk)

    def attend(q: Tensor, k: Tensor, v: Tensor, head_sinks: Tensor | None) -> Tensor:
        if head_sinks is None:
            return core(q, k, v, documents, scale=scale, dropout_p=dropout_p, window=window)
        return sink_attention(core, q, k, v, documents, head_sinks, scale=scale, window=window)

    if sp_size == 1:
        return attend(query, key, value, sinks)
    if sinks is not None:  # the sinks of this rank's query slots, inert copies included (their outputs are dropped)
        first = dist.get_rank(group) * layout.heads_per_rank
        sinks = select_heads(sinks, layout.query_slots[first : first + layout.heads_per_rank], dim=0)
    query = sequence_to_heads(select_heads(query, layout.query_slots), group)  # [B, N, h, D]
    key, value = (sequence_to_heads(select_heads(t, layout.kv_slots), group) for t in (key, value))
    out = attend(query, key, value, sinks)
    return select_heads(heads_to_sequence(out, group), layout.output_slots)  # [B, N/P, H, D]
