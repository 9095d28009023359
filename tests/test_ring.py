"""Ulysses x Ring attention against single-process attention (forward and every gradient), on gloo.

Layouts ``ring x ulysses`` = 2 x 1, 2 x 2 and 4 x 1 on 4 processes (the 2-rank SP groups twice, dp=2); the reference
is the dense ``[N, N]``-masked attention of tests/test_attention.py. Packed documents put borders on chunk borders,
on shard borders inside a ring rank and inside chunks; windows shorter than a chunk and spanning several.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_ulysses import sequence_parallel
from lightning_ulysses.attention import gather_sequence, ring, ring_blocks, ulysses_attention
from lightning_ulysses.attention.documents import Documents
from lightning_ulysses.attention.ring import classify_pair, plan_ring
from lightning_ulysses.attention.ring_blocks import check_block_kernels
from lightning_ulysses.attention.ulysses import check_ring_supported
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.sharding import shard_index, shard_multiple, zigzag_order
from lightning_ulysses.topology import SequenceParallelTopology
from tests.launch import launch
from tests.test_attention import reference, sink_logits

pytestmark = pytest.mark.distributed

SEQ = 32
# rows of 32 position ids: borders at 8 and 16 (chunk borders at ring 2), at 4 and 12 (inside chunks at ring 2,
# chunk borders at ring 4), a document across three chunks, and one-token documents
PACKED = [
    [*range(8), *range(8), *range(3), *range(13)],
    [*range(4), *range(8), *range(17), 0, 0, *range(1)],
]
ONE_DOCUMENT = [list(range(SEQ))] * 2
CASES: dict[str, dict[str, Any]] = {
    "mha": dict(heads=4, kv_heads=4),
    "gqa": dict(heads=8, kv_heads=2),
    "mqa": dict(heads=4, kv_heads=1),
    "heads6_kv3": dict(heads=6, kv_heads=3),
    "positions_one_document": dict(heads=4, kv_heads=2, positions=ONE_DOCUMENT),
    "packed": dict(heads=4, kv_heads=2, positions=PACKED),
    "window_shorter_than_a_chunk": dict(heads=4, kv_heads=2, window=3),
    "window_across_chunks": dict(heads=4, kv_heads=2, window=13),
    "packed_window": dict(heads=6, kv_heads=2, positions=PACKED, window=5),
    "chunked_packed": dict(heads=4, kv_heads=2, positions=PACKED, chunk=6),
    # attention sinks (gpt-oss): 6 heads over 2 Ulysses ranks with 3 K/V heads; packed with a window
    "sinks_heads6_kv3": dict(heads=6, kv_heads=3, sinks=True),
    "sinks_packed_window": dict(heads=4, kv_heads=2, positions=PACKED, window=5, sinks=True),
    # multi-head latent attention: value heads of another size than the query's (DeepSeek V3: 128 and 192)
    "mla_packed_window": dict(heads=6, kv_heads=2, positions=PACKED, window=5, head_dim=24, value_dim=16),
    "mla_heads3_packed": dict(heads=3, kv_heads=3, positions=PACKED, head_dim=24, value_dim=16),
    "mla_larger_values_sinks": dict(heads=4, kv_heads=2, sinks=True, head_dim=8, value_dim=16),
}
LAYOUTS = [(2, 1), (2, 2), (4, 1)]  # (ring_size, ulysses_size)


def _tensors(case: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """``q``, ``k``, ``v``, the output gradient (head sizes 8, or the case's ``head_dim`` and ``value_dim``) and the
    position ids of ``case``."""
    g = torch.Generator().manual_seed(0)
    head_dim = case.get("head_dim", 8)
    value_dim = case.get("value_dim", head_dim)
    q = torch.randn(2, SEQ, case["heads"], head_dim, generator=g)
    k = torch.randn(2, SEQ, case["kv_heads"], head_dim, generator=g)
    v = torch.randn(2, SEQ, case["kv_heads"], value_dim, generator=g)
    grad = torch.randn(2, SEQ, case["heads"], value_dim, generator=g)
    return q, k, v, grad, torch.tensor(case["positions"]) if "positions" in case else None


def _groups(ring_size: int, ulysses_size: int) -> SequenceParallelGroups:
    """This rank's groups of the layout, as UlyssesStrategy builds them."""
    topology = SequenceParallelTopology(dist.get_world_size(), ring_size * ulysses_size, dist.get_rank(), ring_size)
    return SequenceParallelGroups.create(topology, "cpu")


def ring_worker(args: dict[str, Any]) -> dict[Any, Any]:
    dist.init_process_group("gloo")
    ring.MASK_TILE = 3  # masked chunk pairs (chunks of 8 and 4 tokens) run as several query tiles
    results: dict[Any, Any] = {}
    for ring_size, ulysses_size in LAYOUTS:
        sp = ring_size * ulysses_size
        groups = _groups(ring_size, ulysses_size)
        if (ring_size, ulysses_size) == (2, 2):
            groups_of_layout = groups
        index = shard_index(SEQ, dist.get_rank(groups.sp), sp, ring_size)
        columns = torch.arange(SEQ).expand(2, SEQ)
        results["gather", ring_size, ulysses_size] = torch.equal(gather_sequence(columns[:, index], groups), columns)
        for name, case in CASES.items():
            q, k, v, grad, pos = _tensors(case)
            sinks = sink_logits(case)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            full_sinks = None if sinks is None else sinks.clone().requires_grad_()
            expected = reference(*full, pos, window=case.get("window"), chunk=case.get("chunk"), sinks=full_sinks)
            expected.backward(grad)
            shards = [t[:, index].clone().requires_grad_() for t in (q, k, v)]
            rank_sinks = None if sinks is None else sinks.clone().requires_grad_()
            out = ulysses_attention(
                *shards,
                group=groups,
                attn_implementation="sdpa",
                window=case.get("window"),
                chunk=case.get("chunk"),
                position_ids=None if pos is None else pos[:, index],
                sinks=rank_sinks,
            )
            out.backward(grad[:, index])
            compared = [(out, expected[:, index])] + [(s.grad, f.grad[:, index]) for s, f in zip(shards, full)]
            if sinks is not None:  # each rank's share of the sinks' gradient, summed over the SP group
                dist.all_reduce(rank_sinks.grad, group=groups.sp)
                compared.append((rank_sinks.grad, full_sinks.grad))
            results[name, ring_size, ulysses_size] = max(((a - b).norm() / b.norm()).item() for a, b in compared)
    results["window_models"] = _window_models(groups_of_layout)
    results["dropout_refusal"] = _dropout_refusal(groups_of_layout)
    dist.destroy_process_group()
    return results


def _dropout_refusal(groups: SequenceParallelGroups) -> str:
    """A Llama with attention dropout, patched under ring 2 x Ulysses 2: the set-up check's refusal."""
    from lightning_ulysses.hf import UnsupportedModelError, apply_ulysses_attention
    from tests.tiny import tiny_llama

    try:
        apply_ulysses_attention(tiny_llama(attention_dropout=0.1), groups, "sdpa")
    except UnsupportedModelError as error:
        return str(error)
    return "not refused"


def _window_models(groups: SequenceParallelGroups) -> dict[str, float]:
    """Patched Mistral and Qwen2 (a sliding layer after a full one), window 3 under ring 2 x Ulysses 2 (chunks of 6
    tokens), against transformers' own SDPA on the whole sequence, and gpt-oss (attention sinks, a sliding layer and
    a full one, MoE) against its eager attention: the logits, and the gradients summed over the SP group (each rank's
    loss is its tokens' share)."""
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from lightning_ulysses.hf import apply_ulysses_attention

    common = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=3,
        attn_implementation="sdpa",
    )
    makers = {
        "mistral": lambda: MistralForCausalLM(MistralConfig(**common)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, max_window_layers=1)),
        "gpt_oss": lambda: GptOssForCausalLM(
            GptOssConfig(
                **{**common, "attn_implementation": "eager"},
                head_dim=8,
                num_local_experts=4,
                num_experts_per_tok=2,
                layer_types=["sliding_attention", "full_attention"],
            )
        ),
    }
    seq, sp = 24, dist.get_world_size(groups.sp)
    index = shard_index(seq, dist.get_rank(groups.sp), sp, ring_size=2)
    ids = torch.randint(1, 61, (2, seq), generator=torch.Generator().manual_seed(0))
    errors = {}
    for family, make in makers.items():
        torch.manual_seed(0)
        reference_model = make()
        torch.manual_seed(0)
        model = make()
        apply_ulysses_attention(model, groups, "sdpa")
        expected = reference_model(input_ids=ids).logits
        got = model(input_ids=ids[:, index], position_ids=torch.arange(seq)[index].expand(2, -1)).logits
        expected.square().sum().backward()
        got.square().sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(grads, group=groups.sp)
        expected_grads = torch.cat([p.grad.flatten() for p in reference_model.parameters()])
        logits = gather_sequence(got.detach(), groups)
        errors[family] = max(
            ((logits - expected).norm() / expected.norm()).item(),
            ((grads - expected_grads).norm() / expected_grads.norm()).item(),
        )
    return errors


