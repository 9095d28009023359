"""Head-chunked Ulysses attention (``head_chunks``) against plain Ulysses and the dense reference, on gloo.

One launch of 4 processes runs every case at sp=4 and sp=2 with chunks of all heads (``head_chunks=1``), 2 heads,
1 head and ``"auto"``, and under ring 2 x Ulysses 2; it also counts the all-to-alls of one layer (forward and
backward), the host syncs inside it and the largest whole-sequence tensor it makes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ulysses.attention import ulysses_attention
from lightning_ulysses.attention.head_chunks import HeadChunk, auto_chunks, check_head_chunks, plan_chunks
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.heads import plan_heads
from lightning_ulysses.memory import checkpoint_activations
from lightning_ulysses.offload import ActivationOffload
from lightning_ulysses.sharding import shard_index
from lightning_ulysses.topology import SequenceParallelTopology
from tests.launch import launch
from tests.test_attention import CASES as ATTENTION_CASES
from tests.test_attention import _tensors, reference, sink_logits
from tests.test_host_syncs import HostSyncs
from tests.test_offload import RecordingStreams
from tests.test_ring import _groups

# packed documents, windows, chunked attention, sinks, GQA with replicated K/V (kv < sp), inert head slots (6 heads
# on 4 ranks), MLA's value heads
CASES = {
    name: ATTENTION_CASES[name]
    for name in (
        "mha",
        "gqa_kv_divisible",
        "gqa_kv_replicated",
        "heads6_mqa",
        "heads6_kv2",
        "packed_sliding_window",
        "chunked_packed",
        "sinks_heads6_kv2_packed_window",
        "mla_sinks_heads6_kv3_chunked_packed",
    )
}
RING_CASES = ("gqa_kv_divisible", "packed_sliding_window", "sinks_heads6_kv2_packed_window")
CHUNKINGS = ("heads", 2, 1, "auto")  # chunks of: all heads (one chunk), 2 heads, 1 head; "auto"


def _chunks(chunking: Any, heads_per_rank: int) -> Any:
    """The ``head_chunks`` of a chunking: ``"heads"`` -> 1 chunk, ``n`` heads per chunk -> ``ceil(h / n)`` chunks."""
    if chunking == "heads":
        return 1
    return chunking if chunking == "auto" else -(-heads_per_rank // chunking)


def _run(
    case: dict[str, Any], group: SequenceParallelGroups, index: torch.Tensor, head_chunks: Any
) -> list[torch.Tensor]:
    """Output and gradients (q, k, v, and the sinks summed over the group) of this rank's shard ``index``."""
    q, k, v, grad, pos = _tensors(case)
    sinks = sink_logits(case)
    shards = [t[:, index].clone().requires_grad_() for t in (q, k, v)]
    rank_sinks = None if sinks is None else sinks.clone().requires_grad_()
    out = ulysses_attention(
        *shards,
        group=group,
        attn_implementation="sdpa",
        window=case.get("window"),
        chunk=case.get("chunk"),
        sinks=rank_sinks,
        position_ids=None if pos is None else pos[:, index],
        head_chunks=head_chunks,
    )
    out.backward(grad[:, index])
    results = [out.detach(), *(s.grad for s in shards)]
    if rank_sinks is not None:
        dist.all_reduce(rank_sinks.grad, group=group.sp)
        results.append(rank_sinks.grad)
    return results


def _expected(case: dict[str, Any], index: torch.Tensor) -> list[torch.Tensor]:
    q, k, v, grad, pos = _tensors(case)
    sinks = sink_logits(case)
    full = [t.clone().requires_grad_() for t in (q, k, v) + (() if sinks is None else (sinks,))]
    out = reference(
        *full[:3], pos, window=case.get("window"), chunk=case.get("chunk"), sinks=None if sinks is None else full[3]
    )
    out.backward(grad)
    sink_grads = [] if sinks is None else [full[3].grad]
    return [out.detach()[:, index], *(f.grad[:, index] for f in full[:3]), *sink_grads]


