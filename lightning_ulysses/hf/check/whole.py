"""Steps 1 and 2 of the set-up check: the whole sequence on one rank, and the model's position numbering."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from lightning_ulysses.attention.core import softmax_scale
from lightning_ulysses.engines import transformers as transformers_engine
from lightning_ulysses.hf.apply import sequence_parallel_disabled, unpatched
from lightning_ulysses.hf.check.findings import module_label
from lightning_ulysses.hf.check.shard import close
from lightning_ulysses.hf.check.tensors import Call, first_tensor, hooks, named_inputs, tensors_of
from lightning_ulysses.hf.interface import ULYSSES_ATTN_IMPLEMENTATION, read_layer_call
from lightning_ulysses.hf.masks import RecordedMasks, recording_mask_interface
from lightning_ulysses.hf.plan import Finding, LayerPlan
from lightning_ulysses.hf.state import PatchState, ProbeAttention


@dataclass
class WholeRun:
    """What the whole-sequence run saw: every module's calls (by module path), the model's output, each attention
    layer's plan (by module path, in call order; only layers that can run exactly) and the heads it passed to
    attention (``(H, H_kv, D, D_v)`` of its first call)."""

    calls: dict[str, list[Call]] = field(default_factory=dict)
    output: Tensor | None = None
    layers: dict[str, LayerPlan] = field(default_factory=dict)
    heads: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)


def whole_sequence_run(
    model: PreTrainedModel, state: PatchState, input_ids: Tensor, position_ids: Tensor
) -> tuple[list[Finding], WholeRun]:
    names = {module: name for name, module in model.named_modules()}
    ring = state.group.ring is not None  # read before the run disables sequence parallelism
    recorded = RecordedMasks([])
    plans: dict[nn.Module, LayerPlan] = {}
    findings: dict[nn.Module, Finding] = {}
    run = WholeRun()

    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Any,
        scaling: float | None,
        kwargs: dict[str, Any],
    ) -> Tensor:
        tokens = input_ids.shape[1]
        if query.dim() != 4 or query.shape[2] != tokens or query.shape[0] != input_ids.shape[0]:
            findings[module] = Finding(
                module_label(names, module),
                f"passes attention tensors shaped "
                f"{tuple(query.shape)}, not [batch, heads, tokens={tokens}, dim] as "
                "transformers' attention interface does",
            )
            return torch.zeros_like(query)
        if key.shape[2] != tokens:  # keys of its own (compressed, memory, ...): no stand-in attention here
            findings[module] = Finding(
                module_label(names, module),
                f"attends to {key.shape[2]} keys from {tokens} queries: keys other than the sequence's tokens",
            )
            return query.new_zeros(*query.shape[:2], tokens, value.shape[-1]).transpose(1, 2)
        run.heads.setdefault(names[module], (query.shape[1], key.shape[1], query.shape[-1], value.shape[-1]))
        if module not in findings:
            pattern, why = recorded.pattern_of(attention_mask, kwargs.get("sliding_window"))
            plan, problems = read_layer_call(module, pattern, why, kwargs, ring)
            if plan is not None and plans.setdefault(module, plan) != plan:
                problems = ["is called with different attention patterns in one forward, and runs one plan per layer"]
            if problems:
                findings[module] = Finding(module_label(names, module), "; ".join(problems))
        return token_local_attention(query, key, value, scaling)

    def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        inputs = {key: t.clone() for key, t in named_inputs(module, args, kwargs).items()}
        outputs = [t.clone() for t in tensors_of(output)]
        run.calls.setdefault(names[module], []).append(Call(inputs, outputs, args, kwargs))

    try:
        with (
            mask_interface(recording_mask_interface(recorded)),
            probe_attention(state, attention),
            sequence_parallel_disabled(model),
            hooks(model, record),
        ):
            output = model(input_ids=input_ids, position_ids=position_ids)
    except Exception as error:  # noqa: BLE001 - any failure of the plain forward is a reason to refuse, with its text
        problem = f"cannot be called with input_ids and position_ids alone ({error})"
        return [Finding(f"{type(model).__name__}", problem)], run
    run.output = first_tensor(output)
    run.layers = {names[module]: plan for module, plan in plans.items() if module not in findings}
    return list(findings.values()), run


def token_local_attention(query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
    """``[B, H, N, D]`` query, ``[B, H_kv, N, D]`` key and ``[B, H_kv, N, D_v]`` value -> ``[B, N, H, D_v]``: every
    token attends only to itself, weighted by ``sigmoid(scale * q.k)`` so that the queries and keys still count."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    scale = softmax_scale(query, scale)
    weight = torch.sigmoid(scale * (query * key).sum(-1, keepdim=True))
    return (value * weight).transpose(1, 2).contiguous()


def token_local_probe(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Any, scale: float | None, kwargs: Any
) -> Tensor:
    """:func:`token_local_attention` as a probe core for :func:`probe_attention` (the attention interface's call)."""
    return token_local_attention(query, key, value, scale)


def check_position_numbering(model: PreTrainedModel, input_ids: Tensor, position_ids: Tensor) -> list[Finding]:
    """Refuse a model whose own positions are not ``0, 1, 2, ...`` (RoBERTa counts from ``padding_idx + 1``): the global
    position ids that sequence parallelism must pass would change what it computes."""
    with unpatched(model):
        given = first_tensor(model(input_ids=input_ids, position_ids=position_ids, use_cache=False))
        own = first_tensor(model(input_ids=input_ids, use_cache=False))
    if given is None or own is None or close(own, given):
        return []
    return [
        Finding(
            type(model).__name__,
            "numbers its positions other than 0, 1, 2, ... (its output changes when "
            "given those position ids; e.g. RoBERTa counts from padding_idx + 1), and sequence parallelism "
            "must give each shard its global position ids",
        )
    ]


@contextmanager
def probe_attention(state: PatchState, function: ProbeAttention) -> Iterator[None]:
    """Within the block, every attention layer of the patch computes ``function`` instead."""
    state.probe = function
    try:
        yield
    finally:
        state.probe = None


@contextmanager
def mask_interface(function: Any) -> Iterator[None]:
    ALL_MASK_ATTENTION_FUNCTIONS.register(ULYSSES_ATTN_IMPLEMENTATION, function)
    try:
        yield
    finally:
        transformers_engine.unregister_mask_interface(ULYSSES_ATTN_IMPLEMENTATION)
