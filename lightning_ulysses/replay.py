"""What one run of a head chunk hands to a later run of it, so that a checkpointed layer's chunks run their attention
kernel's forward no more often than its recomputation needs.

A non-reentrant checkpoint (:func:`torch.utils.checkpoint.checkpoint`) runs its function again at the start of the
layer's backward, only to remake what the layer's operations saved. A head chunk inside the layer saves little of
its own: attention-only chunks (:mod:`lightning_ulysses.attention.head_chunks`) keep their kernel's graph
(:mod:`lightning_ulysses.attention.kept_graph`) and run no forward in their backward, but the layer's recomputation
runs them again, since the operations after them saved their output. Chunks with the projections inside
(:mod:`lightning_ulysses.hf.projections`) are checkpoint regions of their own, recomputed for their backward: their
attention would run in the forward, in the layer's recomputation and in the region's. With :func:`replayable`
around the layer's function (as :func:`~lightning_ulysses.memory.checkpoint_activations` puts it), two hand-overs
remove the runs that compute nothing new::

    forward:             layer ... chunks: attend, keep each kernel's graph ... rest of the layer
    recomputation:       layer ... chunks: attend again; a region records its attention output (layer_regions)
    backward, region:    the region's recomputation takes the recorded output (no kernel forward), the kernel's
                         backward runs from the graph the forward kept

The recorded outputs (``[B, N/P, H, D_v]`` per layer over its chunks) live from the layer's recomputation to its
chunks' backward, within the layer's backward. Where the layer's activations are offloaded off the device
(``offload_activations`` on CUDA), the layer's forward also keeps the chunks' output (:func:`kept_for_replay`,
``[B, N/P, C]`` per layer, offloaded with the layer's input) and its recomputation takes it instead of running the
chunks: kept in device memory it would add one hidden-state tensor per layer to the peak (on CPU at 32k tokens,
sp=2, 2 layers: 16 MiB of 109), so it is not kept there. The random number generators are left as the chunks left
them in the forward, so the rest of the recomputation draws what the forward drew.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map

from lightning_ulysses.offload import ActivationOffload


class RegionOutput:
    """The output of the attention call inside one head-chunk region, recorded by the layer's recomputation
    (``recording``) and taken by the region's own recomputation (``output``)."""

    def __init__(self) -> None:
        self.recording = False
        self.output: Tensor | None = None


class _LayerRun:
    """One call of a :func:`replayable` function: the results its forward kept, in order, for its recomputation,
    and the head-chunk regions its forward made (:func:`layer_regions`)."""

    def __init__(self, offload: ActivationOffload | None) -> None:
        self.offload = offload
        self.kept: deque[tuple[Any, list[Tensor]]] = deque()
        self.regions: deque[list[RegionOutput]] = deque()
        self.calls = 0

    @property
    def replaying(self) -> bool:
        return self.calls > 1


class _InRegion:
    """Inside a head-chunk region: its :class:`RegionOutput` until its attention call has used it, then ``None``."""

    def __init__(self, holder: RegionOutput | None) -> None:
        self.holder = holder


_current: ContextVar[_LayerRun | None] = ContextVar("lightning_ulysses_layer_run", default=None)
_region: ContextVar[_InRegion | None] = ContextVar("lightning_ulysses_region", default=None)


def replayable(function: Callable[..., Any], offload: ActivationOffload | None) -> Callable[..., Any]:
    """``function`` for one checkpoint call whose saved tensors ``offload`` packs (``None``: none): its first call is
    the forward, any later one the checkpoint's recomputation, in which :func:`kept_for_replay` hands back what the
    forward kept."""
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


def layer_regions(count: int) -> list[RegionOutput | None]:
    """The :class:`RegionOutput` of each of ``count`` head-chunk regions about to run in a :func:`replayable` layer:
    new ones in its forward, the forward's ones (set recording) in its recomputation; ``None`` elsewhere. A region
    binds its own (the forward's) and runs inside :func:`region`."""
    run = _current.get()
    if run is None or not torch.is_grad_enabled():
        return [None] * count
    if not run.replaying:
        made = [RegionOutput() for _ in range(count)]
        run.regions.append(made)
        return list(made)
    if not run.regions:  # a second recomputation (a retained graph)
        return [None] * count
    recorded = run.regions.popleft()
    for holder in recorded:
        holder.recording = True
    return list(recorded)


@contextmanager
def region(holder: RegionOutput | None) -> Iterator[None]:
    """Run a head-chunk region: its first :func:`kept_for_replay` call records into ``holder`` or takes from it."""
    token = _region.set(_InRegion(holder))
    try:
        yield
    finally:
        _region.reset(token)


def kept_for_replay(compute: Callable[[], Any], replay: Callable[[Any], Any]) -> Any:
    """``compute()``, or ``replay(result)`` with a result an earlier run of the same call kept.

    ``replay(result)`` must save for the backward what ``compute()`` saves, in the same order, and return ``result``
    as ``compute()`` would (so that a recomputation remakes every saved tensor of the forward). Inside a head-chunk
    region (:func:`region`) the first call of the region records its tensor result in the layer's recomputation
    and replays it in the region's own recomputation; elsewhere, in a :func:`replayable` layer whose activations
    leave the device, the layer's forward keeps the result (detached, requiring grad as it did) and its
    recomputation replays it.
    """
    inside = _region.get()
    if inside is not None:
        holder, inside.holder = inside.holder, None
        if holder is None:
            return compute()
        if holder.recording:
            holder.recording = False
            result = compute()
            holder.output = result.detach()
            return result
        if holder.output is not None:
            output, holder.output = holder.output, None
            return replay(output)
        return compute()
    run = _current.get()
    if run is None or not torch.is_grad_enabled():
        return compute()
    if not run.replaying:
        result = compute()
        leaves = [x for x in tree_leaves(result) if isinstance(x, Tensor)]
        offload = run.offload
        if offload is not None and leaves and all(offload.streams.offloads(x) for x in leaves):  # off the device
            run.kept.append((tree_map(functools.partial(_keep, offload), result), _rng_states()))
        return result
    if not run.kept:  # nothing kept (on the device), or a second recomputation (a retained graph)
        return compute()
    kept, rng = run.kept.popleft()
    assert run.offload is not None  # kept only where offloaded
    result = replay(tree_map(functools.partial(_take, run.offload), kept))
    _set_rng_states(rng)
    return result


class _Kept:
    def __init__(self, packed: Any, requires_grad: bool) -> None:
        self.packed, self.requires_grad = packed, requires_grad


def _keep(offload: ActivationOffload, x: Any) -> Any:
    return _Kept(offload.pack(x.detach()), x.requires_grad) if isinstance(x, Tensor) else x


def _take(offload: ActivationOffload, x: Any) -> Any:
    if not isinstance(x, _Kept):
        return x
    return offload.unpack(x.packed).detach().requires_grad_(x.requires_grad)


def _rng_states() -> list[Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _set_rng_states(states: list[Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])
