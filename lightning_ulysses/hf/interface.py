"""The ``"ulysses"`` entry of transformers' attention interface, and what each attention layer may ask of it.

Transformers models call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key,
value, attention_mask, scaling=..., dropout=..., **kwargs)`` with ``[B, H, N/sp, D]`` tensors. Every
argument that changes the result must be understood, or the layer is refused: the set-up check
(:mod:`lightning_ulysses.hf.check`) reads each layer's call once, with :func:`read_layer_call`, into a
:class:`~lightning_ulysses.hf.plan.LayerPlan`, which the applier stores on the module; training then runs that plan.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from transformers import AttentionInterface

from lightning_ulysses.attention import ulysses_attention
from lightning_ulysses.attention.core import no_window_if_off
from lightning_ulysses.hf.masks import MaskPattern
from lightning_ulysses.hf.plan import LayerPlan
from lightning_ulysses.hf.state import PatchState

ULYSSES_ATTN_IMPLEMENTATION = "ulysses"

HANDLED_KWARGS = frozenset({"sliding_window", "position_ids", "is_causal", "s_aux"})
"""Keyword arguments whose meaning the plan carries (or that are read from the batch instead)."""

INERT_KWARGS = frozenset(
    {
        "layer_idx",
        "use_cache",
        "output_attentions",
        "return_dict",
        "cache",
        "past_key_values",
        "cache_position",
        "position_embeddings",
        "target_dtype",
        "layer_type",
        "logits_to_keep",
    }
)
"""Keyword arguments that models pass along but that do not change what attention computes here (no KV cache
runs under sequence parallelism)."""


def read_layer_call(
    module: nn.Module, pattern: MaskPattern | None, mask_problem: str, kwargs: dict[str, Any], ring: bool = False
) -> tuple[LayerPlan | None, list[str]]:
    """The plan of an attention layer from its call (``kwargs`` as it passed them and the ``pattern`` of the mask it
    received), or ``None`` and the reasons it cannot run exactly (``ring``: under Ulysses x Ring)."""
    problems = [mask_problem] if pattern is None else []
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        problems.append("attends bidirectionally (Ulysses attention here is causal)")
    unknown = sorted(
        name
        for name, value in kwargs.items()
        if name not in HANDLED_KWARGS | INERT_KWARGS and value is not None and value is not False
    )
    for name in unknown:
        problems.append(
            f"passes {name}={_short(kwargs[name])} to attention, which Ulysses attention does not implement"
        )
    sinks = kwargs.get("s_aux")
    dropout = getattr(module, "attention_dropout", 0.0)
    if sinks is not None and dropout:
        problems.append("combines attention sinks with attention dropout, which Ulysses attention does not implement")
    if ring and dropout:
        problems.append(
            "uses attention dropout, which Ulysses x Ring (ring_size > 1) does not implement yet (ring_size=1 does)"
        )
    window = no_window_if_off(kwargs.get("sliding_window"))
    if pattern is not None and window is not None and pattern.window != window:
        problems.append(
            f"passes sliding_window={window} to attention but its mask is {pattern.describe()}, so its result depends "
            "on the attention kernel"
        )
    if problems or pattern is None:  # no pattern: its problem is in problems
        return None, problems
    return LayerPlan(pattern, sinks=sinks is not None), []


def _short(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"<tensor {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) < 40 else text[:37] + "..."


def _hf_ulysses_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Transformers attention-interface entry: ``[B, H, N/sp, D]`` queries and keys, ``[B, H_kv, N/sp, D_v]`` values
    in, ``[B, N/sp, H, D_v]`` out."""
    state: PatchState | None = module.__dict__.get("_ulysses_state")
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} dispatched to Ulysses attention but belongs to no model that lightning-ulysses "
            "patched; apply_ulysses_attention patches the PreTrainedModel that owns it."
        )
    if state.probe is not None:  # the set-up check is running
        return state.probe(module, query, key, value, attention_mask, scaling, kwargs), None
    plan: LayerPlan | None = module.__dict__.get("_ulysses_plan")
    if plan is None:
        raise RuntimeError(
            f"{type(module).__name__} was not called by lightning-ulysses' set-up check of the model, so it is not "
            "known to run exactly (a layer used only for some inputs, e.g. images?). Sequence parallelism supports "
            "text inputs."
        )
    if attention_mask is not None:
        raise RuntimeError(
            f"{type(module).__name__} received an attention mask at run time although the set-up check saw none: "
            "pass padding in the batch (attention_mask / position_ids), not as a tensor to the model."
        )
    out = ulysses_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        group=state.group,
        attn_implementation=state.core,
        position_ids=None if state.forward is None else state.forward.position_ids,
        scale=scaling,
        dropout_p=dropout,
        window=plan.pattern.window,
        chunk=plan.pattern.chunk,
        sinks=kwargs["s_aux"] if plan.sinks else None,
        head_chunks=None if plan.projection_chunks else state.head_chunks,  # the module runs in chunks around it
        bidirectional=state.forward.spans if plan.pattern.spans and state.forward is not None else None,
    )
    return out.contiguous(), None  # as transformers' kernels return it: models .view() it


AttentionInterface.register(ULYSSES_ATTN_IMPLEMENTATION, _hf_ulysses_attention)
