"""The set-up check's step under ``head_chunks``: which attention modules run with their projections inside the
chunks (:mod:`lightning_ulysses.hf.projections`).

For each planned attention layer, from the heads it passed to attention in the whole-sequence run: its chunks (the
count it will run with, over the Ulysses group's head layout) are computed by calling the module once per chunk with
its projections narrowed, on the inputs it got there and with the same token-local attention, and compared with its
own output of that run. A layer runs so only where they agree on every rank of the SP group; the others run
attention-only chunks. Where a head's output depends on other heads, the chunks fail (a norm over all heads'
projections, whose weight no longer fits) or differ (the same norm without a weight), and the layer stays as it was;
modules whose projections do not narrow per head (fused, latent, a gate inside the query projection, parameters of
the module's own) are not tried (:func:`~lightning_ulysses.hf.projections.find_projections`). The as-in-training
step that follows runs the chunked modules on the real group and compares their outputs once more.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_ulysses.attention.head_chunks import auto_chunks
from lightning_ulysses.heads import plan_heads
from lightning_ulysses.hf.check.findings import any_rank
from lightning_ulysses.hf.check.shard import close
from lightning_ulysses.hf.check.tensors import first_tensor
from lightning_ulysses.hf.check.whole import WholeRun, probe_attention, token_local_attention
from lightning_ulysses.hf.plan import ModelPlan, ProjectionChunks
from lightning_ulysses.hf.projections import chunked_call, find_projections
from lightning_ulysses.hf.state import PatchState


def plan_projection_chunks(model: PreTrainedModel, state: PatchState, whole: WholeRun, plan: ModelPlan) -> ModelPlan:
    """``plan`` with each attention layer whose projections run inside its head chunks planned so. Collective over
    the SP group (the verdicts are agreed) where ``state.head_chunks`` is set and the Ulysses group has two ranks or
    more."""
    ulysses_size = state.group.topology.ulysses_size
    if state.head_chunks is None or ulysses_size == 1 or not plan.layers:
        return plan
    modules = dict(model.named_modules())
    found = [projection_chunks_of(modules[name], name, whole, state, ulysses_size) for name, _ in plan.layers]
    refused = any_rank(torch.tensor([spec is None for spec in found]), state)
    layers = tuple(
        (name, layer if no else replace(layer, projection_chunks=spec))
        for (name, layer), spec, no in zip(plan.layers, found, refused, strict=True)
    )
    return replace(plan, layers=layers)


def projection_chunks_of(
    module: nn.Module, name: str, whole: WholeRun, state: PatchState, ulysses_size: int
) -> ProjectionChunks | None:
    """This rank's verdict on the attention layer ``name``: its :class:`ProjectionChunks` where its chunks over
    ``ulysses_size`` ranks sum to its whole-run output, else ``None``. Not collective."""
    calls = whole.calls.get(name)
    if name not in whole.heads or not calls or not calls[0].outputs:
        return None
    heads, kv_heads, qk_dim, value_dim = whole.heads[name]
    layout = plan_heads(heads, kv_heads, ulysses_size)
    if len(layout.query_slots) != heads:  # inert query slots: their copies' outputs would be summed
        return None
    assert state.head_chunks is not None
    chunks = auto_chunks(layout, qk_dim, value_dim) if state.head_chunks == "auto" else state.head_chunks
    spec = find_projections(module, heads, kv_heads, qk_dim, value_dim, min(chunks, layout.heads_per_rank))
    if isinstance(spec, str):
        return None

    def local(
        module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Any, scale: Any, kwargs: Any
    ) -> Tensor:
        return token_local_attention(query, key, value, scale)

    call = calls[0]
    try:
        with probe_attention(state, local):
            got = first_tensor(chunked_call(module, spec, layout, module.forward, call.args, call.kwargs))
    except Exception:  # noqa: BLE001 - a module that cannot be narrowed keeps attention-only chunks
        return None
    return spec if got is not None and close(call.outputs[0], got) else None
