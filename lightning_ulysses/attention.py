"""All-to-all attention: sequence-sharded in, head-sharded local attention, sequence-sharded out.

Per attention layer, with ``P`` ranks in the SP group::

    q, k, v  [B, N/P, H, D]  --all-to-all #1-->  [B, N, H/P, D]   (all tokens, a slice of the heads)
                                                     |  core attention (SDPA, flash-attn, flex)
    out      [B, N/P, H, D]  <--all-to-all #2--  [B, N, H/P, D]

Heads are independent, so this is exact. Documents (packed samples, padding runs) are read from
the global ``position_ids``: a token starts a document when it is first in its row or its position
id is 0 (see :mod:`lightning_ulysses.sharding`); attention never crosses a document start.

Each core backend takes ``query [B, N, h, D]``, ``key``/``value [B, N, kv_h, D]`` (``h`` a multiple
of ``kv_h``) and the document layout, and returns ``[B, N, h, D]``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_ulysses.sharding import document_starts
from lightning_ulysses.topology import divisors


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
        dropout_p: float,
    ) -> Tensor: ...


def sdpa_attention(
    query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Causal attention with ``torch.nn.functional.scaled_dot_product_attention``.

    Packed rows run one causal SDPA call per document (exact, no ``N x N`` mask); single-document
    rows run one batched call.
    """
    gqa = query.shape[2] != key.shape[2]

    def causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # [b, n, h, d] -> [b, n, h, d]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
            dropout_p=dropout_p, enable_gqa=gqa,
        )
        return out.transpose(1, 2)

    if documents is None or documents.one_per_row:
        return causal(query, key, value)
    flat = [t.flatten(0, 1) for t in (query, key, value)]  # [B * N, h, d]
    bounds = documents.cu_seqlens.tolist()
    pieces = [causal(*(t[None, s:e] for t in flat))[0] for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(pieces).view_as(query)


def flash_attention_2(
    query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """flash-attn 2 (CUDA, fp16/bf16); packed rows use the varlen kernel with ``cu_seqlens``."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    if documents is None or documents.one_per_row:
        return flash_attn_func(query, key, value, dropout_p=dropout_p, softmax_scale=scale, causal=True)
    out = flash_attn_varlen_func(
        *(t.flatten(0, 1) for t in (query, key, value)),
        cu_seqlens_q=documents.cu_seqlens, cu_seqlens_k=documents.cu_seqlens,
        max_seqlen_q=documents.max_seqlen, max_seqlen_k=documents.max_seqlen,
        dropout_p=dropout_p, softmax_scale=scale, causal=True,
    )
    return out.view_as(query)


def flash_attention_3(
    query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """flash-attn 3 (Hopper, ``flash_attn_interface``); no dropout."""
    from flash_attn_interface import flash_attn_func, flash_attn_varlen_func

    if dropout_p:
        raise ValueError("flash_attention_3 has no attention dropout; set the model's attention_dropout to 0.")
    if documents is None or documents.one_per_row:
        out = flash_attn_func(query, key, value, softmax_scale=scale, causal=True)
    else:
        out = flash_attn_varlen_func(
            *(t.flatten(0, 1) for t in (query, key, value)),
            cu_seqlens_q=documents.cu_seqlens, cu_seqlens_k=documents.cu_seqlens,
            max_seqlen_q=documents.max_seqlen, max_seqlen_k=documents.max_seqlen, softmax_scale=scale, causal=True,
        )
    out = out[0] if isinstance(out, tuple) else out  # some releases also return the log-sum-exp
    return out.view_as(query)


def flex_attention(
    query: Tensor, key: Tensor, value: Tensor, documents: Documents | None, *, scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """``torch.nn.attention.flex_attention`` with a causal document block mask (no CPU backward in torch)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex

    if dropout_p:
        raise ValueError("flex_attention has no attention dropout; set the model's attention_dropout to 0.")
    batch, seq_len = query.shape[:2]
    if documents is None or documents.one_per_row:

        def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            return q >= kv

    else:
        doc = documents.document_ids

        def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            return (q >= kv) & (doc[b, q] == doc[b, kv])

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


def gather_sequence(x: Tensor, group: ProcessGroup) -> Tensor:
    """``[B, N/P] -> [B, N]``: concatenate the shards of an integer tensor (no gradient)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(shards, x.contiguous(), group=group)
    return torch.cat(shards, dim=1)


# ----------------------------------------------------------------------------------------------
# head layout
# ----------------------------------------------------------------------------------------------
def check_heads(num_heads: int, num_kv_heads: int, sp_size: int) -> None:
    """Refuse head counts that Ulysses attention cannot split over ``sp_size`` ranks.

    Query heads must divide by ``sp_size``; K/V heads must either divide by it, or divide it
    (each K/V head is then replicated ``sp_size / kv_heads`` times, one copy per rank that holds
    query heads of its group).
    """
    valid = [p for p in divisors(num_heads) if num_kv_heads % p == 0 or p % num_kv_heads == 0]
    ok = num_heads % sp_size == 0 and (num_kv_heads % sp_size == 0 or sp_size % num_kv_heads == 0)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}.")
    if not ok:
        raise ValueError(
            f"The model has {num_heads} attention heads and {num_kv_heads} key/value heads, which cannot be split "
            f"over sp_size={sp_size} ranks: heads must divide by sp_size, and key/value heads must divide by "
            f"sp_size or divide it. Valid sp_size values for this model: {valid}."
        )


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
    **attn_kwargs: Any,
) -> Tensor:
    """Causal attention over a sequence sharded across the ranks of ``group``.

    Args:
        query: ``[B, N/P, H, D]``, this rank's tokens, all heads.
        key, value: ``[B, N/P, H_kv, D]``.
        group: the sequence-parallel process group (``strategy.sp_group``); ``None`` runs locally.
        attn_fn: a core backend name (``"sdpa"``, ``"flash_attention_2"``, ``"flash_attention_3"``,
            ``"flex_attention"``) or a callable with the :class:`CoreAttention` signature.
        position_ids: ``[B, N/P]`` global position ids of this rank's tokens. They delimit packed
            documents; ``None`` treats every row as one document.
        **attn_kwargs: ``scale`` and ``dropout_p``, passed to the core backend.

    Returns:
        ``[B, N/P, H, D]``: the attention output of this rank's tokens. Gradients flow back to
        ``query``, ``key`` and ``value`` on every rank through the inverse all-to-alls.
    """
    core = CORE_ATTENTION[attn_fn] if isinstance(attn_fn, str) else attn_fn
    sp_size = 1 if group is None else dist.get_world_size(group)
    num_heads, num_kv_heads = query.shape[2], key.shape[2]
    check_heads(num_heads, num_kv_heads, sp_size)
    if sp_size == 1:
        documents = None if position_ids is None else Documents.from_position_ids(position_ids)
        return core(query, key, value, documents, **attn_kwargs)

    if num_kv_heads < sp_size:  # replicate K/V heads so that each rank receives the one its queries use
        key = key.repeat_interleave(sp_size // num_kv_heads, dim=2)
        value = value.repeat_interleave(sp_size // num_kv_heads, dim=2)
    query, key, value = (sequence_to_heads(t, group) for t in (query, key, value))
    documents = None if position_ids is None else Documents.from_position_ids(gather_sequence(position_ids, group))
    out = core(query, key, value, documents, **attn_kwargs)
    return heads_to_sequence(out, group)

