"""All-to-all attention: sequence-sharded in, head-sharded local attention, sequence-sharded out.

Per attention layer, with ``P`` ranks in the SP group::

    q, k, v  [B, N/P, H, D]  --all-to-all #1-->  [B, N, h, D]   (all tokens, h = ceil(H/P) head slots)
                                                   |  core attention (SDPA, flash-attn, flex)
    out      [B, N/P, H, D]  <--all-to-all #2--  [B, N, h, D]   (D: the value's head size, MLA's differs from q, k)

Heads are independent, so this is exact. Documents (packed samples, padding runs) are read from the global
``position_ids`` (:mod:`.documents`); attention never crosses a document start. Chunked attention (Llama 4) is
more documents: every position id divisible by the chunk size starts one. Any head count: heads are laid out on
``sp_size`` equal groups of slots (:mod:`lightning_ulysses.heads`), so the all-to-alls are even and exact.

Modules: :mod:`.collectives` (all-to-all, sequence gather), :mod:`.documents` (the document layout and the
per-batch plans kept with it), :mod:`.core` (the backend interface), one module per backend (:mod:`.sdpa`,
:mod:`.cudnn`, :mod:`.flash`, :mod:`.flex`), :mod:`.backends` (choice by name, device and dtype), :mod:`.sinks`
(attention sinks), :mod:`.spans` (bidirectional spans inside causal attention: Gemma 3's images), :mod:`.ring`
(ring attention across Ulysses groups: Ulysses x Ring, when the SP group is a
:class:`~lightning_ulysses.groups.SequenceParallelGroups` with a ring), :mod:`.head_chunks` (the all-to-alls and
the attention in chunks of heads: ``head_chunks``; :mod:`.kept_graph`: each chunk's kernel graph kept for its
backward) and :mod:`.ulysses` (the entry point
and the per-batch planning).
"""

from lightning_ulysses.attention.backends import CORE_ATTENTION, prepare_plans, resolve_attn_implementation
from lightning_ulysses.attention.collectives import (
    all_to_all,
    gather_sequence,
    heads_to_sequence,
    sequence_to_heads,
)
from lightning_ulysses.attention.core import CoreAttention
from lightning_ulysses.attention.cudnn import sdpa_cudnn_attention
from lightning_ulysses.attention.documents import Documents, documents_of
from lightning_ulysses.attention.flash import flash_attention_2, flash_attention_3
from lightning_ulysses.attention.flex import flex_attention
from lightning_ulysses.attention.ring import ring_attention
from lightning_ulysses.attention.sdpa import SIGNIFICANT_BITS, length_class, plan_packed, sdpa_attention, sdpa_with_lse
from lightning_ulysses.attention.sinks import sink_attention
from lightning_ulysses.attention.ulysses import plan_batch, plan_spans, ulysses_attention

__all__ = [
    "CORE_ATTENTION",
    "SIGNIFICANT_BITS",
    "CoreAttention",
    "Documents",
    "all_to_all",
    "documents_of",
    "flash_attention_2",
    "flash_attention_3",
    "flex_attention",
    "gather_sequence",
    "heads_to_sequence",
    "length_class",
    "plan_batch",
    "plan_packed",
    "plan_spans",
    "prepare_plans",
    "resolve_attn_implementation",
    "ring_attention",
    "sdpa_attention",
    "sdpa_cudnn_attention",
    "sdpa_with_lse",
    "sequence_to_heads",
    "sink_attention",
    "ulysses_attention",
]
