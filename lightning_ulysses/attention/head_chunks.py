"""Head-chunked Ulysses attention: one fused all-to-all per chunk of heads, each chunk's backward run from its kernel's
kept graph.

Plain Ulysses gathers the whole sequence of all of a rank's ``h`` head slots at once and autograd keeps the gathered
``[B, N, h, D]`` query, key, value and output until the backward. Here the rank's head slots are cut into
``chunks`` chunks and the layer runs one chunk at a time::

    forward, chunk j:   q, k, v slots of chunk j  [B, N/P, ...]  --one all-to-all-->  [B, N, h_j, D] each
                        attention of chunk j, its graph kept without q, k, v, out     [B, N, h_j, D_v]
                        output of chunk j  --one all-to-all-->  its heads of the [B, N/P, H, D_v] output
    backward, chunk j:  q, k, v of chunk j  --one all-to-all, as in the forward-->  [B, N, h_j, ...]
                        its output, then its output gradient  --one all-to-all each-->  [B, N, h_j, D_v]
                        the kept graph's backward (the kernel's backward, no forward)
                        dq, dk, dv of chunk j  --one all-to-all-->  added to the [B, N/P, ...] input gradients

So the forward sends one collective per chunk each way (plain Ulysses: three in, one out), the backward four per
chunk (each gather separate, so that q, k, v and the output arrive with the strides the kernel saw, no copy; on CPU
each is started when taken, so one send buffer is alive at a time). The layer keeps nothing of the whole sequence
for its backward (its sequence-sharded inputs and output, and per chunk what
:mod:`~lightning_ulysses.attention.kept_graph` keeps: the kernel's log-sum-exp, ``1 / D`` of the chunk's output), and
the whole-sequence tensors alive at any time are one chunk's: ``1 / chunks`` of plain Ulysses'.
The kernel's forward runs once per step, as plain Ulysses'. A chunk whose kernel saves what cannot be gathered again
(the math backend's probabilities, attention dropout's mask on CPU, packed documents gathered into copies, windows'
query blocks, sinks applied after the kernel) or that holds inert slots (their output is dropped) keeps no graph:
its backward gathers q, k, v and the output gradient in one all-to-all and runs its attention again, replaying the
forward's RNG. A layer checkpointed by :func:`~lightning_ulysses.memory.checkpoint_activations` runs the chunks again
in its recomputation (its operations save the output), unless its activations are offloaded off the device: then
its recomputation takes the output its forward kept (:mod:`lightning_ulysses.replay`).

A chunk is either whole K/V groups (``chunks <= kv_h``: the K/V slots are split, each with its query slots) or part
of one K/V group, whose K/V slot then travels with each of its chunks: the local attention is always ordinary GQA.
Every rank of the group has the same layout (:func:`~lightning_ulysses.heads.plan_heads`), so the same chunks.

On CUDA, the all-to-all of chunk ``j + 1`` is started (``async_op``: NCCL runs it on its own stream, ordered after
the work already queued on the compute stream by an event, and keeps its buffers alive until it is waited on)
before chunk ``j`` attends, and the compute stream waits for it (an event wait, no host sync) only where its result
is read; an output's all-to-all back likewise overlaps the next chunk. Two chunks' inputs are then alive at once.
On CPU (gloo) every all-to-all is waited on at once: the same code, synchronous. The CUDA overlap is not measured.
Every exchange is a :class:`~lightning_ulysses.attention.collectives.Exchange`, the package's all-to-all: while the
SP group's observer watches (``SequenceParallelMonitor(time_all_to_all=True)``), each runs through it, synchronously.

Transformers attention modules whose projections narrow per head run their chunks one level up instead, projections
included (:mod:`lightning_ulysses.hf.projections`), with :func:`chunk_heads`' heads; this module then runs the
attention of the others (and of custom models calling :func:`~lightning_ulysses.ulysses_attention`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_ulysses.attention.collectives import Exchange, by_sequence, rank_slots, whole_sequence
from lightning_ulysses.attention.kept_graph import KeptGraph, keep_graph
from lightning_ulysses.groups import CollectiveObserver
from lightning_ulysses.heads import HeadLayout
from lightning_ulysses.replay import kept_for_replay

HeadChunks = int | Literal["auto"]
"""``int``: that many chunks of each rank's head slots (at most one slot per chunk: larger counts run one slot per
chunk); ``"auto"``: :func:`auto_chunks`."""

Attend = Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]
"""``(query [B, N, h_j, D], key [B, N, kv_j, D], value [B, N, kv_j, D_v], sinks [h_j] or None) -> [B, N, h_j, D_v]``:
the local attention of one chunk on the gathered sequence."""


@dataclass(frozen=True)
class HeadChunk:
    """One chunk of a rank's head slots: ``query`` and ``kv`` are rank-local slot indices (the same on every rank)."""

    query: tuple[int, ...]
    kv: tuple[int, ...]