@pytest.fixture(scope="module")
def ring_results() -> list[dict[Any, Any]]:
    return launch("tests.test_ring:ring_worker", 4, {})


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"ring{r}_ulysses{u}" for r, u in LAYOUTS])
@pytest.mark.parametrize("name", CASES)
def test_ring_attention_matches_single_process(ring_results: list[dict[Any, Any]], name: str, layout: tuple) -> None:
    """Output and q/k/v gradients on every rank, relative error < 1e-5."""
    for rank, results in enumerate(ring_results):
        error = results[(name, *layout)]
        assert error < 1e-5, f"rank {rank}: relative error {error:.2e}"


def test_sliding_window_models_under_the_ring(ring_results: list[dict[Any, Any]]) -> None:
    """Mistral and Qwen2 with a window (3) shorter than a ring chunk (6), ring 2 x Ulysses 2: logits and summed
    gradients equal transformers' own SDPA on the whole sequence (relative error < 1e-5); gpt-oss (attention sinks
    in both layers, a window of 3 in one) equals its eager attention."""
    for rank, results in enumerate(ring_results):
        assert set(results["window_models"]) == {"mistral", "qwen2", "gpt_oss"}
        for family, error in results["window_models"].items():
            assert error < 1e-5, f"rank {rank}, {family}: relative error {error:.2e}"


