"""How the zoo shrinks a config's dimensions: by one factor per kind of dimension, read from the default config, so
that the tiny model keeps the real checkpoint's proportions (see :mod:`tests.zoo_configs`).

Three kinds of dimension, and the one factor each is divided by:

* head counts (query heads, key-value heads, linear-attention and SSM heads, ...): ``head_factor``, so that the
  query heads become :attr:`Proportions.tiny_heads` and every other count keeps its ratio to them (at least 1).
  The tiny head count keeps the key-value groups: MHA stays MHA (4 / 4), MQA stays MQA (4 / 1), ``heads / kv = r``
  becomes ``2r / 2`` (key-value heads still shardable over 2 ranks) while that is at most 16 heads, else ``r / 1``
  (``16 / 1`` past 16);
* per-head dims (``head_dim``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``rotary_dim``, the
  latent ``kv_lora_rank``, linear-attention and SSM head dims, ...): ``head_dim_factor``, a power of two that
  divides every per-head dim of the config into a whole number and every rotated one (the head dim, the RoPE part
  ``head_dim * partial_rotary_factor``, ``qk_rope_head_dim``, ``rotary_dim``) into an even one: the smallest that
  brings them (but the latent) to at most 32 and the hidden size to at most 128, else the largest;
* widths (hidden size, FFN and expert sizes, low-rank projections, embedding and channel widths): ``width_factor
  = head_factor * head_dim_factor``, so that ``heads * head_dim / hidden`` is the default's; rounded to a multiple
  of 4, as real widths are multiples of 16 bytes (the grouped GEMM of MoE experts requires it).

Dimensions that differ in the default differ in the tiny config, equal ones stay equal, and every ratio within a
kind holds (up to rounding where a width is no multiple of the factor).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Read = Callable[[Any, str], Any]  # (config, field name) -> the config's value, None where it has none

MAX_TINY_HEADS = 16
MAX_HEAD_DIM = 32
MAX_HIDDEN = 128
WIDTH_ALIGN = 4  # fp32 elements in 16 bytes: the grouped GEMM of MoE experts needs 16-byte strides
_FACTORS = [2**i for i in range(8)]

HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads", "decoder_attention_heads")
KV_HEAD_FIELDS = (
    "num_key_value_heads",
    "num_kv_heads",
    "kv_n_heads",
    "swa_num_key_value_heads",
    "num_query_groups",
    "multi_query_group_num",
)
HIDDEN_FIELDS = ("hidden_size", "d_model", "n_embd", "emb_dim", "embed_dim", "embedding_dim")

HEAD_COUNTS = re.compile(
    rf"({'|'.join(HEAD_FIELDS + KV_HEAD_FIELDS)}|.*_attention_heads|index_n_heads|indexer_n_heads|linear_num_key_heads"
    r"|linear_num_value_heads|linear_num_heads|mamba_n_heads|mamba_num_heads|n_mamba_heads|o_groups)"
)
PER_HEAD_DIMS = re.compile(
    r"(head_dim|qk_rope_head_dim|qk_nope_head_dim|qk_head_dim|v_head_dim|rotary_dim|rotary_emb_dim|kv_lora_rank"
    r"|.*_head_dim|d_head|d_kv|dim_head|kv_channels|attention_head_dim|attention_head_size|mamba_d_head|mamba_headdim)"
)
ROTATED = re.compile(r"(head_dim|qk_rope_head_dim|rotary_dim|rotary_emb_dim|rotary part .*)")  # rotary halves: even
LATENTS = ("kv_lora_rank",)  # divided like head dims (the latent attention's head), not bounded like them
INPUT_CHANNELS = re.compile(r"(num_channels|in_channels|audio_channels)")  # of the data, no width
WIDTHS = re.compile(
    r"(.*intermediate_size.*|.*ffn_dim|ffn_hidden_size|n_inner|d_ff|dff|d_inner|dim_ff|mlp_dim|feed_forward_size"
    r"|expert_ffn_hidden_size|mamba_d_ssm|.*_lora_rank|hidden_size|d_model|n_embd|emb_dim|embedding_dim|embed_dim"
    r"|embedding_size|word_embed_proj_dim|.*_hidden_size|hidden_size_.*|lru_width|.*_embedding_size|.*_embed_dim"
    r"|projector_.*_dim|.*_output_dim|out_hidden_size|.*_channels?)"
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Proportions:
    """The factors that a config's dimensions are divided by (see the module docstring)."""

    head_factor: float
    head_dim_factor: int
    tiny_heads: int | None  # the query heads of the tiny config (None: the config has no attention heads)
    tiny_head_dim: int | None  # its attention head dim (None: no attention heads)

    @property
    def width_factor(self) -> float:
        return self.head_factor * self.head_dim_factor

    def heads(self, value: int) -> int:
        return max(1, round(value / self.head_factor))

    def head_dim(self, value: int) -> int:
        return max(1, round(value / self.head_dim_factor))

    def width(self, value: int) -> int:
        """The nearest multiple of :data:`WIDTH_ALIGN`, at least one."""
        return WIDTH_ALIGN * max(1, round(value / self.width_factor / WIDTH_ALIGN))