def check_head_chunks(head_chunks: Any) -> None:
    """Refuse a ``head_chunks`` setting that is neither ``None``, a positive ``int`` nor ``"auto"``."""
    if head_chunks in (None, "auto"):
        return
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
        raise ValueError(f"head_chunks must be a positive integer, 'auto' or None, got {head_chunks!r}.")


@functools.cache
def plan_chunks(layout: HeadLayout, chunks: int) -> tuple[HeadChunk, ...]:
    """The ``min(chunks, heads_per_rank)`` chunks of a rank's head slots, as equal as the K/V groups allow."""
    heads, kv_heads = layout.heads_per_rank, layout.kv_heads_per_rank
    group = heads // kv_heads  # query slots per K/V slot
    chunks = min(chunks, heads)
    if chunks <= kv_heads:  # whole K/V groups
        return tuple(
            HeadChunk(tuple(range(kv[0] * group, (kv[-1] + 1) * group)), tuple(kv))
            for kv in _split(range(kv_heads), chunks)
        )
    planned = []
    for kv, parts in enumerate(_sizes(chunks, kv_heads)):  # each K/V group cut into `parts` chunks
        for query in _split(range(kv * group, (kv + 1) * group), parts):
            planned.append(HeadChunk(tuple(query), (kv,)))
    return tuple(planned)