def test_attention_dropout_is_refused_at_set_up_under_the_ring(ring_results: list[dict[Any, Any]]) -> None:
    for results in ring_results:
        message = results["dropout_refusal"]
        assert "model.layers.0.self_attn" in message and "uses attention dropout, which Ulysses x Ring" in message, (
            message
        )


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"ring{r}_ulysses{u}" for r, u in LAYOUTS])
def test_gather_sequence_undoes_the_zigzag(ring_results: list[dict[Any, Any]], layout: tuple) -> None:
    assert all(results[("gather", *layout)] for results in ring_results)


class _Done:
    def wait(self) -> None:
        pass


def _loopback(tensors: list[torch.Tensor], group: Any) -> tuple[list[torch.Tensor], list[_Done]]:
    """A ring exchange in one process: every block "arrives" as a fresh copy (the memory a receive allocates)."""
    return [t.clone() for t in tensors], [_Done()]


def test_ring_step_memory_does_not_grow_with_the_ring_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peak memory of ring attention's forward and backward (tensor allocations, MemTracker) with the same 2048 tokens
    per ring rank at ring sizes 3 to 16: equal, so no step keeps the K/V blocks (or dK/dV accumulators) of earlier
    steps alive. Ring 2 needs less: its only later step is the last, which receives nothing. The exchange runs in
    one process (:func:`_loopback`); the multi-process tests check the values."""
    from torch.distributed._tools.mem_tracker import MemTracker

    monkeypatch.setattr(ring, "ring_exchange", _loopback)
    peaks = {}
    for ring_size in (2, 3, 4, 8, 16):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2048, 4, 32, generator=g, requires_grad=True) for _ in range(3))
        tracker = MemTracker()
        with tracker:
            ring.ring_attention(q, k, v, None, None, ring_size, 0).sum().backward()
        peaks[ring_size] = sum(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values())
    block = 2 * 2048 * 4 * 32 * 4  # one K/V block, fp32
    assert peaks[3] == peaks[4] == peaks[8] == peaks[16], peaks
    assert peaks[2] < peaks[3] <= peaks[2] + block, peaks


def test_shard_multiple() -> None:
    """Two equal chunks per ring rank, their concatenation split evenly over its Ulysses group; no more padding."""
    assert [shard_multiple(sp, ring) for sp, ring in [(4, 1), (2, 2), (4, 2), (6, 2), (8, 4), (16, 2)]] == [
        4,
        4,
        4,
        12,
        8,
        16,
    ]


def test_zigzag_order() -> None:
    """Ring rank r holds chunks r and 2R-1-r; its Ulysses ranks split them, concatenated, in order."""
    assert zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert zigzag_order(8, 1).tolist() == list(range(8))
    assert shard_index(16, 1, 4, ring_size=2).tolist() == [12, 13, 14, 15]
    assert shard_index(16, 2, 4, ring_size=2).tolist() == [4, 5, 6, 7]
    assert sorted(torch.cat([shard_index(24, r, 6, 3) for r in range(6)]).tolist()) == list(range(24))


def test_zigzag_balances_causal_work() -> None:
    """One document per row: every ring rank runs the same number of chunk pairs at every step, and skips the rest."""
    for ring_size in (2, 4, 8):
        plans = [plan_ring(None, 1, 16 * ring_size, ring_size, r, None) for r in range(ring_size)]
        for step in range(ring_size):
            work = {sum(2 if p.kind == "full" else 1 for p in plan.steps[step]) for plan in plans}
            assert work == {4}, (ring_size, step, work)  # a causal diagonal pair is half a full one


def test_blocks_with_no_allowed_pair_are_skipped() -> None:
    """Documents and windows decide on the host which chunk pairs run, and how."""

    def same(answer: str):
        return lambda x, y: answer

    assert classify_pair(1, 2, 8, None, same("all")) is None  # keys after the queries
    assert classify_pair(3, 0, 8, 10, same("all")) is None  # out of the window
    assert classify_pair(3, 2, 8, 10, same("all")) == "masked"  # the window edge crosses the pair
    assert classify_pair(3, 2, 8, 9, same("all")) == "masked"
    assert classify_pair(3, 2, 8, 16, same("all")) == "full"
    assert classify_pair(2, 1, 8, None, same("none")) is None  # a document border between them in every row
    assert classify_pair(2, 1, 8, None, same("some")) == "masked"
    assert classify_pair(1, 1, 8, 8, same("all")) == "causal"
    assert classify_pair(1, 1, 8, 7, same("all")) == "masked"
    # PACKED row 0 alone, ring 2 (chunks of 8): documents [0, 8), [8, 16), [16, 19), [19, 32)
    documents = Documents.from_position_ids(torch.tensor(PACKED[:1]))
    plan = plan_ring(documents, 1, SEQ, 2, 0, None)  # chunks 0 and 3
    kinds = [{(p.query_chunk, p.key_chunk): p.kind for p in step} for step in plan.steps]
    assert kinds[0] == {(0, 0): "causal", (3, 3): "causal"}  # (3, 0): documents in between, skipped
    assert kinds[1] == {(3, 2): "masked"}  # (3, 1) skipped; (0, *) keys after the queries


def test_masked_pairs_never_build_a_chunk_by_chunk_mask() -> None:
    """Packed rows of 4096 tokens at ring 2 (chunks of 1024), documents of every length: a masked chunk pair runs as
    query tiles, and no tile's mask exceeds [tile, chunk]; with a window of 16, [tile, tile + 16]. Without a window
    the parts that no document border crosses run without a mask."""
    seq, ring_size, tile = 4096, 2, 64
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(2):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(1, 700, (1,), generator=generator)))
        lengths[-1] -= sum(lengths) - seq
        rows.append([p for n in lengths for p in range(n)])
    documents = Documents.from_position_ids(torch.tensor(rows))
    for window, largest in ((None, tile * seq // (2 * ring_size)), (16, tile * (tile + 16))):
        tiles = [
            t
            for rank in range(ring_size)
            for step in plan_ring(documents, 2, seq, ring_size, rank, window, tile).steps
            for pair in step
            if pair.kind == "masked"
            for t in pair.tiles
        ]
        masked = [t for t in tiles if t.kind == "masked"]
        assert masked and max((t.q_hi - t.q_lo) * (t.k_hi - t.k_lo) for t in masked) <= largest, window
        if window is None:  # only the parts a document border crosses need a mask
            assert len(masked) < len(tiles), (len(masked), len(tiles))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["gqa", "packed_window", "mla_packed_window", "mla_larger_values_sinks"])
def test_a_ring_of_one_matches_dense_attention(name: str, dtype: torch.dtype, device: str) -> None:
    """One process, ring size 1 (its two chunks, three pairs: causal, causal, full or masked), fp32 and bf16: the
    block kernels of the device (CPU: the flash kernel for CPU; CUDA: the memory-efficient kernel), the merge and the
    backward against the dense reference; value heads of another size than the query's (MLA) and sinks included."""
    case = CASES[name]
    q, k, v, grad, pos = _tensors(case)
    sinks = [] if sink_logits(case) is None else [sink_logits(case)]
    full = [t.clone().requires_grad_() for t in (q, k, v, *sinks)]
    expected = reference(*full[:3], pos, window=case.get("window"), sinks=full[3] if sinks else None)
    expected.backward(grad)
    low = [t.to(device, dtype).requires_grad_() for t in (q, k, v, *sinks)]
    documents = None if pos is None else Documents.from_position_ids(pos.to(device))
    out = ring.ring_attention(
        *low[:3], documents, None, 1, 0, window=case.get("window"), sinks=low[3] if sinks else None
    )
    out.backward(grad.to(device, dtype))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in [(out, expected)] + [(t.grad, f.grad) for t, f in zip(low, full)]:
        assert got.dtype == dtype
        assert ((got.float().cpu() - want).norm() / want.norm()).item() < tolerance


