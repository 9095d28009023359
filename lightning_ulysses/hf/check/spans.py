"""Step 1b of the set-up check: what the model's masks do with ``token_type_ids``.

Gemma 3 marks the placeholders of each image with ``token_type_ids == 1`` and lets each run of them attend to
itself bidirectionally (``create_masks_for_vision_model``); other models take ``token_type_ids`` as segment
embeddings (no effect on the masks), or for a bidirectional prefix (PaliGemma). Under sequence parallelism
transformers builds no mask, so what a mask would say must be read here, by what the model does: the whole-sequence
probe runs once more with runs of ``1`` in ``token_type_ids``, and every attention layer's received mask is compared
with its planned pattern, without and with those runs as bidirectional spans
(:class:`~lightning_ulysses.hf.masks.MaskPattern` ``spans``). The verdict is the plan's ``token_types``:

* ``""``: the model takes no ``token_type_ids`` or its masks do not depend on them;
* ``"spans"``: the layers whose masks made the runs bidirectional are planned with ``spans=True``, and the patched
  forward reads the runs from the ``token_type_ids`` it is given (:mod:`lightning_ulysses.hf.forward`);
* anything else: why ``token_type_ids`` cannot be passed; a forward given them is refused.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_ulysses.hf.apply import sequence_parallel_disabled
from lightning_ulysses.hf.check.whole import mask_interface, probe_attention, token_local_attention
from lightning_ulysses.hf.masks import RecordedMasks, allowed_keys, recording_mask_interface
from lightning_ulysses.hf.plan import LayerPlan, ModelPlan
from lightning_ulysses.hf.state import PatchState

SPANS = "spans"


def probe_token_types(length: int, device: torch.device) -> Tensor:
    """``[2, length]``: row 0 holds two runs of ``1`` separated by one ``0``, row 1 a run at its start."""
    types = torch.zeros(2, length, dtype=torch.long, device=device)
    types[0, 2:5] = 1
    types[0, 6:9] = 1
    types[1, 0:3] = 1
    return types


def span_ids(token_types: Tensor) -> Tensor:
    """``[B, N]``: each run of ``token_types == 1`` numbered from 0 in its row, ``-1`` elsewhere."""
    flags = token_types == 1
    starts = flags & ~torch.nn.functional.pad(flags, (1, 0))[:, :-1]
    return torch.where(flags, starts.long().cumsum(1) - 1, -1)


def check_token_types(
    model: PreTrainedModel, state: PatchState, input_ids: Tensor, position_ids: Tensor, plan: ModelPlan
) -> ModelPlan:
    """``plan`` with its ``token_types`` verdict (see the module docstring) and ``spans=True`` on the layers whose
    masks make the runs of ``token_type_ids == 1`` bidirectional. Not collective (the probe is the same on every
    rank)."""
    if "token_type_ids" not in inspect.signature(model.forward).parameters:
        return plan
    names = {module: name for name, module in model.named_modules()}
    layers = dict(plan.layers)
    token_types = probe_token_types(input_ids.shape[1], input_ids.device)
    ids = span_ids(token_types)
    tokens = torch.arange(input_ids.shape[1], device=input_ids.device)
    verdicts: dict[str, bool] = {}
    problems: list[str] = []

    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Any,
        scaling: float | None,
        kwargs: dict[str, Any],
    ) -> Tensor:
        name = names[module]
        layer = layers.get(name)
        if layer is not None:
            spans = _spans_verdict(layer, attention_mask, ids, tokens)
            if spans is None:
                problems.append(
                    f"{name} receives a mask under token_type_ids that is no causal pattern with image spans"
                )
            elif verdicts.setdefault(name, spans) != spans:
                problems.append(f"{name} is called with and without image spans in one forward")
        return token_local_attention(query, key, value, scaling)

    try:
        with (
            mask_interface(recording_mask_interface(RecordedMasks([]))),
            probe_attention(state, attention),
            sequence_parallel_disabled(model),
        ):
            model(input_ids=input_ids, position_ids=position_ids, token_type_ids=token_types)
    except Exception as error:  # noqa: BLE001 - a model that fails on token_type_ids cannot be given them
        return replace(plan, token_types=f"its forward fails with token_type_ids ({error})")
    if problems:
        return replace(plan, token_types="; ".join(problems))
    if not any(verdicts.values()):
        return plan
    spanned = tuple(
        (name, replace(layer, pattern=replace(layer.pattern, spans=True)) if verdicts.get(name) else layer)
        for name, layer in plan.layers
    )
    return replace(plan, layers=spanned, token_types=SPANS)


def _spans_verdict(layer: LayerPlan, received: Any, ids: Tensor, tokens: Tensor) -> bool | None:
    """Whether the mask a layer ``received`` is its pattern with the runs of ``ids [B, N]`` bidirectional (``True``),
    its pattern alone (``False``), or neither (``None``)."""
    if received is None:
        return False  # no mask: causal, as planned
    allowed, _ = allowed_keys(received)
    if allowed is None:
        return None
    allowed = allowed.expand(ids.shape[0], 1, -1, -1)[:, 0]
    q, kv = tokens[:, None], tokens[None, :]
    for spans in (False, True):
        pattern = replace(layer.pattern, spans=spans)
        expected = torch.stack([pattern.allows(q, kv, row_ids) for row_ids in ids])
        if allowed.shape == expected.shape and bool((allowed == expected).all()):
            return spans
    return None
