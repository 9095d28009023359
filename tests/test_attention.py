"""``ulysses_attention`` against single-process attention, forward and backward, on gloo.

The reference is a dense ``[N, N]``-masked attention written here, independent of the backends and of
the head layout: every case must match it for the output and the gradients of ``q``, ``k`` and ``v``.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_ulysses.attention import (
    CORE_ATTENTION, Documents, document_tiles, documents_of, sdpa_attention, ulysses_attention,
)
from lightning_ulysses.heads import check_heads, plan_heads
from tests.launch import launch

PACKED = [
    [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2],  # borders inside shards and on shard borders (4, 8, 12)
    [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
]
# name -> batch, seq, heads, kv_heads, position_ids rows (None: one document per row), sliding window
CASES: dict[str, dict[str, Any]] = {
    "mha": dict(batch=2, seq=16, heads=4, kv_heads=4),
    "gqa_kv_divisible": dict(batch=2, seq=16, heads=8, kv_heads=4),
    "gqa_kv_replicated": dict(batch=1, seq=16, heads=4, kv_heads=1),
    "heads6_mha": dict(batch=2, seq=16, heads=6, kv_heads=6),
    "heads6_kv3": dict(batch=2, seq=16, heads=6, kv_heads=3),
    "heads6_kv2": dict(batch=2, seq=16, heads=6, kv_heads=2),
    "heads6_mqa": dict(batch=2, seq=16, heads=6, kv_heads=1),
    "heads5_packed": dict(batch=2, seq=16, heads=5, kv_heads=5, positions=PACKED),
    "packed_documents": dict(batch=2, seq=16, heads=4, kv_heads=2, positions=PACKED),
    "packed_sliding_window": dict(batch=2, seq=16, heads=6, kv_heads=3, positions=PACKED, window=3),
    "sliding_window": dict(batch=2, seq=16, heads=4, kv_heads=2, window=5),
}
SP_SIZES = (4, 2)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor | None, window: int | None = None
) -> torch.Tensor:
    """Dense masked attention with an explicit [N, N] mask per row: independent of our backends."""
    n = q.shape[1]
    index = torch.arange(n, device=q.device)
    distance = index[:, None] - index[None, :]
    mask = (distance >= 0) & (distance < (window or n))
    if position_ids is not None:
        doc = (position_ids == 0).long().cumsum(1)  # every row starts with position 0 in these cases
        mask = mask & (doc[:, :, None] == doc[:, None, :])
    mask = mask.expand(q.shape[0], n, n)
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def _tensors(case: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    batch, seq = case["batch"], case["seq"]
    q = torch.randn(batch, seq, case["heads"], 8, generator=g)
    k = torch.randn(batch, seq, case["kv_heads"], 8, generator=g)
    v = torch.randn(batch, seq, case["kv_heads"], 8, generator=g)
    grad = torch.randn(batch, seq, case["heads"], 8, generator=g)
    pos = torch.tensor(case["positions"]) if "positions" in case else None
    return q, k, v, grad, pos


def attention_worker(args: dict[str, Any]) -> dict[tuple[str, int], float]:
    """Every case over the whole world (sp=4) and over pairs of ranks (sp=2)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {world: dist.group.WORLD}
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank joins every new_group call
    groups[2] = pairs[rank // 2]
    errors = {}
    for (name, case), sp in itertools.product(CASES.items(), SP_SIZES):
        q, k, v, grad, pos = _tensors(case)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = reference(*full, pos, case.get("window"))
        expected.backward(grad)

        sp_rank = rank % sp
        local = slice(sp_rank * q.shape[1] // sp, (sp_rank + 1) * q.shape[1] // sp)
        shards = [t[:, local].clone().requires_grad_() for t in (q, k, v)]
        out = ulysses_attention(*shards, group=groups[sp], attn_fn="sdpa", window=case.get("window"),
                                position_ids=None if pos is None else pos[:, local])
        out.backward(grad[:, local])
        compared = [(out, expected[:, local])] + [(s.grad, f.grad[:, local]) for s, f in zip(shards, full)]
        errors[name, sp] = max(((a - b).norm() / b.norm()).item() for a, b in compared)
    dist.destroy_process_group()
    return errors


@pytest.fixture(scope="module")
def distributed_errors() -> list[dict[tuple[str, int], float]]:
    return launch("tests.test_attention:attention_worker", 4, {})


@pytest.mark.parametrize("sp", SP_SIZES)
@pytest.mark.parametrize("name", CASES)
def test_ulysses_attention_matches_single_process(
    distributed_errors: list[dict[tuple[str, int], float]], name: str, sp: int
) -> None:
    """Output and q/k/v gradients on every rank, relative error < 1e-5."""
    for rank, errors in enumerate(distributed_errors):
        assert errors[name, sp] < 1e-5, f"rank {rank}: relative error {errors[name, sp]:.2e}"


@pytest.mark.parametrize("tile_tokens", [1024, 5, 1])
@pytest.mark.parametrize("name", CASES)
def test_sdpa_backend_matches_dense_reference(name: str, tile_tokens: int) -> None:
    """Tiles of 1024 tokens hold whole rows; 5 mixes multi-document tiles and lone documents; 1: a call per document."""
    q, k, v, _, pos = _tensors(CASES[name])
    documents = None if pos is None else Documents.from_position_ids(pos)
    got = sdpa_attention(q, k, v, documents, window=CASES[name].get("window"), tile_tokens=tile_tokens)
    torch.testing.assert_close(got, reference(q, k, v, pos, CASES[name].get("window")), rtol=1e-5, atol=1e-6)


def test_document_tiles() -> None:
    cu_seqlens = [0, 3, 9, 13, 16, 20, 32]
    assert document_tiles(cu_seqlens, 1024) == [(0, 32, 6)]
    assert document_tiles(cu_seqlens, 9) == [(0, 9, 2), (9, 16, 2), (16, 20, 1), (20, 32, 1)]
    assert document_tiles(cu_seqlens, 1) == [(s, e, 1) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]


@pytest.mark.parametrize("name", ["packed_documents", "packed_sliding_window", "heads6_mqa", "sliding_window"])
def test_flex_backend_forward_on_cpu(name: str) -> None:
    """torch's flex attention has no CPU backward; its forward (eager) must match the dense reference."""
    q, k, v, _, pos = _tensors(CASES[name])
    documents = None if pos is None else Documents.from_position_ids(pos)
    with torch.no_grad():
        got = CORE_ATTENTION["flex_attention"](q, k, v, documents, window=CASES[name].get("window"))
    torch.testing.assert_close(got, reference(q, k, v, pos, CASES[name].get("window")), rtol=1e-5, atol=1e-5)


def _cuda_backend(name: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if name == "flash_attention_2":
        pytest.importorskip("flash_attn")


@pytest.mark.parametrize("backend", ["flash_attention_2", "flex_attention"])
@pytest.mark.parametrize("name", ["packed_documents", "packed_sliding_window", "heads6_mqa"])
def test_cuda_backends_match_dense_reference(backend: str, name: str) -> None:
    """Forward and q/k/v gradients of the GPU backends in bf16, against the fp32 dense reference."""
    _cuda_backend(backend)
    q, k, v, grad, pos = (None if t is None else t.cuda() for t in _tensors(CASES[name]))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference(*full, pos, CASES[name].get("window"))
    expected.backward(grad)
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    documents = None if pos is None else Documents.from_position_ids(pos)
    got = CORE_ATTENTION[backend](*low, documents, window=CASES[name].get("window"))
    got.backward(grad.bfloat16())
    for a, b in [(got, expected)] + [(lo.grad, f.grad) for lo, f in zip(low, full)]:
        error = ((a.float() - b).norm() / b.norm()).item()
        assert error < 2e-2, f"{backend} {name}: relative error {error:.2e}"


def test_only_unequal_kv_groups_are_refused() -> None:
    for heads, kv_heads in [(6, 6), (6, 3), (6, 1), (28, 4), (40, 8)]:
        check_heads(heads, kv_heads)
    with pytest.raises(ValueError, match=r"num_heads=6 is not a multiple of num_kv_heads=4"):
        check_heads(6, 4)


@pytest.mark.parametrize("sp_size", [1, 2, 3, 4, 6, 8, 16])
def test_head_layout_invariants(sp_size: int) -> None:
    """Every query head sits once next to its own K/V head; slots split evenly; the classic layout when it exists."""
    for kv_heads, group in itertools.product([1, 2, 3, 4, 5, 8], [1, 2, 3, 4, 5, 7]):
        heads = kv_heads * group
        layout = plan_heads(heads, kv_heads, sp_size)
        slot_group = layout.heads_per_rank // layout.kv_heads_per_rank
        assert layout.heads_per_rank == -(-heads // sp_size)
        assert len(layout.query_slots) == sp_size * layout.heads_per_rank
        assert len(layout.kv_slots) == sp_size * layout.kv_heads_per_rank
        for slot, head in enumerate(layout.query_slots):
            assert layout.kv_slots[slot // slot_group] == head // group, (heads, kv_heads, sp_size, slot)
        assert [layout.query_slots[s] for s in layout.output_slots] == list(range(heads))
        if heads % sp_size == 0 and (kv_heads % sp_size == 0 or sp_size % kv_heads == 0):
            assert layout.kv_heads_per_rank == max(kv_heads // sp_size, 1)
            assert layout.overhead == 1.0


def test_head_layout_examples() -> None:
    mqa = plan_heads(6, 1, 4)
    assert (mqa.heads_per_rank, mqa.kv_heads_per_rank, mqa.query_slots) == (2, 1, (0, 1, 2, 3, 4, 5, 5, 5))
    qwen_7b = plan_heads(28, 4, 8)  # 7 query heads per K/V head: each K/V head on two ranks, 4 + 3 (+1 inert)
    assert (qwen_7b.heads_per_rank, qwen_7b.kv_heads_per_rank, qwen_7b.kv_slots) == (4, 1, (0, 0, 1, 1, 2, 2, 3, 3))
    assert qwen_7b.overhead == pytest.approx(32 / 28)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_models_run_their_window(family: str) -> None:
    """Patched Mistral / Qwen2 (a sliding layer after a full one) equal transformers' own SDPA: logits and gradients."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from lightning_ulysses import apply_ulysses_attention

    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, sliding_window=5, attn_implementation="sdpa")
    if family == "mistral":
        make = lambda: MistralForCausalLM(MistralConfig(**common))  # noqa: E731
    else:
        make = lambda: Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, max_window_layers=1))  # noqa: E731
    torch.manual_seed(0)
    reference_model = make()
    torch.manual_seed(0)
    model = make()
    apply_ulysses_attention(model, None, 1, "sdpa")
    ids = torch.randint(1, 61, (2, 20), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(20).expand(2, 20)
    expected = reference_model(input_ids=ids).logits
    got = model(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected.square().mean().backward()
    got.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    reference_model.config.sliding_window = 1000  # the window changes the result: the comparison is not vacuous
    for layer in reference_model.model.layers:  # Qwen2 keeps the window per layer, Mistral reads its config
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = 1000
    assert (reference_model(input_ids=ids).logits - expected).abs().max() > 1e-3


def test_documents_are_found_once_per_position_ids_tensor() -> None:
    """Every layer of a forward gets the same position ids: their documents are computed once, and again
    only for another tensor or after an in-place edit."""
    positions = torch.arange(12).repeat(2, 1)
    first = documents_of(positions, None)
    assert documents_of(positions, None) is first and first.one_per_row
    assert documents_of(positions.clone(), None) is not first
    positions[0, 6] = 0  # packs a second document into row 0
    again = documents_of(positions, None)
    assert again is not first and not again.one_per_row
    assert again.cu_seqlens.tolist() == [0, 6, 12, 24]