@pytest.mark.parametrize("device", DEVICES)
def test_the_block_kernels_of_the_device_pass_their_set_up_check(device: str) -> None:
    """:func:`check_block_kernels` (run by the strategy at set-up under the ring) finds the device's kernels exact
    in every dtype training uses."""
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device == "cuda" else [])
    for dtype in dtypes:
        assert check_block_kernels(torch.device(device), dtype) == [], dtype


def test_cuda_block_kernel_calls_are_well_formed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's calls of torch's memory-efficient kernels on meta tensors (no GPU): the arguments fit the
    kernels' schemas (a masked block's bias included) and our side of the plumbing returns the block layouts (the
    log-sum-exp cut from the kernel's 32-padded one, the GQA gradients summed back per K/V head), for every kind, 40
    queries against 24 keys (causal: 40 against 40). The backward gets the output and its gradient in the forward's
    memory layout (contiguous ``[b, n, h, D]``), which its fp16/bf16 kernel assumes whatever the strides (on an H200,
    bf16 gradients were wrong without it). The meta kernels check neither the head counts nor the log-sum-exp layout
    they are given: only the set-up check on a GPU (above) does."""
    backward = torch.ops.aten._scaled_dot_product_efficient_attention_backward
    layouts = []

    def spy(
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: Any,
        out: Any,
        *a: Any,
        **kw: Any,
    ) -> Any:
        layouts.append([t.transpose(1, 2).is_contiguous() for t in (grad_out, out)])
        return backward(grad_out, q, k, v, bias, out, *a, **kw)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", spy)
    meta = torch.device("meta")
    for kind, keys in (("full", 24), ("causal", 40), ("masked", 24)):
        q, grad = torch.empty(2, 6, 40, 64, device=meta), torch.empty(2, 6, 40, 64, device=meta)
        k, v = torch.empty(2, 3, keys, 64, device=meta), torch.empty(2, 3, keys, 64, device=meta)
        mask = torch.ones(1, 40, keys, dtype=torch.bool, device=meta) if kind == "masked" else None
        out, lse = ring_blocks._cuda_forward(q, k, v, kind, mask, 0.125)
        assert out.shape == (2, 6, 40, 64) and lse.shape == (2, 6, 40), kind
        dq, dk, dv = ring_blocks._cuda_backward(grad, q, k, v, out, lse, kind, mask, 0.125)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape, kind
    assert layouts == [[True, True]] * 3


@pytest.mark.parametrize("value_dim", [48, 80])
def test_cuda_block_kernels_run_value_heads_of_another_size(monkeypatch: pytest.MonkeyPatch, value_dim: int) -> None:
    """:func:`block_forward` and :func:`block_backward` on meta tensors through the CUDA path: queries and keys of 64,
    values of 48 or 80 (MLA) reach the memory-efficient kernels padded to one head size, and come back as the block
    layouts (output and dV of the value's size, dQ and dK of the query's) for every kind, GQA included."""
    head_sizes = []

    def one_head_size(kernel: Any) -> Any:
        def call(*args: Any) -> Any:
            head_sizes.append({t.shape[-1] for t in args if isinstance(t, torch.Tensor) and t.dim() == 4})
            return kernel(*args)

        return call

    forward, backward = (one_head_size(kernel) for kernel in ring_blocks._KERNELS["cuda"])
    monkeypatch.setitem(ring_blocks._KERNELS, "meta", (forward, backward))
    meta = torch.device("meta")
    for kind, keys in (("full", 24), ("causal", 40), ("masked", 24)):
        q, grad = torch.empty(2, 40, 6, 64, device=meta), torch.empty(2, 40, 6, value_dim, device=meta)
        k, v = torch.empty(2, keys, 3, 64, device=meta), torch.empty(2, keys, 3, value_dim, device=meta)
        mask = torch.ones(1, 40, keys, dtype=torch.bool, device=meta) if kind == "masked" else None
        out, lse = ring_blocks.block_forward(q, k, v, kind, mask, 0.125)
        assert out.shape == (2, 40, 6, value_dim) and lse.shape == (2, 40, 6), kind
        dq, dk, dv = ring_blocks.block_backward(grad, q, k, v, out, lse, kind, mask, 0.125)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape, kind
    assert head_sizes == [{max(64, value_dim)}] * 6


def test_inexact_block_kernels_are_refused_at_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel off anywhere (a doubled dK, a causal block run full, a wrong scale) fails the set-up check, and the
    strategy refuses the ring on that device, naming what differs and ring_size=1."""
    forward, backward = ring_blocks.block_forward, ring_blocks.block_backward

    def doubled_key_gradient(*args: Any) -> tuple:
        dq, dk, dv = backward(*args)
        return dq, 2 * dk, dv

    monkeypatch.setattr(ring_blocks, "block_backward", doubled_key_gradient)
    assert check_block_kernels(torch.device("cpu"), torch.float32) == [
        "torch.float32 dK: relative error 1.0e+00 > 1e-04"
    ]
    with pytest.raises(
        ValueError,
        match=r"ring_size=2\): the ring's block kernels on cpu do not compute attention "
        r"exactly here \(.*torch.float32 dK: relative error .*Use ring_size=1",
    ):
        sequence_parallel._check_ring_kernels(torch.device("cpu"), torch.bfloat16, 2)
    monkeypatch.setattr(ring_blocks, "block_backward", backward)
    for wrong in (dict(kind="full"), dict(scale=0.25)):

        def wrong_forward(q, k, v, kind, mask, scale, wrong=wrong):
            return forward(q, k, v, wrong.get("kind", kind), mask, wrong.get("scale", scale))

        monkeypatch.setattr(ring_blocks, "block_forward", wrong_forward)
        failures = check_block_kernels(torch.device("cpu"), torch.bfloat16)
        assert any("output" in f for f in failures) and any("dQ" in f for f in failures), (wrong, failures)


def test_what_the_ring_does_not_run_is_refused() -> None:
    """Other core backends and dropout: refused, naming each and what to do."""
    check_ring_supported("sdpa", 0.0)
    with pytest.raises(
        ValueError,
        match=r"does not support the attention backend 'flex_attention'"
        r" .* or attention dropout \(dropout_p=0.1\). Use ring_size=1",
    ):
        check_ring_supported("flex_attention", 0.1)
