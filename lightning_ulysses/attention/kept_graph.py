"""Kept attention graphs: a kernel's backward run later without its forward, its large saved tensors rebuilt from
tensors the caller gathers again.

A head chunk (:mod:`~lightning_ulysses.attention.head_chunks`) keeps only sequence-sharded tensors for its backward,
so its backward used to run the chunk's attention again to have a graph to differentiate. What a flash-type kernel
saves for its backward is mostly what the chunk's backward gathers again anyway: its query, key, value and output
(permuted views of the call's arguments and result), beside a log-sum-exp (``[B, h, N]`` fp32: one number per output
row, ``1 / D`` of the output) and maybe RNG seeds. :func:`keep_graph` runs the call with autograd recording on
detached arguments, under :func:`torch.autograd.graph.saved_tensors_hooks` that replace each saved tensor that is a
permuted view of an argument or of the result by a recipe, and holds the graph by its result's
:class:`~torch.autograd.graph.GradientEdge` (not the result: its storage is not kept). :meth:`KeptGraph.grads`
rebuilds those tensors from the caller's re-gathered arguments and result, with the strides they were saved with,
and runs the graph's backward: the kernel's backward, without its forward.

Invariants:

* A saved tensor is recognised only if it shares the storage and storage offset of an argument or of the result, has
  its dtype and the same multiset of ``(size, stride)`` pairs: it is that tensor with its dimensions permuted. Nothing
  is guessed, and the test reads metadata only (no host sync).
* Every other saved tensor is kept as it is. Their storages together may hold at most :data:`ROW_BYTES` per row of
  the result (``numel / shape[-1]``) and :data:`SEED_BYTES`: a call that saves more (the math backend's ``[N, N]``
  probabilities or dropout mask, K/V heads repeated by a copy, zero-padded head dims, packed documents gathered into
  a copy, sinks applied after the kernel) keeps no graph, and its caller recomputes the call in the backward.
* Rebuilt tensors have exactly the saved sizes and strides: a permuted view of the re-gathered tensor where its
  strides agree, else a copy into a buffer laid out as the saved tensor's storage was.
* A kept graph runs its backward once (:meth:`KeptGraph.grads` consumes it); the caller recomputes for any later one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge, saved_tensors_hooks

ROW_BYTES = 8
"""Bytes per row of the result that a kept graph may hold besides its recipes: a fp32 log-sum-exp and its padding."""

SEED_BYTES = 256
"""Bytes a kept graph may hold besides :data:`ROW_BYTES` per row: RNG seeds and offsets."""


class _Saved:
    """One tensor the call saved: the tensor itself until the call ends, then either kept (small) or a recipe, a
    permutation of source ``source`` (an argument, or the result last) with the saved sizes, strides and storage."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor: Tensor | None = tensor
        self.source = -1
        self.permutation: tuple[int, ...] = ()
        self.layout = (tensor.shape, tensor.stride(), tensor.storage_offset())
        storage = tensor.untyped_storage()
        self.storage = (storage.data_ptr(), storage.nbytes())
        self.rebuilt: Tensor | None = None

    def recognise(self, sources: Sequence[Tensor]) -> bool:
        """Turn into a recipe if the tensor is a permuted view of one of ``sources``."""
        assert self.tensor is not None
        for index, source in enumerate(sources):
            permutation = _permutation(self.tensor, source)
            if permutation is not None:
                self.source, self.permutation, self.tensor = index, permutation, None
                return True
        return False

    def rebuild(self, sources: Sequence[Tensor], buffers: dict[int, Tensor]) -> None:
        source = sources[self.source]
        size, stride, offset = self.layout
        view = source.permute(self.permutation)
        if view.shape != size:
            raise ValueError(f"a kept graph's saved {tuple(size)} tensor rebuilt from a {tuple(source.shape)} one")
        if view.stride() == stride:
            self.rebuilt = view
            return
        pointer, nbytes = self.storage
        buffer = buffers.get(pointer)
        if buffer is None:  # laid out as the storage the call saw: its tensors' strides and offsets as they were
            buffer = buffers[pointer] = source.new_empty(nbytes // source.element_size())
        self.rebuilt = buffer.as_strided(size, stride, offset).copy_(view)

    def unpack(self) -> Tensor:
        if self.tensor is not None:
            return self.tensor
        assert self.rebuilt is not None, "a kept graph's tensor unpacked outside KeptGraph.grads"
        return self.rebuilt


def _permutation(saved: Tensor, source: Tensor) -> tuple[int, ...] | None:
    """The ``p`` with ``source.permute(p)`` the very view ``saved`` is (storage, offset, sizes and strides), or None."""
    if (
        saved.dtype != source.dtype
        or saved.device != source.device
        or saved.dim() != source.dim()
        or saved.storage_offset() != source.storage_offset()
        or saved.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    ):
        return None
    dims = list(zip(source.shape, source.stride(), strict=True))
    permutation: list[int] = []
    for pair in zip(saved.shape, saved.stride(), strict=True):
        match = next((d for d, other in enumerate(dims) if other == pair and d not in permutation), None)
        if match is None:
            return None
        permutation.append(match)
    return tuple(permutation)


class _Enter(torch.autograd.Function):
    """Aliases of the call's arguments with a node of their own as grad_fn: the graph's input edges, which hold no
    tensor (a leaf's edge, its AccumulateGrad, would keep the leaf's storage). ``anchor``: an empty tensor that
    requires grad, so that the aliases do."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, *arguments: Tensor) -> tuple[Tensor, ...]:
        return tuple(a.detach() for a in arguments)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, ...]:
        return (None,) * (len(grads) + 1)


class KeptGraph:
    """The autograd graph of one call, kept by :func:`keep_graph`: its result's edge, its arguments' edges and the
    tensors it saved (recipes and small kept tensors)."""

    def __init__(self, result: GradientEdge, arguments: list[GradientEdge | None], saved: list[_Saved]) -> None:
        self.result: GradientEdge | None = result
        self.arguments = arguments
        self.saved = saved

    def grads(self, arguments: Sequence[Tensor | None], result: Tensor, grad: Tensor) -> list[Tensor | None]:
        """The gradients of the call's arguments (``None`` for a ``None`` argument or one the result does not depend
        on) for ``grad`` of its result, given ``arguments`` and ``result`` equal to the call's (the same shapes and
        values; any strides). Runs the kept graph's backward and releases the graph."""
        assert self.result is not None, "a kept graph runs its backward once"
        sources = [*(a for a in arguments if a is not None), result]
        buffers: dict[int, Tensor] = {}
        recipes = [s for s in self.saved if s.tensor is None]
        for saved in recipes:
            saved.rebuild(sources, buffers)
        edges = [e for e in self.arguments if e is not None]
        try:
            found = iter(torch.autograd.grad([self.result], edges, [grad], allow_unused=True))
        finally:
            self.result, self.saved = None, []
            for saved in recipes:
                saved.rebuilt = None
        return [None if e is None else next(found) for e in self.arguments]