def _error(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max(((a - b).norm() / b.norm()).item() for a, b in zip(got, expected, strict=True))


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op returns whose dim 1 is ``tokens`` long (a whole-sequence tensor)."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens, self.largest = tokens, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() > 1 and t.shape[1] == self.tokens:
                self.largest = max(self.largest, t.numel())
        return out


def _layer_probes(groups: SequenceParallelGroups, head_chunks: Any, packed: bool = True) -> dict[str, Any]:
    """All-to-alls (forward, backward), host syncs and the largest whole-sequence tensor of one layer: 8 heads,
    4 K/V heads, 64 tokens; packed documents and a window (their kernel's graph saves copies: recomputed in the
    backward), or one document (its graph kept)."""
    sp, rank = groups.topology.sp_size, groups.topology.sp_rank
    case = dict(batch=1, seq=64, heads=8, kv_heads=4)
    q, k, v, grad, _ = _tensors(case)
    index = shard_index(64, rank, sp)
    lengths = (20, 30, 14) if packed else (64,)
    pos = torch.cat([torch.arange(n) for n in lengths])[None, index]  # one tensor: its documents found once
    window = 9 if packed else None
    shards = [t[:, index].clone().requires_grad_() for t in (q, k, v)]
    calls: Counter[str] = Counter()
    original = dist.all_to_all_single
    phase = "forward"

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[phase] += 1
        return original(*args, **kwargs)

    observed: Counter[str] = Counter()

    def observer(run: Any) -> Any:  # as SequenceParallelMonitor(time_all_to_all=True)'s timer wraps each call
        observed[phase] += 1
        return run()

    syncs, largest = HostSyncs(), _Largest(64)
    ulysses_attention(*shards, group=groups, position_ids=pos, window=window, head_chunks=head_chunks)  # plans
    dist.all_to_all_single = counted
    groups.observer.all_to_all = observer
    try:
        with syncs.methods_counted(), largest:
            syncs.where = "layer"
            out = ulysses_attention(*shards, group=groups, position_ids=pos, window=window, head_chunks=head_chunks)
            phase = "backward"
            out.backward(grad[:, index])
    finally:
        dist.all_to_all_single = original
        groups.observer.all_to_all = None
    return {"calls": dict(calls), "observed": dict(observed), "syncs": dict(syncs.counts), "largest": largest.largest}


def _checkpointed_layer(group: SequenceParallelGroups, head_chunks: int) -> dict[str, Any]:
    """Attention kernel calls (SDPA's) of one forward + backward of a layer, and the relative error of its output and
    gradients against the same layer unchekpointed: unchekpointed, checkpointed by checkpoint_activations on the
    device, and with its activations offloaded (CPU tensors playing device ones)."""
    sp, rank = dist.get_world_size(group.sp), dist.get_rank(group.sp)
    case = dict(batch=1, seq=64, heads=8, kv_heads=4)
    q, k, v, grad, _ = _tensors(case)
    index = shard_index(64, rank, sp)
    calls: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return sdpa(*args, **kwargs)

    def layer(*shards: torch.Tensor) -> torch.Tensor:
        return ulysses_attention(*(2 * t for t in shards), group=group, head_chunks=head_chunks) + 1

    runs = {}
    torch.nn.functional.scaled_dot_product_attention = counted
    try:
        for checkpointed in (False, "device", "offloaded"):
            shards = [t[:, index].clone().requires_grad_() for t in (q, k, v)]
            calls.clear()
            offload = ActivationOffload(RecordingStreams()) if checkpointed == "offloaded" else False
            out = checkpoint_activations(layer, *shards, offload=offload) if checkpointed else layer(*shards)
            out.backward(grad[:, index])
            runs[checkpointed] = ([out.detach(), *(t.grad for t in shards)], len(calls))
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    return {
        "calls": {name: calls for name, (_, calls) in runs.items()},
        "error": max(_error(got, runs[False][0]) for got, _ in runs.values()),
    }


def _backward_twice(group: SequenceParallelGroups, head_chunks: int) -> float:
    """Relative error of the gradients of two backwards through one retained graph against twice one backward's: the
    first runs the chunks' kept graphs, the second recomputes them."""
    sp, rank = dist.get_world_size(group.sp), dist.get_rank(group.sp)
    q, k, v, grad, _ = _tensors(dict(batch=1, seq=64, heads=8, kv_heads=4))
    index = shard_index(64, rank, sp)
    runs = []
    for times in (1, 2):
        shards = [t[:, index].clone().requires_grad_() for t in (q, k, v)]
        out = ulysses_attention(*shards, group=group, head_chunks=head_chunks)
        for _ in range(times):
            out.backward(grad[:, index], retain_graph=True)
        runs.append([t.grad for t in shards])
    return _error(runs[1], [2 * g for g in runs[0]])


def _dropout_value_gradient(group: SequenceParallelGroups) -> float:
    """With attention dropout (CPU: SDPA's math kernel, whose mask a kept graph cannot hold: each chunk recomputed
    with its forward's RNG), the value gradient of ``<grad, out>`` against its exact directional change: for fixed
    masks the output is linear in the value, so ``<grad, out(v + d)> - <grad, out(v)> = <dv, d>`` summed over the
    group's ranks. A backward drawing other masks than its forward misses it by far."""
    sp, rank = dist.get_world_size(group.sp), dist.get_rank(group.sp)
    q, k, v, grad, _ = _tensors(dict(batch=1, seq=64, heads=8, kv_heads=4))
    index = shard_index(64, rank, sp)
    q, k, v, grad = (t[:, index] for t in (q, k, v, grad))
    step = torch.randn(v.shape, generator=torch.Generator().manual_seed(5))

    def attended(value: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(7 + rank)
        return ulysses_attention(q, k, value, group=group, head_chunks=2, dropout_p=0.5)

    leaf = v.clone().requires_grad_()
    attended(leaf).backward(grad)
    assert leaf.grad is not None
    with torch.no_grad():
        sums = torch.stack([(grad * (attended(v + step) - attended(v))).sum(), (leaf.grad * step).sum()])
    dist.all_reduce(sums, group=group.sp)
    return float((sums[0] - sums[1]).abs() / sums[1].abs())


def worker(args: dict[str, Any]) -> dict[Any, Any]:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # the SP groups of the whole world (sp=4) and of pairs of ranks (sp=2), as UlyssesStrategy builds them
    groups = {sp: SequenceParallelGroups.create(SequenceParallelTopology(world, sp, rank), "cpu") for sp in (4, 2)}
    results: dict[Any, Any] = {}
    for (name, case), sp in itertools.product(CASES.items(), (4, 2)):
        index = shard_index(case["seq"], rank % sp, sp)
        expected = _expected(case, index)
        plain = _run(case, groups[sp], index, None)
        results[name, sp, "plain"] = _error(plain, expected)
        heads_per_rank = plan_heads(case["heads"], case["kv_heads"], sp).heads_per_rank
        for chunking in CHUNKINGS:
            chunked = _run(case, groups[sp], index, _chunks(chunking, heads_per_rank))
            results[name, sp, chunking] = (_error(chunked, expected), _error(chunked, plain))
    ring_groups = _groups(2, 2)
    for name in RING_CASES:
        case = CASES[name]
        index = shard_index(case["seq"], dist.get_rank(ring_groups.sp), 4, ring_size=2)
        expected = _expected(case, index)
        for chunking in ("heads", 1):
            heads_per_rank = plan_heads(case["heads"], case["kv_heads"], 2).heads_per_rank
            results[name, "ring", chunking] = _error(
                _run(case, ring_groups, index, _chunks(chunking, heads_per_rank)), expected
            )
    for head_chunks in (None, 1, 2, 4):
        results["probes", head_chunks] = _layer_probes(groups[2], head_chunks)
    for head_chunks in (1, 4):
        results["kept probes", head_chunks] = _layer_probes(groups[2], head_chunks, packed=False)
    for head_chunks in (1, 4):
        results["checkpointed", head_chunks] = _checkpointed_layer(groups[2], head_chunks)
    results["twice"] = _backward_twice(groups[2], 4)
    results["dropout"] = _dropout_value_gradient(groups[2])
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def results() -> list[dict[Any, Any]]:
    return launch("tests.test_head_chunks:worker", 4, {})


@pytest.mark.parametrize("sp", (4, 2))
@pytest.mark.parametrize("name", CASES)
def test_chunked_equals_plain_ulysses_and_the_reference(results: list[dict[Any, Any]], name: str, sp: int) -> None:
    """Output and every gradient on every rank, relative error < 1e-5, for each chunking."""
    for rank, got in enumerate(results):
        assert got[name, sp, "plain"] < 1e-5
        for chunking in CHUNKINGS:
            to_reference, to_plain = got[name, sp, chunking]
            assert to_reference < 1e-5 and to_plain < 1e-5, f"rank {rank}, chunks of {chunking}: {to_reference:.2e}"


@pytest.mark.parametrize("name", RING_CASES)
def test_chunked_ulysses_x_ring_equals_the_reference(results: list[dict[Any, Any]], name: str) -> None:
    for rank, got in enumerate(results):
        for chunking in ("heads", 1):
            assert got[name, "ring", chunking] < 1e-5, f"rank {rank}, chunks of {chunking}"


def test_one_all_to_all_per_chunk_and_direction(results: list[dict[Any, Any]]) -> None:
    """Plain Ulysses: q, k and v in (one all-to-all) and the output back, and as many in the backward; chunked: 2
    per chunk. The SP group's observer (what ``SequenceParallelMonitor(time_all_to_all=True)`` times) sees each."""
    for got in results:
        assert got["probes", None]["calls"] == {"forward": 2, "backward": 2}
        for chunks in (1, 2, 4):
            assert got["probes", chunks]["calls"] == {"forward": 2 * chunks, "backward": 2 * chunks}
        for head_chunks in (None, 1, 2, 4):
            assert got["probes", head_chunks]["observed"] == got["probes", head_chunks]["calls"]


def test_each_chunk_attends_once_per_forward_run(results: list[dict[Any, Any]]) -> None:
    """Each chunk's backward runs its kernel's kept graph (lightning_ulysses.attention.kept_graph): the kernel's
    forward runs once per chunk in a step, twice under checkpoint_activations (the layer's recomputation; 3 x
    before), and once where the layer's activations are offloaded (its recomputation takes the output its forward
    kept), with the same output and gradients."""
    for got in results:
        for chunks in (1, 4):
            assert got["checkpointed", chunks]["calls"] == {False: chunks, "device": 2 * chunks, "offloaded": chunks}
            assert got["checkpointed", chunks]["error"] < 1e-6


def test_a_retained_graph_backpropagates_twice(results: list[dict[Any, Any]]) -> None:
    """A kept graph runs its backward once; a second backward through a retained graph recomputes the chunks."""
    for got in results:
        assert got["twice"] < 1e-6


def test_attention_dropout_recomputes_the_forwards_masks(results: list[dict[Any, Any]]) -> None:
    for got in results:
        assert got["dropout"] < 1e-4


def test_no_host_sync_inside_the_chunked_layer(results: list[dict[Any, Any]]) -> None:
    for got in results:
        for head_chunks in (None, 1, 2, 4):
            assert got["probes", head_chunks]["syncs"] == {}
        for head_chunks in (1, 4):
            assert got["kept probes", head_chunks]["syncs"] == {}


def test_a_kept_graph_gathers_its_output_instead_of_attending(results: list[dict[Any, Any]]) -> None:
    """With its kernel's graph kept, a chunk's backward gathers q, k and v as its forward did (one all-to-all), its
    output (one) and the output gradient (one), and sends the gradients back: 4 per chunk. Its largest
    whole-sequence tensor is the forward's fused q, k and v (``64 x (4 + 2 + 2) x 8``), below the recomputing
    backward's fused q, k, v and output gradient."""
    for got in results:
        for chunks in (1, 4):
            probes = got["kept probes", chunks]
            assert probes["calls"] == {"forward": 2 * chunks, "backward": 4 * chunks}
            assert probes["observed"] == probes["calls"]
        assert got["kept probes", 1]["largest"] == 64 * (4 + 2 + 2) * 8 < got["probes", 1]["largest"]


def test_whole_sequence_tensors_fall_by_the_chunk_factor(results: list[dict[Any, Any]]) -> None:
    """The largest whole-sequence tensor (any op's output, forward and backward) of 4 chunks of one head slot each
    is a quarter of one chunk of all 4 (8 heads, 4 K/V heads at sp=2: 4 query and 2 K/V slots per rank, D=8: one
    chunk's fused q, k, v and output gradient, ``64 x (4 + 2 + 2 + 4) x 8`` elements; no ``[N, N]`` buffer)."""
    for got in results:
        one = got["probes", 1]["largest"]
        assert one == 64 * (4 + 2 + 2 + 4) * 8
        assert got["probes", 2]["largest"] == one // 2
        assert got["probes", 4]["largest"] == 64 * (1 + 1 + 1 + 1) * 8  # a chunk of one slot: its K/V slot travels
        assert got["probes", 4]["largest"] < 64 * 64


def test_evaluation_keeps_no_kernel_graphs(monkeypatch: pytest.MonkeyPatch, one_rank: None) -> None:
    """Without autograd recording (validation, prediction) the chunks attend as plain calls: no graph is kept (it
    would record the kernel's saved tensors for a backward that never comes). One rank, 2 chunks."""
    from lightning_ulysses.attention import head_chunks

    kept: list[int] = []
    keep_graph = head_chunks.keep_graph
    monkeypatch.setattr(head_chunks, "keep_graph", lambda *a: kept.append(1) or keep_graph(*a))
    q, k, v = (torch.randn(1, 32, h, 16, requires_grad=True) for h in (4, 2, 2))
    layout = plan_heads(4, 2, 1)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: None) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(
            1, 2
        )

    with torch.no_grad():
        evaluated = head_chunks.chunked_ulysses(q, k, v, None, layout, dist.group.WORLD, attend, 2)
    assert kept == []
    trained = head_chunks.chunked_ulysses(q, k, v, None, layout, dist.group.WORLD, attend, 2)
    assert len(kept) == 2 and torch.equal(evaluated, trained.detach())


def test_chunk_plans() -> None:
    six_on_four = plan_heads(6, 1, 4)  # 2 query slots, 1 K/V slot per rank
    assert plan_chunks(six_on_four, 2) == (HeadChunk((0,), (0,)), HeadChunk((1,), (0,)))
    assert plan_chunks(six_on_four, 9) == plan_chunks(six_on_four, 2)  # at most one slot per chunk
    gqa = plan_heads(16, 4, 2)  # 8 query, 2 K/V slots per rank
    assert plan_chunks(gqa, 2) == (HeadChunk((0, 1, 2, 3), (0,)), HeadChunk((4, 5, 6, 7), (1,)))
    assert plan_chunks(gqa, 3) == (HeadChunk((0, 1), (0,)), HeadChunk((2, 3), (0,)), HeadChunk((4, 5, 6, 7), (1,)))
    for layout in (six_on_four, gqa, plan_heads(12, 6, 2)):
        for chunks in range(1, layout.heads_per_rank + 1):
            plan = plan_chunks(layout, chunks)
            assert len(plan) == chunks
            assert sorted(s for c in plan for s in c.query) == list(range(layout.heads_per_rank))
            group = layout.heads_per_rank // layout.kv_heads_per_rank
            for chunk in plan:  # ordinary GQA inside a chunk: its query slots read its K/V slots in order
                assert [s // group for s in chunk.query] == [
                    chunk.kv[i * len(chunk.kv) // len(chunk.query)] for i in range(len(chunk.query))
                ]


def test_auto_chunks_fit_the_query_shard() -> None:
    layout = plan_heads(8, 8, 2)  # 4 slots per rank; MHA: one chunk's q, k, v, out = 4 x its share of the query
    assert auto_chunks(layout, 16, 16) == 4
    mqa = plan_heads(8, 1, 2)
    assert auto_chunks(mqa, 16, 16) == 4  # 4 slots, the K/V slot travels with each: 1 q + 1 k + 1 v + 1 out
    assert auto_chunks(plan_heads(8, 8, 8), 16, 16) == 1  # one slot per rank: nothing to cut


@pytest.mark.parametrize(
    ("heads", "kv_heads", "sp", "qk_dim", "value_dim"),
    [
        (8, 8, 2, 16, 16),
        (8, 4, 2, 16, 16),
        (32, 8, 4, 128, 128),
        (8, 1, 2, 16, 16),
        (16, 2, 8, 192, 128),
        (6, 6, 6, 8, 8),
    ],
)
def test_auto_chunks_are_the_fewest_that_fit(heads: int, kv_heads: int, sp: int, qk_dim: int, value_dim: int) -> None:
    """The whole-sequence q, k, v and output of the largest chunk take at most the query shard's bytes, and no
    smaller count does so (counted per token and rank: P * slots of the chunk against H heads)."""
    layout = plan_heads(heads, kv_heads, sp)

    def largest(chunks: int) -> int:
        return sp * max(
            len(c.query) * (qk_dim + value_dim) + len(c.kv) * (qk_dim + value_dim) for c in plan_chunks(layout, chunks)
        )

    chunks = auto_chunks(layout, qk_dim, value_dim)
    fits = [n for n in range(1, layout.heads_per_rank + 1) if largest(n) <= heads * qk_dim]
    assert chunks == (fits[0] if fits else layout.heads_per_rank)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "all"])
def test_bad_head_chunks_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="head_chunks"):
        check_head_chunks(bad)