def first_int(config: Any, names: tuple[str, ...], read: Read) -> int | None:
    return next((v for v in (read(config, name) for name in names) if _is_int(v)), None)


def tiny_heads(heads: int, kv_heads: int | None) -> int:
    """The tiny query heads that keep the default's key-value groups (see the module docstring)."""
    if kv_heads is None or kv_heads in (1, heads) or kv_heads < 1 or heads % kv_heads:
        return 4  # MHA, MQA (or no grouping)
    group = heads // kv_heads
    return 2 * group if 2 * group <= MAX_TINY_HEADS else min(group, MAX_TINY_HEADS)


def effective_head_dim(config: Any, read: Read) -> int | None:
    """The attention head dim: the ``head_dim`` field, else ``hidden / heads``."""
    head_dim = read(config, "head_dim")
    if _is_int(head_dim) and head_dim > 0:
        return head_dim
    heads, hidden = first_int(config, HEAD_FIELDS, read), first_int(config, HIDDEN_FIELDS, read)
    if heads and hidden and hidden % heads == 0:
        return hidden // heads
    return None


def partial_rotary_factors(config: Any, read: Read) -> list[float]:
    """Every ``partial_rotary_factor`` below 1 of the config (its field, its RoPE parameters, per layer kind)."""
    rope = read(config, "rope_parameters")
    found = [read(config, "partial_rotary_factor")]
    if isinstance(rope, dict):
        found += [rope.get("partial_rotary_factor")]
        found += [kind.get("partial_rotary_factor") for kind in rope.values() if isinstance(kind, dict)]
    return [p for p in found if isinstance(p, float) and 0 < p < 1]


def per_head_dims(config: Any, names: list[str], read: Read) -> dict[str, int]:
    """The config's per-head dims by name: its per-head fields, the effective head dim (``"head_dim"``) and its
    rotary part (``"rotary part <factor>"``)."""
    dims = {name: v for name in names if PER_HEAD_DIMS.fullmatch(name) and _is_int(v := read(config, name)) and v > 0}
    head_dim = effective_head_dim(config, read)
    if head_dim is not None:
        dims["head_dim"] = head_dim
        dims.update({f"rotary part {p}": int(head_dim * p) for p in partial_rotary_factors(config, read)})
    return dims


def proportions(config: Any, names: list[str], read: Read) -> Proportions | None:
    """The factors for ``config`` (field ``names``, values through ``read(config, name)``); None where it has no
    hidden size (a part of a config, read with its parent's factors)."""
    hidden = first_int(config, HIDDEN_FIELDS, read)
    if hidden is None:
        return None
    heads = first_int(config, HEAD_FIELDS, read)
    kv_heads = first_int(config, KV_HEAD_FIELDS, read)
    small_heads = tiny_heads(heads, kv_heads) if heads else None
    head_factor = heads / small_heads if heads and small_heads else 1.0
    dims = per_head_dims(config, names, read)
    rotated = [d for name, d in dims.items() if ROTATED.fullmatch(name)]
    sizes = [d for name, d in dims.items() if name not in LATENTS]

    def valid(factor: int) -> bool:  # every per-head dim stays an integer, a rotated one even (rotary halves)
        whole = all(d % factor == 0 for d in dims.values())
        return whole and (factor == 1 or all(d % (2 * factor) == 0 for d in rotated))

    def fits(factor: int) -> bool:
        return max(sizes, default=0) / factor <= MAX_HEAD_DIM and hidden / (head_factor * factor) <= MAX_HIDDEN

    candidates = [f for f in _FACTORS if valid(f) and hidden / (head_factor * f) >= 1]
    head_dim_factor = next((f for f in candidates if fits(f)), max(candidates, default=1))
    head_dim = effective_head_dim(config, read)
    small_head_dim = head_dim // head_dim_factor if head_dim and small_heads else None
    return Proportions(head_factor, head_dim_factor, small_heads, small_head_dim)
