"""Results a checkpointed layer's forward keeps for its recomputation, so that a region with a checkpoint of its own
inside the layer is recomputed once, not twice.

A non-reentrant checkpoint (:func:`torch.utils.checkpoint.checkpoint`) runs its function again at the start of the
layer's backward, only to remake what the layer's operations saved. A head chunk inside the layer
(:mod:`lightning_ulysses.hf.projections`) is a checkpoint of its own, recomputed when its backward comes: under a
checkpointed layer each chunk then runs three times (the forward, the layer's recomputation, the chunk's own), two
more than its backward needs. With :func:`replayable` around the layer's function (as
:func:`~lightning_ulysses.checkpoint_activations` puts it), :func:`kept_for_replay` keeps such a region's result in the
layer's forward and, in the layer's recomputation, hands it back instead of computing it again: each chunk runs in
the forward and once more for its backward::

    forward:            layer ... region: compute, keep the result (detached) ... rest of the layer
    recomputation:      layer ... region: re-save its inputs, take the kept result ... rest of the layer
    backward:           the region's own checkpoint recomputes it, chunk by chunk

The price is the kept result (``[B, N/P, C]`` per layer, the bytes of the layer's own kept input) from the forward to
the layer's recomputation, moved to host memory like the layer's input where activations are offloaded. The random
number generators are left as the region left them in the forward, so the rest of the recomputation draws what the
forward drew. Outside such a layer (no checkpoint, transformers' own checkpointing, evaluation) the region is computed
as always.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map


class _LayerRun:
    """One call of a :func:`replayable` function: the results its forward kept, in order, for its recomputation."""

    def __init__(self, pack: Callable[[Tensor], Any], unpack: Callable[[Any], Tensor]) -> None:
        self.pack, self.unpack = pack, unpack
        self.kept: deque[tuple[Any, list[Tensor]]] = deque()
        self.calls = 0

    @property
    def replaying(self) -> bool:
        return self.calls > 1


_current: ContextVar[_LayerRun | None] = ContextVar("lightning_ulysses_layer_run", default=None)


def replayable(
    function: Callable[..., Any],
    pack: Callable[[Tensor], Any] = lambda t: t,
    unpack: Callable[[Any], Tensor] = lambda t: t,
) -> Callable[..., Any]:
    """``function`` for one checkpoint call: its first call is the forward, any later one the checkpoint's
    recomputation, in which :func:`kept_for_replay` hands back what the forward kept. ``pack`` / ``unpack``: how a
    kept tensor waits (the offload's, for offloaded activations)."""
    run = _LayerRun(pack, unpack)

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        run.calls += 1
        token = _current.set(run)
        try:
            return function(*args, **kwargs)
        finally:
            _current.reset(token)

    return call


def kept_for_replay(compute: Callable[[], Any], resave: Callable[[], None]) -> Any:
    """``compute()``, or inside a :func:`replayable` layer's recomputation the result its forward kept.

    ``resave()`` runs in its stead: it must save for the backward what ``compute()`` saved through the layer's
    checkpoint (the inputs of the region's own checkpoints), in the same order, so that the layer's recomputation
    remakes every saved tensor of the forward. Tensors of the result come back detached, requiring grad as they did.
    """
    run = _current.get()
    if run is None or not torch.is_grad_enabled():
        return compute()
    if not run.replaying:
        result = compute()
        run.kept.append((tree_map(functools.partial(_keep, run), result), _rng_states()))
        return result
    if not run.kept:  # a second recomputation (a retained graph): as without
        return compute()
    resave()
    kept, rng = run.kept.popleft()
    _set_rng_states(rng)
    return tree_map(functools.partial(_take, run), kept)


class _Kept:
    def __init__(self, packed: Any, requires_grad: bool) -> None:
        self.packed, self.requires_grad = packed, requires_grad


def _keep(run: _LayerRun, x: Any) -> Any:
    return _Kept(run.pack(x.detach()), x.requires_grad) if isinstance(x, Tensor) else x


def _take(run: _LayerRun, x: Any) -> Any:
    if not isinstance(x, _Kept):
        return x
    return run.unpack(x.packed).detach().requires_grad_(x.requires_grad)


def _rng_states() -> list[Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _set_rng_states(states: list[Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])
