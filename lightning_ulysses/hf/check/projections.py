"""The set-up check's step under ``head_chunks``: which attention modules run with their projections inside the
chunks (:mod:`lightning_ulysses.hf.projections`).

For each planned attention layer, from the heads it passed to attention in the whole-sequence run: its chunks (the
count it will run with, over the Ulysses group's head layout) are computed by calling the module once per chunk with
its projections narrowed, on a copy of the inputs it got there and with the same token-local attention, and compared
with the module's own call on another copy: its output, and what it wrote into its inputs (a dict of key-value states
that later layers share, as Gemma 3n's and Gemma 4's KV-sharing layers keep; a cache), which the chunks would write
once per chunk, each with its own heads. The module is then called twice more as a whole in training mode: where the
two outputs differ, something outside the attention kernel draws random numbers (the probe's attention applies no
dropout), e.g. dropout on the output projection's result (Starcoder2's ``residual_dropout``), which the chunks would
draw on each chunk's partial sum with a mask of its own. A layer runs with its projections in the chunks only where
its chunks agree and it draws nothing, on every rank of the SP group; the others run attention-only chunks. Where a
head's output depends on other heads, the chunks fail (a norm over all heads' projections, whose weight no longer
fits) or differ (the same norm without a weight), and the layer stays as it was; modules whose projections do not
narrow per head (fused, latent, a gate inside the query projection, parameters of the module's own) are not tried
(:func:`~lightning_ulysses.hf.projections.find_projections`). The as-in-training step that follows runs the chunked
modules on the real group and compares their outputs once more.

Every call here goes to ``module.forward`` (the module's projections and other children are called as modules, so
ZeRO-3 gathers their weights; parameters of the module's own are not tried under ZeRO-3) and the same calls run on
every rank, whatever this rank's verdicts, so that ZeRO-3's gathers pair up. The module's modes and the random
number generators' states are as they were after the step.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_ulysses.attention.head_chunks import auto_chunks
from lightning_ulysses.heads import HeadLayout, plan_heads
from lightning_ulysses.hf.check.findings import any_rank
from lightning_ulysses.hf.check.shard import close
from lightning_ulysses.hf.check.tensors import first_tensor, modes_restored
from lightning_ulysses.hf.check.whole import WholeRun, probe_attention, token_local_probe
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
    ``ulysses_size`` ranks sum to its own output and write into its arguments what it writes (:func:`chunks_agree`),
    and it draws no random numbers outside attention (:func:`draws_at_random`), else ``None``. Not collective."""
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

    call = calls[0]
    try:
        with probe_attention(state, token_local_probe):
            agree = chunks_agree(module, spec, layout, call.args, call.kwargs)
            draws = draws_at_random(module, call.args, call.kwargs)  # called whatever ``agree`` is: see the docstring
    except Exception:  # noqa: BLE001 - a module that cannot be narrowed keeps attention-only chunks
        return None
    return spec if agree and not draws else None


def chunks_agree(module: nn.Module, spec: ProjectionChunks, layout: HeadLayout, args: tuple, kwargs: dict) -> bool:
    """Whether ``module``'s chunks (``spec`` over ``layout``), called on a copy of ``args`` and ``kwargs``, give the
    output of its own forward on another copy, and leave every tensor reachable from their inputs (dicts, lists,
    caches and other objects the module writes into) as its own forward leaves them."""
    whole, chunked = _copied(module, (args, kwargs)), _copied(module, (args, kwargs))
    expected = first_tensor(module.forward(*whole[0], **whole[1]))
    got = first_tensor(chunked_call(module, spec, layout, module.forward, *chunked))
    written, chunks_written = _reachable_tensors(whole), _reachable_tensors(chunked)
    return (
        expected is not None
        and got is not None
        and close(expected, got)
        and len(written) == len(chunks_written)
        and all(close(a, b) for a, b in zip(written, chunks_written, strict=True))
    )


DRAWS = 3
"""Calls of a module in training mode that :func:`draws_at_random` compares: three, so that a dropout of small
probability on the probe's few tokens still shows."""


def draws_at_random(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``module``'s own forward in training mode, each call on a copy of ``args`` and ``kwargs``, gives
    another output at another draw of the random number generators, the attention inside being the probe's (which
    applies no dropout, and takes none: the ``dropout`` transformers passes to the attention interface stops there).
    The module's modes and the generators' states (the CPU's and that of the inputs' device) are restored."""
    device = next((t.device for t in _reachable_tensors((args, kwargs))), torch.device("cpu"))
    devices = [] if device.type == "cpu" else [device]
    with modes_restored(module), torch.random.fork_rng(devices=devices, device_type=device.type):
        module.train()
        copies = [_copied(module, (args, kwargs)) for _ in range(DRAWS)]
        outputs = [first_tensor(module.forward(*call_args, **call_kwargs)) for call_args, call_kwargs in copies]
    first = outputs[0]
    return first is None or any(out is None or not torch.equal(first, out) for out in outputs[1:])


def _copied(module: nn.Module, call: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """A deep copy of a call's ``(args, kwargs)``, in which ``module``'s parameters and buffers stay themselves."""
    memo: dict[int, Any] = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(call, memo)


def _reachable_tensors(value: Any, seen: set[int] | None = None) -> list[Tensor]:
    """Every tensor reachable from ``value`` through containers and objects' attributes (not modules'), in order."""
    if isinstance(value, Tensor):
        return [value]
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, nn.Module):
        return []
    seen.add(id(value))
    if isinstance(value, Mapping):
        items: Iterable[Any] = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        items = vars(value).values()
    else:
        return []
    return [t for item in items for t in _reachable_tensors(item, seen)]
