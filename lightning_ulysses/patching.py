"""The model hook: Ulysses attention inside Hugging Face transformers models, with no model code change.

Transformers dispatches attention through ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``.
We register one extra entry, ``"ulysses"`` (the existing ``"sdpa"``/flash entries are left alone, so
other models in the process keep working), point the patched model's config at it, and tag every
module that holds that config (the attention layers among them) with the SP group and the core
backend. ``"ulysses"`` has no mask function in transformers, so the model builds no attention mask:
padding and document borders come from the global ``position_ids`` instead (O(N), not O(N^2)).
Sliding windows (Mistral, Qwen2's sliding layers) arrive per layer as ``sliding_window`` and are
computed exactly by every core backend.

The model's ``forward`` is wrapped so that it refuses to run without ``position_ids``: transformers
would otherwise build local positions ``0 .. N/sp - 1`` on every rank and RoPE would be silently wrong
on all ranks but the first. The KV cache is switched off (it would hold one shard of the sequence).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from transformers import AttentionInterface, PreTrainedModel

from lightning_ulysses.attention import ulysses_attention
from lightning_ulysses.heads import plan_heads

ULYSSES_ATTN_IMPLEMENTATION = "ulysses"


class UnsupportedModelError(ValueError):
    """A model that sequence parallelism cannot run exactly, refused at set-up (before any data or step).

    The message names each offending layer, the feature and what to do instead.
    """


@dataclass(frozen=True)
class UlyssesAttentionContext:
    group: ProcessGroup | None
    core: str
    sp_size: int


def _hf_ulysses_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Transformers attention-interface entry: ``[B, H, N/sp, D]`` in, ``[B, N/sp, H, D]`` out."""
    context: UlyssesAttentionContext | None = getattr(module, "_ulysses_context", None)
    if context is None:
        raise RuntimeError(
            f"{type(module).__name__} dispatched to Ulysses attention but was not patched by lightning-ulysses; "
            "call apply_ulysses_attention on the model that owns it."
        )
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(
                f"{type(module).__name__} asks for {unsupported}={kwargs[unsupported]!r}, which Ulysses attention does "
                "not implement; it would silently compute plain causal attention instead. Train this model without SP."
            )
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise NotImplementedError(f"{type(module).__name__} is bidirectional; Ulysses attention here is causal only.")
    if position_ids is None:
        raise ValueError(f"{type(module).__name__} received no position_ids; Ulysses attention needs them.")
    out = ulysses_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        group=context.group, attn_fn=context.core, position_ids=position_ids, scale=scaling, dropout_p=dropout,
        window=kwargs.get("sliding_window"),
    )
    return out, None


AttentionInterface.register(ULYSSES_ATTN_IMPLEMENTATION, _hf_ulysses_attention)


def _require_position_ids(forward: Any) -> Any:
    @functools.wraps(forward)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("position_ids") is None:
            raise ValueError(
                "Under sequence parallelism the model must be called with the global position ids of its token "
                "shard, e.g. model(input_ids=batch['input_ids'], position_ids=batch['position_ids']) with the batch "
                "that UlyssesStrategy sharded. Without them transformers builds local positions 0..N/sp-1 and RoPE "
                "is wrong on every rank but the first."
            )
        kwargs["use_cache"] = False
        return forward(*args, **kwargs)

    return guarded


def apply_ulysses_attention(model: nn.Module, group: ProcessGroup | None, sp_size: int, core: str) -> None:
    """Make every transformers ``PreTrainedModel`` inside ``model`` run Ulysses attention over ``group``.

    Any head count runs (see :mod:`lightning_ulysses.heads`; a layout with inert heads is logged with its
    overhead). Raises before any work for what cannot run: attention logit soft-capping, or an architecture
    whose attention does not go through transformers' attention interface. Idempotent.
    """
    context = UlyssesAttentionContext(group, core, sp_size)
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel) and not hasattr(sub, "_ulysses_original_attn"):
            _check_supported(sub, sp_size)
            config = sub.config
            sub._ulysses_original_attn = config._attn_implementation
            if config._attn_implementation != ULYSSES_ATTN_IMPLEMENTATION:  # a parent may share this config
                for module in sub.modules():
                    if getattr(module, "config", None) is config:
                        module._ulysses_context = context
                config._attn_implementation = ULYSSES_ATTN_IMPLEMENTATION
            sub.forward = _require_position_ids(sub.forward)


def _check_supported(model: PreTrainedModel, sp_size: int) -> None:
    if not type(model)._supports_attention_backend:
        raise UnsupportedModelError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, so "
            "Ulysses attention cannot be swapped in. Use an architecture that does (Llama, Mistral, Qwen2/3, Gemma, "
            "...), or call lightning_ulysses.ulysses_attention from your own attention module."
        )
    text_config = model.config.get_text_config()
    if getattr(text_config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(
            f"{type(model).__name__} soft-caps its attention logits (attn_logit_softcapping="
            f"{text_config.attn_logit_softcapping}), which Ulysses attention does not implement. Train it without SP."
        )
    num_heads = text_config.num_attention_heads
    layout = plan_heads(num_heads, getattr(text_config, "num_key_value_heads", None) or num_heads, sp_size)
    if layout.overhead > 1 or layout.kv_overhead > 1:
        rank_zero_info(
            f"{type(model).__name__}: {layout.num_heads} attention heads / {layout.num_kv_heads} key/value heads over "
            f"sp_size={sp_size} run as {layout.heads_per_rank} / {layout.kv_heads_per_rank} per rank "
            f"({layout.overhead:.2f}x attention compute, {layout.kv_overhead:.2f}x key/value traffic)."
        )


def remove_ulysses_attention(model: nn.Module) -> None:
    """Undo :func:`apply_ulysses_attention` on every PreTrainedModel inside ``model``."""
    for sub in reversed(list(model.modules())):  # innermost first, so an outer model restores a shared config last
        if isinstance(sub, PreTrainedModel) and hasattr(sub, "_ulysses_original_attn"):
            sub.config._attn_implementation = sub._ulysses_original_attn
            del sub._ulysses_original_attn
            del sub.forward  # the guard was an instance attribute over the class's forward
        sub.__dict__.pop("_ulysses_context", None)


@contextmanager
def sequence_parallel_disabled(model: nn.Module) -> Iterator[None]:
    """Run the patched attention of ``model`` locally (``group=None``) inside the ``with`` block.

    The model must then be called with whole sequences (``[B, N]`` inputs and global ``position_ids``)
    on one rank; documents and padding are still masked from the position ids. Used to recompute a
    reference loss without sequence parallelism. Not collective.
    """
    patched = [module for module in model.modules() if "_ulysses_context" in module.__dict__]
    originals = [module._ulysses_context for module in patched]
    try:
        for module, context in zip(patched, originals):
            module._ulysses_context = replace(context, group=None, sp_size=1)
        yield
    finally:
        for module, context in zip(patched, originals):
            module._ulysses_context = context