def _sizes(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def _split(items: Sequence[int], parts: int) -> list[list[int]]:
    bounds = [0]
    for size in _sizes(len(items), parts):
        bounds.append(bounds[-1] + size)
    return [list(items[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def auto_chunks(layout: HeadLayout, qk_dim: int, value_dim: int) -> int:
    """The fewest chunks whose largest chunk's whole-sequence query, key, value and output take no more bytes than
    this rank's query shard ``[B, N/P, H, qk_dim]`` (a tensor the layer holds anyway). The batch and the length
    cancel out (``B * N`` tokens of ``P * slots`` against ``B * N / P`` of ``H`` heads), so every rank of the group,
    and every batch, picks the same count. The counts are tried from 1 up, so the first that fits is the fewest (a
    larger count may not fit where a smaller one does: a K/V slot travels with each chunk of its group); where none
    fits (one query slot per rank, or a K/V slot as wide as its queries), one slot per chunk, the most there are."""
    budget = layout.num_heads * qk_dim
    width = qk_dim + value_dim
    for chunks in range(1, layout.heads_per_rank + 1):
        largest = max((len(c.query) + len(c.kv)) * width for c in plan_chunks(layout, chunks))
        if layout.sp_size * largest <= budget:
            return chunks
    return layout.heads_per_rank


def _slots(layout: HeadLayout, chunk: HeadChunk) -> tuple[list[int], list[int]]:
    """The query and K/V slots of ``chunk`` on every rank, rank-major (slot ``s`` of rank ``r`` at ``r * h_j + s``)."""
    ranks = range(layout.sp_size)
    return (
        [r * layout.heads_per_rank + s for r in ranks for s in chunk.query],
        [r * layout.kv_heads_per_rank + s for r in ranks for s in chunk.kv],
    )


@functools.cache
def chunk_heads(layout: HeadLayout, chunks: int) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Per chunk, the source heads of its query and K/V slots on every rank, rank-major: the heads, in order, that
    the chunk's all-to-all sends (``[P * h_j]`` query and ``[P * kv_j]`` K/V heads, a replicated K/V head repeated)."""
    heads = []
    for chunk in plan_chunks(layout, chunks):
        query_slots, kv_slots = _slots(layout, chunk)
        heads.append((tuple(layout.query_slots[s] for s in query_slots), tuple(layout.kv_slots[s] for s in kv_slots)))
    return tuple(heads)


@dataclass(frozen=True)
class _Routes:
    """Index tensors of one chunk on this rank's ``[B, N/P, H, ...]`` tensors, destination rank by rank: the source
    heads of its query and K/V slots, which of the received output slots are real query heads, and the head whose
    output each slot holds (``None`` where a slot is inert: its output is dropped, so it cannot be gathered again)."""

    query_heads: Tensor  # [P * h_j]: source query head of slot s of rank r at r * h_j + s
    kv_heads: Tensor  # [P * kv_j]
    output_heads: Tensor  # the query heads whose output this chunk holds
    output_slots: Tensor  # their position in the received [P * h_j] slots
    slot_outputs: Tensor | None  # [P * h_j]: the query head whose output slot s of rank r is


@functools.lru_cache(maxsize=256)
def _routes(layout: HeadLayout, chunks: int, device: torch.device) -> tuple[_Routes, ...]:
    routes = []
    for chunk, (query_heads, kv_heads) in zip(plan_chunks(layout, chunks), chunk_heads(layout, chunks), strict=True):
        query_slots, _ = _slots(layout, chunk)
        position = {slot: i for i, slot in enumerate(query_slots)}
        heads = [h for h, slot in enumerate(layout.output_slots) if slot in position]
        slot_outputs = {position[layout.output_slots[h]]: h for h in heads}
        index = functools.partial(torch.tensor, dtype=torch.long, device=device)
        routes.append(
            _Routes(
                index(query_heads),
                index(kv_heads),
                index(heads),
                index([position[layout.output_slots[h]] for h in heads]),
                index([slot_outputs[s] for s in range(len(query_slots))])
                if len(slot_outputs) == len(query_slots)
                else None,
            )
        )
    return tuple(routes)


def _to_ranks(source: Sequence[tuple[Tensor, Tensor]], sp: int) -> Tensor:
    """The send buffer ``[P, B, n, sum_i c_i * d_i]`` of sequence-sharded ``[B, n, H_i, d_i]`` tensors, each with the
    ``[P * c_i]`` heads of its slots for every destination rank, rank-major; written in place, rank by rank."""
    x = source[0][0]
    widths = [len(heads) // sp * t.shape[-1] for t, heads in source]
    send = x.new_empty((sp, *x.shape[:2], sum(widths)))
    for (t, heads), part in zip(source, send.split(widths, dim=-1), strict=True):
        for rank, to_rank in enumerate(heads.chunk(sp)):
            part[rank].copy_(t.index_select(2, to_rank).flatten(2))
    return send


class _ChunkedUlysses(torch.autograd.Function):
    """``query [B, N/P, H, D]``, ``key [B, N/P, H_kv, D]``, ``value [B, N/P, H_kv, D_v]``, ``sinks [H]`` or ``None``
    -> ``[B, N/P, H, D_v]`` (see the module docstring); keeps the inputs, the output and each chunk's
    :class:`~lightning_ulysses.attention.kept_graph.KeptGraph` for the backward. ``replayed``: the output, known
    already (a checkpointed layer's recomputation, :func:`~lightning_ulysses.replay.kept_for_replay`): nothing is
    computed, the same tensors are saved."""

    @staticmethod
    def forward(
        ctx: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        sinks: Tensor | None,
        layout: HeadLayout,
        chunks: int,
        group: ProcessGroup,
        attend: Attend,
        rank: int,
        random: bool,
        observer: CollectiveObserver | None,
        replayed: Tensor | None,
        record: bool,
    ) -> Tensor:
        ctx.layout, ctx.chunks, ctx.group, ctx.attend, ctx.rank = layout, chunks, group, attend, rank
        ctx.observer, ctx.autocast = observer, _autocast_state(query.device)
        ctx.rng_states, ctx.kept = [], []
        if replayed is not None:
            out = replayed.detach()
            ctx.save_for_backward(query, key, value, sinks, out)
            return out
        routes = _routes(layout, chunks, query.device)
        sp, overlap = layout.sp_size, query.is_cuda
        out = query.new_empty((*query.shape[:3], value.shape[-1]))

        def start(j: int) -> Exchange:
            return Exchange(_inputs_to_ranks(routes[j], query, key, value, sp), group, observer)

        incoming, returning = start(0), None
        for j, r in enumerate(routes):
            q, k, v = whole_sequence(incoming.take(), _widths(r, query, value, sp))
            if overlap and j + 1 < len(routes):
                incoming = start(j + 1)  # arrives while this chunk attends
            ctx.rng_states.append(_rng_state(query.device) if random else None)
            chunk_sinks = _chunk_sinks(sinks, layout, r, rank)
            if r.slot_outputs is None or not record:  # inert slots: recomputed in the backward; no backward
                result, kept = attend(q, k, v, chunk_sinks), None
            else:
                result, kept = keep_graph(attend, (q, k, v, chunk_sinks))
            ctx.kept.append(kept)
            del q, k, v
            if returning is not None:
                _place(out, *returning, value, sp)
            returning = (Exchange(by_sequence([result], sp), group, observer), r)
            del result
            if not overlap:  # CPU: one chunk at a time
                _place(out, *returning, value, sp)
                returning = None
                if j + 1 < len(routes):
                    incoming = start(j + 1)
        if returning is not None:
            _place(out, *returning, value, sp)
        ctx.save_for_backward(query, key, value, sinks, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, sinks, out = ctx.saved_tensors
        layout, group, attend, rank, observer = ctx.layout, ctx.group, ctx.attend, ctx.rank, ctx.observer
        routes = _routes(layout, ctx.chunks, query.device)
        sp, overlap = layout.sp_size, query.is_cuda
        kept: list[KeptGraph | None] = ctx.kept if len(ctx.kept) == len(routes) else [None] * len(routes)
        ctx.kept = []  # a second backward (a retained graph) recomputes
        grads: list[Tensor | None] = [None, None, None]  # made at the first chunk's return: not alive at its peak
        grad_sinks = None if sinks is None else torch.zeros_like(sinks)

        def exchange(send: Callable[[], Tensor]) -> Exchange | _Deferred:  # CPU: one send buffer alive at a time
            return Exchange(send(), group, observer) if overlap else _Deferred(send, group, observer)

        def start(j: int) -> list[Exchange | _Deferred]:
            r = routes[j]
            if kept[j] is not None:  # q, k, v as the forward gathered them, then its output, then the output gradient
                assert r.slot_outputs is not None
                return [
                    exchange(functools.partial(_inputs_to_ranks, r, query, key, value, sp)),
                    exchange(functools.partial(_to_ranks, [(out, r.slot_outputs)], sp)),
                    exchange(functools.partial(_to_ranks, [(grad, r.slot_outputs)], sp)),
                ]

            def send() -> Tensor:
                grad_out = grad.new_zeros((*grad.shape[:2], len(r.query_heads), grad.shape[-1]))
                grad_out.index_copy_(2, r.output_slots, grad.index_select(2, r.output_heads))  # inert slots: zero
                slots = torch.arange(len(r.query_heads), device=grad.device)
                return _to_ranks(
                    [(query, r.query_heads), (key, r.kv_heads), (value, r.kv_heads), (grad_out, slots)], sp
                )

            return [exchange(send)]

        incoming, returning = start(0), None
        for j, r in enumerate(routes):
            widths = _widths(r, query, value, sp)
            chunk_sinks = _chunk_sinks(sinks, layout, r, rank)
            graph = kept[j]
            if graph is not None:
                q, k, v = whole_sequence(incoming[0].take(), widths)
                output = [(widths[0][0], widths[2][1])]
                ((result,), (grad_out,)) = (whole_sequence(e.take(), output) for e in incoming[1:])
            else:
                q, k, v, grad_out = whole_sequence(incoming[0].take(), [*widths, (widths[0][0], widths[2][1])])
            if overlap and j + 1 < len(routes):
                incoming = start(j + 1)
            if graph is not None:
                kept[j] = None
                raw = graph.grads((q, k, v, chunk_sinks), result, grad_out)
                del result
            else:  # the chunk's attention again, for its graph
                leaves = [None if t is None else t.detach().requires_grad_() for t in (q, k, v, chunk_sinks)]
                with torch.enable_grad(), _replay(ctx.rng_states[j], query.device), torch.autocast(**ctx.autocast):
                    result = attend(*leaves)
                wrt = [t for t in leaves if t is not None]
                raw = list(torch.autograd.grad(result, wrt, grad_out, allow_unused=True))
                raw += [None] * (4 - len(raw))
                del leaves, wrt, result
            chunk_grads = [None if t is None else _zero_if_none(g, t) for g, t in zip(raw, (q, k, v, chunk_sinks))]
            del q, k, v, grad_out, raw
            if grad_sinks is not None:
                grad_sinks.index_add_(0, _rank_query_heads(layout, r, rank), chunk_grads[3])  # type: ignore[arg-type]
            if returning is not None:
                _accumulate(grads, *returning, (query, key, value), sp)
            returning = (Exchange(by_sequence(chunk_grads[:3], sp), group, observer), r)  # type: ignore[arg-type]
            del chunk_grads
            if not overlap:
                _accumulate(grads, *returning, (query, key, value), sp)
                returning = None
                if j + 1 < len(routes):
                    incoming = start(j + 1)
        if returning is not None:
            _accumulate(grads, *returning, (query, key, value), sp)
        return (*grads, grad_sinks, None, None, None, None, None, None, None, None, None)


class _Deferred:
    """An :class:`~lightning_ulysses.attention.collectives.Exchange` of ``send()`` started only when taken: where
    exchanges run one at a time (CPU), a chunk's send buffers are then not alive together."""

    def __init__(self, send: Callable[[], Tensor], group: ProcessGroup, observer: CollectiveObserver | None) -> None:
        self.send, self.group, self.observer = send, group, observer

    def take(self) -> Tensor:
        return Exchange(self.send(), self.group, self.observer).take()


def _inputs_to_ranks(r: _Routes, query: Tensor, key: Tensor, value: Tensor, sp: int) -> Tensor:
    """The send buffer of a chunk's query, key and value slots: the same in the forward and the backward, so that
    the backward gathers them with the strides the kernel saw."""
    return _to_ranks([(query, r.query_heads), (key, r.kv_heads), (value, r.kv_heads)], sp)


def _widths(r: _Routes, query: Tensor, value: Tensor, sp: int) -> list[tuple[int, int]]:
    """``(slots, head size)`` of a chunk's query, key and value on the gathered sequence."""
    heads, kv = len(r.query_heads) // sp, len(r.kv_heads) // sp
    return [(heads, query.shape[-1]), (kv, query.shape[-1]), (kv, value.shape[-1])]


def _place(out: Tensor, back: Exchange, r: _Routes, value: Tensor, sp: int) -> None:
    """Write the real query heads of a chunk's returned output into ``out [B, N/P, H, D_v]``."""
    (slots,) = rank_slots(back.take(), [(len(r.query_heads) // sp, value.shape[-1])])
    out.index_copy_(2, r.output_heads, slots.index_select(2, r.output_slots))


def _accumulate(grads: list[Tensor | None], back: Exchange, r: _Routes, inputs: Sequence[Tensor], sp: int) -> None:
    """Add a chunk's returned query, key and value gradients into the input gradients (replicated slots sum)."""
    received = rank_slots(back.take(), _widths(r, inputs[0], inputs[2], sp))
    for i, (heads, part) in enumerate(zip((r.query_heads, r.kv_heads, r.kv_heads), received, strict=True)):
        if grads[i] is None:
            grads[i] = torch.zeros_like(inputs[i])
        grads[i].index_add_(2, heads, part)  # type: ignore[union-attr]


def _rank_query_heads(layout: HeadLayout, r: _Routes, rank: int) -> Tensor:
    """The source heads ``[h_j]`` of the query slots of a chunk that rank ``rank`` of the group attends."""
    heads = len(r.query_heads) // layout.sp_size
    return r.query_heads[rank * heads : (rank + 1) * heads]


def _chunk_sinks(sinks: Tensor | None, layout: HeadLayout, r: _Routes, rank: int) -> Tensor | None:
    """The sinks ``[h_j]`` of the query slots of a chunk that rank ``rank`` of the group attends."""
    return None if sinks is None else sinks.index_select(0, _rank_query_heads(layout, r, rank))


def _zero_if_none(g: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if g is None else g


def _rng_state(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


class _replay:
    """Run with the RNG state a chunk's forward saw (attention dropout draws the same mask); ``None``: as is."""

    def __init__(self, state: Tensor | None, device: torch.device) -> None:
        self.state, self.device = state, device
        self.fork: Any = None

    def __enter__(self) -> None:
        if self.state is None:
            return
        devices = [self.device] if self.device.type == "cuda" else []
        self.fork = torch.random.fork_rng(devices=devices, device_type=self.device.type)
        self.fork.__enter__()
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(self.state, self.device)
        else:
            torch.set_rng_state(self.state)

    def __exit__(self, *exc: object) -> None:
        if self.fork is not None:
            self.fork.__exit__(*exc)


def _autocast_state(device: torch.device) -> dict[str, Any]:
    kind = device.type
    return dict(device_type=kind, enabled=torch.is_autocast_enabled(kind), dtype=torch.get_autocast_dtype(kind))


def chunked_ulysses(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    sinks: Tensor | None,
    layout: HeadLayout,
    group: ProcessGroup,
    attend: Attend,
    head_chunks: HeadChunks,
    *,
    random: bool = False,
    observer: CollectiveObserver | None = None,
) -> Tensor:
    """Ulysses attention over ``group`` in chunks of heads (see the module docstring).

    Args:
        query: ``[B, N/P, H, D]``; key: ``[B, N/P, H_kv, D]``; value: ``[B, N/P, H_kv, D_v]`` (one dtype).
        sinks: ``[H]`` attention sink logits (``None``: none); each chunk's ``attend`` gets its slots' ``[h_j]``.
        layout: the head layout of ``H`` and ``H_kv`` over the ``P`` ranks of ``group``.
        attend: the local attention of one chunk on the gathered sequence (:data:`Attend`); run in the forward
            (its graph kept, :func:`~lightning_ulysses.attention.kept_graph.keep_graph`), and once more in the
            backward, on the same inputs, only where that graph is not kept.
        head_chunks: the chunk count (:data:`HeadChunks`).
        random: ``attend`` draws random numbers (attention dropout): each chunk's backward replays its forward's RNG.
        observer: the SP group's :class:`~lightning_ulysses.groups.CollectiveObserver`: every all-to-all runs through
            :class:`~lightning_ulysses.attention.collectives.Exchange`, which reports it there while it observes.

    Returns ``[B, N/P, H, D_v]``, exactly plain Ulysses' output; gradients reach ``query``, ``key``, ``value`` and
    ``sinks`` (this rank's attended heads, as in plain Ulysses).
    """
    chunks = auto_chunks(layout, query.shape[-1], value.shape[-1]) if head_chunks == "auto" else head_chunks
    check_head_chunks(chunks)
    rank = dist.get_rank(group)
    record = torch.is_grad_enabled()  # evaluation keeps no graphs (the Function's forward runs without grad mode)

    def compute(replayed: Tensor | None = None) -> Tensor:
        return _ChunkedUlysses.apply(
            query, key, value, sinks, layout, int(chunks), group, attend, rank, random, observer, replayed, record
        )

    # in a recomputation, the output an earlier run kept where it did (lightning_ulysses.replay): the chunks' output
    # and saved tensors without attending
    return kept_for_replay(compute, compute)
