"""Step 3 of the set-up check: rotary embeddings whose frequencies depend on the sequence length."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_ulysses.hf.check.findings import any_rank, module_label
from lightning_ulysses.hf.check.shard import Shard, shard_of
from lightning_ulysses.hf.check.tensors import Call, tensors_of
from lightning_ulysses.hf.check.whole import WholeRun
from lightning_ulysses.hf.plan import Finding, ModelPlan
from lightning_ulysses.hf.rotary import position_ids_index
from lightning_ulysses.hf.state import PatchState, model_configs


def check_rotary(
    model: PreTrainedModel,
    state: PatchState,
    whole: WholeRun,
    shard: Shard,
    plan: ModelPlan,
    realize: Callable[[ModelPlan], None],
) -> tuple[list[Finding], ModelPlan]:
    """Step 3: the rotary modules whose outputs depend on the sequence length, planned (and realised) as
    whole-sequence rotary (:mod:`lightning_ulysses.hf.rotary`); a finding for each that this does not make exact."""
    modules = dict(model.named_modules())
    names = {module: name for name, module in modules.items()}
    boundaries = sorted(position_boundaries(model))
    rotary = [(modules[name], calls[0]) for name, calls in whole.calls.items() if is_rotary(modules[name], calls[0])]

    def length_dependent(module: nn.Module, call: Call) -> bool:
        for boundary in boundaries:
            offset = max(boundary - shard.length, 0)  # the whole sequence straddles the boundary, the first shard not
            expected = call_with_positions(module, call, offset, shard, whole_sequence=True)
            got = call_with_positions(module, call, offset, shard, whole_sequence=False)
            if not shard.all_agree(expected, got):
                return True
        return False

    flags = torch.tensor([length_dependent(m, call) for m, call in rotary], dtype=torch.int32)
    dependent = [m for (m, _), flag in zip(rotary, any_rank(flags, state), strict=True) if flag]
    if dependent:
        plan = replace(plan, rotary=tuple(names[m] for m in dependent))
        realize(plan)
    flags = torch.tensor([length_dependent(m, call) for m, call in rotary if m in dependent], dtype=torch.int32)
    inexact = [m for m, flag in zip(dependent, any_rank(flags, state), strict=True) if flag]
    return [
        Finding(
            module_label(names, m),
            "computes rotary frequencies from the sequence length in a way that giving it "
            "the whole sequence's largest position does not make exact",
        )
        for m in inexact
    ], plan


def is_rotary(module: nn.Module, call: Call) -> bool:
    """A module without weights that maps ``position_ids`` to a pair of per-token tensors."""
    if len(call.outputs) != 2 or next(module.parameters(), None) is not None:
        return False  # before reading the signature, which costs more than the model's small modules
    try:
        bound = inspect.signature(module.forward).bind(*call.args, **call.kwargs)
    except TypeError:
        return False
    positions = bound.arguments.get("position_ids")
    return isinstance(positions, Tensor) and all(
        t.dim() >= 2 and t.shape[-2] == positions.shape[-1] for t in call.outputs
    )


def call_with_positions(module: nn.Module, call: Call, offset: int, shard: Shard, whole_sequence: bool) -> list[Tensor]:
    """``module`` called as in ``call`` but with its position ids moved up by ``offset`` (and, for a shard, every
    per-token input cut to the shard), restoring whatever state the call changes (dynamic RoPE caches its
    frequencies)."""
    args, kwargs = list(call.args), dict(call.kwargs)
    index = position_ids_index(module)
    if index is not None and index < len(args):
        args[index] = args[index] + offset
    else:
        kwargs["position_ids"] = kwargs["position_ids"] + offset
    if not whole_sequence:
        args = [shard_of(a, shard) for a in args]
        kwargs = {k: shard_of(v, shard) for k, v in kwargs.items()}
    with restored(module):
        return tensors_of(module(*args, **kwargs))


@contextmanager
def restored(module: nn.Module) -> Iterator[None]:
    buffers = {name: b.clone() if b is not None else None for name, b in module._buffers.items()}
    attributes = dict(module.__dict__)
    try:
        yield
    finally:
        module._buffers = buffers
        for name in [n for n in module.__dict__ if n not in attributes]:
            del module.__dict__[name]
        module.__dict__.update({k: v for k, v in attributes.items() if k != "_buffers"})


def position_boundaries(model: PreTrainedModel) -> set[int]:
    """0 and every ``*max_position*`` integer of the configs (rope parameters included): where length-dependent
    RoPE changes its frequencies."""
    found = {0}
    pending: list[Any] = [config.to_dict() for config in model_configs(model)]
    while pending:
        item = pending.pop()
        for key, value in item.items():
            if isinstance(value, dict):
                pending.append(value)
            elif isinstance(key, str) and "max_position" in key and type(value) is int and value > 0:  # not a bool
                found.add(value)
    return found
