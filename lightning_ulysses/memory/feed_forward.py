"""Tiled feed-forwards: each decoder layer's token-wise feed-forward, dense MLP or mixture of experts, run in tiles.

Found by behaviour, not by name. A **candidate** is a child of a decoder layer (an element of an ``nn.ModuleList``)
that holds a weight matrix, is not a token mixer with a head-sharded form, and in the set-up probe
(:mod:`.probe`) is called with one tensor, the layer's ``[batch, seq, hidden]`` hidden states, and returns a tensor of
that shape first (maybe with more, such as router logits or scores): the module that maps the normed hidden states to
the residual update, whatever its class (``mlp``, ``feed_forward``, ``block_sparse_moe`` + ``shared_mlp``, ...).
A candidate is **tiled** when its output on the probe's hidden states equals, tensor by tensor, its tiles' outputs put
together (:func:`~.tiling.tiled_map`, which tiles the sequence and keeps the ``[batch, tile, hidden]`` input a
mixture-of-experts block needs): in 3 tiles, in one-token tiles with an empty one, and in 3 tiles of a sequence that
repeats one token (all routed alike: a capacity-limited router drops tokens there, and differs); and when it adds
no gradient of its own: run in training mode on the probe's hidden states, a zero gradient of its outputs gives a zero
gradient of its input and of its trainable parameters (:func:`_own_gradient`). A feed-forward that adds one (an
auxiliary loss that only the backward sees, as DeepSeek-V2's remote-code MoE adds its load-balancing loss through an
identity autograd function) would compute it from each tile's tokens instead of all of them, and its gradient would
differ with the same loss. Anything else is reported with the reason and left as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from lightning_ulysses.hf.ledger import Ledger
from lightning_ulysses.hf.state import PatchState
from lightning_ulysses.memory.probe import PROBE_TOKENS, Call, agreed_on_all_ranks
from lightning_ulysses.tiling import TileSetting, agree_max_tokens, resolve_num_tiles, tiled_map

PROBE_TILES = (3, PROBE_TOKENS + 1)


@dataclass(frozen=True)
class FeedForward:
    """A feed-forward candidate found in the probe: ``problem`` is why it is not tiled (None: it is)."""

    name: str
    module: nn.Module
    problem: str | None = None


def candidate_modules(model: nn.Module) -> dict[nn.Module, str]:
    """The children of every decoder layer that may be its feed-forward, by module path (see the module docstring)."""
    # imported here: lightning_ulysses.hf imports this package (recomputed_in_backward) as it loads
    from lightning_ulysses.hf.mixers import is_token_mixer

    names = {module: name for name, module in model.named_modules()}
    layers = [layer for module in model.modules() if isinstance(module, nn.ModuleList) for layer in module]
    return {
        child: names[child]
        for layer in layers
        for child in layer.children()
        if not isinstance(child, (nn.ModuleList, nn.ModuleDict))
        and any(len(getattr(p, "ds_shape", p.shape)) >= 2 for p in child.parameters())  # ZeRO-3: the full shape
        and not is_token_mixer(child)
    }


def judge_feed_forwards(candidates: dict[nn.Module, str], calls: dict[nn.Module, list[Call]]) -> list[FeedForward]:
    """The candidates that the probe called as feed-forwards, each with why it is not tiled (or None), the verdict
    agreed over every rank. Run inside :func:`~.probe.probing`; collective when distributed."""
    found: list[FeedForward] = []
    for module, name in candidates.items():
        call = calls.get(module, [None])[0]
        x = None if call is None else _hidden_states(call)
        if call is not None and x is not None:
            # both checks on every candidate: under ZeRO-3 each call gathers parameters, alike on every rank
            own_gradient, not_token_wise = _own_gradient(module, x), _not_token_wise(module, x, call.output)
            found.append(FeedForward(name, module, own_gradient or not_token_wise))
        # else: not called with the hidden states alone (attention, a mixer, unused): not a feed-forward
    device = next((p.device for ff in found for p in ff.module.parameters()), torch.device("cpu"))
    agreed = agreed_on_all_ranks([ff.problem is None for ff in found], device)
    return [
        ff if ff.problem is not None or tiled else replace(ff, problem="is not token-wise on another rank")
        for ff, tiled in zip(found, agreed, strict=True)
    ]


def _hidden_states(call: Call) -> Tensor | None:
    """The one tensor argument of ``call`` when it is ``[2, PROBE_TOKENS, d]`` and the first output has its shape."""
    inputs = [*call.args, *call.kwargs.values()]
    if len(inputs) != 1 or not isinstance(inputs[0], Tensor):
        return None
    x = inputs[0]
    out = _tensors(call.output)
    if x.dim() != 3 or x.shape[:2] != (2, PROBE_TOKENS) or not x.is_floating_point() or not out:
        return None
    return x if out[0].shape == x.shape else None


def _not_token_wise(module: nn.Module, x: Tensor, whole: Any) -> str | None:
    """Why ``module`` cannot be tiled exactly, or None (see the module docstring)."""
    repeated = x[:, :1].expand_as(x).contiguous()
    try:
        probes = [(x, whole, tiles) for tiles in PROBE_TILES] + [(repeated, module(repeated), PROBE_TILES[0])]
        for probe, expected, tiles in probes:
            if not _same_outputs(tiled_map(module, probe, tiles), expected):
                return (
                    f"its output for a token depends on other tokens (in {tiles} tiles of the sequence it differs "
                    "from the whole call): it mixes tokens, or routes them with a capacity set by the batch"
                )
    except Exception as error:  # noqa: BLE001 - a module that cannot run on tiles is not tiled, with the reason
        return f"cannot be run on tiles of the sequence ({type(error).__name__}: {error})"
    return None


def _own_gradient(module: nn.Module, x: Tensor) -> str | None:
    """Why ``module`` adds a gradient of its own, or None: called in training mode on ``x`` (``[2, PROBE_TOKENS,
    hidden]``), with autograd on, a zero gradient of its floating-point outputs must give a zero gradient of ``x``
    and of every trainable parameter (made by :func:`torch.autograd.grad`: no ``.grad`` is written). Every
    module's mode and the random generators' states (the CPU's and that of ``x``'s device) are restored."""
    # imported here: lightning_ulysses.hf imports this package (recomputed_in_backward) as it loads
    from lightning_ulysses.hf.check.tensors import (
        backward_hooks_off,
        gradient_probe,
        modes_restored,
        zero_gradient_reaches,
    )

    try:
        with backward_hooks_off(module), modes_restored(module), gradient_probe(x.device):
            module.train()
            probe = x.detach().clone().requires_grad_()
            inputs = [probe, *(p for p in module.parameters() if p.requires_grad)]
            adds = zero_gradient_reaches([t for t in _tensors(module(probe)) if t.requires_grad], inputs)
    except Exception as error:  # noqa: BLE001 - a module whose gradient cannot be probed is not tiled, with the reason
        return f"cannot be run with a gradient in training mode ({type(error).__name__}: {error})"
    if adds:
        return (
            "it adds a gradient of its own (a zero gradient of its outputs gives its input or parameters a non-zero "
            "one: an auxiliary loss that only the backward sees, as DeepSeek-V2's MoE adds), which in tiles would be "
            "computed from each tile's tokens and differ"
        )
    return None


def _same_outputs(got: Any, expected: Any) -> bool:
    # imported here: lightning_ulysses.hf imports this package (recomputed_in_backward) as it loads
    from lightning_ulysses.hf.check.shard import close

    got_tensors, expected_tensors = _tensors(got), _tensors(expected)
    return len(got_tensors) == len(expected_tensors) and all(
        close(e, g) for g, e in zip(got_tensors, expected_tensors, strict=True)
    )


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def tile_feed_forwards(
    feed_forwards: list[FeedForward], setting: TileSetting, state: PatchState | None, ledger: Ledger
) -> None:
    """Run each feed-forward without a problem in tiles (``setting``), recorded in ``ledger``."""
    if setting is True and state is not None:  # the patched forward agrees the token count once per batch
        ledger.set("tiled_mlp", state, "agree_tokens", agree_max_tokens)
        ledger.record("tiled_mlp", lambda: _forget_agreed_tokens(state))
    for ff in feed_forwards:
        if ff.problem is None:
            forward = functools.partial(_tiled_forward, ff.module.forward, setting, state)
            ledger.set("tiled_mlp", ff.module, "forward", forward)


def _tiled_forward(
    forward: Callable[..., Any], setting: TileSetting, state: PatchState | None, *args: Any, **kwargs: Any
) -> Any:
    """``forward`` on its one tensor argument ``[..., seq, hidden]`` in tiles; called otherwise, as it is.
    ``state``: the :class:`~lightning_ulysses.hf.state.PatchState` of a patched model, whose ``forward.tokens``
    (agreed once per batch) spare this call, and its recomputation, the collective and the host sync."""
    inputs = [*args, *kwargs.values()]
    x = inputs[0] if len(inputs) == 1 else None
    if not isinstance(x, Tensor) or x.dim() < 2:
        return forward(*args, **kwargs)
    fn = functools.partial(_by_keyword, forward, next(iter(kwargs))) if kwargs else forward
    tokens = x.shape[:-1].numel()
    batch = None if state is None or state.forward is None else state.forward.tokens
    max_tokens = batch[1] if batch is not None and batch[0] == tokens else None
    num_tiles = resolve_num_tiles(setting, tokens, tile_tokens=x.shape[-1], device=x.device, max_tokens=max_tokens)
    return tiled_map(fn, x, num_tiles)


def _forget_agreed_tokens(state: PatchState) -> None:
    if state.forward is not None:
        state.forward = replace(state.forward, tokens=None)


def _by_keyword(forward: Callable[..., Any], key: str, x: Tensor) -> Any:
    return forward(**{key: x})
