"""``ulysses_attention`` against single-process attention, forward and backward, on gloo."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_ulysses.attention import Documents, check_heads, sdpa_attention, ulysses_attention
from tests.launch import launch

# name -> (batch, seq, heads, kv_heads, position_ids rows or None)
CASES: dict[str, tuple[int, int, int, int, list[list[int]] | None]] = {
    "mha": (2, 16, 4, 4, None),
    "gqa_kv_divisible": (2, 16, 8, 4, None),
    "gqa_kv_replicated": (1, 16, 4, 1, None),
    "packed_documents": (2, 16, 4, 2, [
        [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2],  # borders inside shards and on a shard border
        [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    ]),
}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Dense masked attention with an explicit [N, N] mask per row: independent of our backends."""
    n = q.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if position_ids is None:
        mask = causal.expand(q.shape[0], n, n)
    else:
        doc = Documents.from_position_ids(position_ids).document_ids
        mask = causal & (doc[:, :, None] == doc[:, None, :])
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def _tensors(case: tuple[int, int, int, int, Any]) -> tuple[torch.Tensor, ...]:
    batch, seq, heads, kv_heads, positions = case
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq, heads, 8, generator=g)
    k = torch.randn(batch, seq, kv_heads, 8, generator=g)
    v = torch.randn(batch, seq, kv_heads, 8, generator=g)
    grad = torch.randn(batch, seq, heads, 8, generator=g)
    pos = None if positions is None else torch.tensor(positions)
    return q, k, v, grad, pos


def attention_worker(args: dict[str, Any]) -> dict[str, float]:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    errors = {}
    for name, case in CASES.items():
        q, k, v, grad, pos = _tensors(case)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = reference(*full, pos)
        expected.backward(grad)

        local = slice(rank * q.shape[1] // world, (rank + 1) * q.shape[1] // world)
        shards = [t[:, local].clone().requires_grad_() for t in (q, k, v)]
        out = ulysses_attention(*shards, group=dist.group.WORLD, attn_fn="sdpa",
                                position_ids=None if pos is None else pos[:, local])
        out.backward(grad[:, local])
        pairs = [(out, expected[:, local])] + [(s.grad, f.grad[:, local]) for s, f in zip(shards, full)]
        errors[name] = max(((a - b).norm() / b.norm()).item() for a, b in pairs)
    dist.destroy_process_group()
    return errors


@pytest.fixture(scope="module")
def distributed_errors() -> list[dict[str, float]]:
    return launch("tests.test_attention:attention_worker", 4, {})


@pytest.mark.parametrize("name", CASES)
def test_ulysses_attention_matches_single_process(distributed_errors: list[dict[str, float]], name: str) -> None:
    for rank, errors in enumerate(distributed_errors):
        assert errors[name] < 1e-5, f"rank {rank}: relative error {errors[name]:.2e}"


@pytest.mark.parametrize("name", CASES)
def test_sdpa_backend_matches_dense_reference(name: str) -> None:
    q, k, v, _, pos = _tensors(CASES[name])
    documents = None if pos is None else Documents.from_position_ids(pos)
    torch.testing.assert_close(sdpa_attention(q, k, v, documents), reference(q, k, v, pos), rtol=1e-5, atol=1e-6)


def test_head_counts_that_cannot_be_split_are_refused() -> None:
    check_heads(8, 2, 4)  # kv heads replicated
    check_heads(8, 8, 4)
    with pytest.raises(ValueError, match=r"6 attention heads .* sp_size=4 .* Valid sp_size values for this model: \[1, 2, 3, 6\]"):
        check_heads(6, 6, 4)
    with pytest.raises(ValueError, match=r"Valid sp_size values for this model: \[1, 2, 3, 6, 12\]"):
        check_heads(12, 6, 4)
