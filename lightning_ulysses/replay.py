"""Results a checkpointed layer's forward keeps for its recomputation, so that a head chunk inside the layer runs
no more often than its backward needs, where keeping them costs no device memory.

A non-reentrant checkpoint (:func:`torch.utils.checkpoint.checkpoint`) runs its function again at the start of the
layer's backward, only to remake what the layer's operations saved. Head chunks inside the layer run again in it:
attention-only chunks (:mod:`lightning_ulysses.attention.head_chunks`), whose backward runs from their kernel's kept
graph (:mod:`lightning_ulysses.attention.kept_graph`), because the operations after them saved their output; chunks
with the projections inside (:mod:`lightning_ulysses.hf.projections`), checkpoint regions of their own, also because
their output is needed, and once more for their own backward, which recomputes the region. With :func:`replayable`
around the layer's function (as :func:`~lightning_ulysses.memory.checkpoint_activations` puts it),
:func:`kept_for_replay` keeps such a region's result in the layer's forward and, in the layer's recomputation, hands
it back instead of computing it again::

    forward:            layer ... chunks: compute, keep the result (detached) ... rest of the layer
    recomputation:      layer ... chunks: save what computing them saved, take the kept result ... rest of the layer
    backward:           attention-only chunks: the kept graphs; projection chunks recompute themselves, one by one

The kept result (``[B, N/P, C]`` per layer, the bytes of the layer's own kept input) waits from the forward to the
layer's recomputation, so it is kept only where the layer's activations are offloaded and it leaves the device with
them (``offload_activations`` on CUDA): in device memory it would add one hidden-state tensor per layer to the peak
(on CPU at 32k tokens, sp=2, 2 layers: 16 MiB of 109), and head chunks are there to save memory. Elsewhere (no
offload, CPU, transformers' own checkpointing, evaluation) the chunks are computed in the recomputation as always.
The random number generators are left as the chunks left them in the forward, so the rest of the recomputation
draws what the forward drew.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map

from lightning_ulysses.offload import ActivationOffload


class _LayerRun:
    """One call of a :func:`replayable` function: the results its forward kept, in order, for its recomputation."""

    def __init__(self, offload: ActivationOffload) -> None:
        self.offload = offload
        self.kept: deque[tuple[Any, list[Tensor]]] = deque()
        self.calls = 0

    @property
    def replaying(self) -> bool:
        return self.calls > 1


_current: ContextVar[_LayerRun | None] = ContextVar("lightning_ulysses_layer_run", default=None)


def replayable(function: Callable[..., Any], offload: ActivationOffload) -> Callable[..., Any]:
    """``function`` for one checkpoint call whose saved tensors ``offload`` packs: its first call is the forward, any
    later one the checkpoint's recomputation, in which :func:`kept_for_replay` hands back what the forward kept."""
    run = _LayerRun(offload)

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        run.calls += 1
        token = _current.set(run)
        try:
            return function(*args, **kwargs)
        finally:
            _current.reset(token)

    return call


def kept_for_replay(compute: Callable[[], Any], replay: Callable[[Any], Any]) -> Any:
    """``compute()``, or inside a :func:`replayable` layer's recomputation ``replay(result)`` with the result its
    forward kept (its tensors detached, requiring grad as they did).

    ``replay(result)`` runs instead of ``compute()``: it must save for the backward what ``compute()`` saved through
    the layer's checkpoint, in the same order (so that the layer's recomputation remakes every saved tensor of the
    forward), and return the result as ``compute()`` would.
    """
    run = _current.get()
    if run is None or not torch.is_grad_enabled():
        return compute()
    if not run.replaying:
        result = compute()
        leaves = [x for x in tree_leaves(result) if isinstance(x, Tensor)]
        if leaves and all(run.offload.streams.offloads(x) for x in leaves):  # it leaves the device
            run.kept.append((tree_map(functools.partial(_keep, run), result), _rng_states()))
        return result
    if not run.kept:  # nothing kept (on the device), or a second recomputation (a retained graph)
        return compute()
    kept, rng = run.kept.popleft()
    result = replay(tree_map(functools.partial(_take, run), kept))
    _set_rng_states(rng)
    return result


class _Kept:
    def __init__(self, packed: Any, requires_grad: bool) -> None:
        self.packed, self.requires_grad = packed, requires_grad


def _keep(run: _LayerRun, x: Any) -> Any:
    return _Kept(run.offload.pack(x.detach()), x.requires_grad) if isinstance(x, Tensor) else x


def _take(run: _LayerRun, x: Any) -> Any:
    if not isinstance(x, _Kept):
        return x
    return run.offload.unpack(x.packed).detach().requires_grad_(x.requires_grad)


def _rng_states() -> list[Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _set_rng_states(states: list[Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])