def keep_graph(fn: Callable[..., Tensor], arguments: Sequence[Tensor | None]) -> tuple[Tensor, KeptGraph | None]:
    """``fn(*arguments)``, detached, and its graph for :meth:`KeptGraph.grads`, or ``None`` where the call saved more
    than recipes and small tensors (see the module docstring). Gradients are taken for every tensor argument; their
    ``requires_grad`` is not read. Runs with autograd recording whatever the grad mode."""
    saved: list[_Saved] = []

    def pack(tensor: Tensor) -> _Saved:
        saved.append(_Saved(tensor))
        return saved[-1]

    with torch.enable_grad():
        present = [a for a in arguments if a is not None]
        entered = iter(_Enter.apply(torch.empty(0, requires_grad=True), *present))
        aliases = [None if a is None else next(entered) for a in arguments]
        with saved_tensors_hooks(pack, _Saved.unpack):
            result = fn(*aliases)
    sources = [*(a for a in aliases if a is not None), result]
    kept_bytes, storages = 0, set()
    for s in saved:
        if not s.recognise(sources) and s.storage[0] not in storages:
            storages.add(s.storage[0])
            kept_bytes += s.storage[1]
    rows = result.numel() // max(result.shape[-1], 1)
    if result.grad_fn is None or kept_bytes > ROW_BYTES * rows + SEED_BYTES:
        return result.detach(), None  # the graph goes with the result
    graph = KeptGraph(get_gradient_edge(result), [None if a is None else get_gradient_edge(a) for a in aliases], saved)
    return result.detach(), graph
