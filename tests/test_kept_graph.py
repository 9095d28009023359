"""Kept attention graphs (:mod:`lightning_ulysses.attention.kept_graph`): in one process, a kernel's backward run
from its kept graph equals autograd's, and a call that saves what cannot be rebuilt keeps none; at sp=2 (one
launch), what head chunks with the projections inside (:mod:`lightning_ulysses.hf.projections`) cost in kernel
forwards, with and without activation checkpointing, and that they keep plain Ulysses' gradients. The chunks of
attention alone are counted in ``test_head_chunks.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ulysses.attention.kept_graph import keep_graph
from lightning_ulysses.attention.sdpa import sdpa_attention
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf import apply_ulysses_attention
from lightning_ulysses.memory import MemoryOptions, apply_memory_options
from lightning_ulysses.sharding import prepare_batch, shard_batch
from lightning_ulysses.topology import SequenceParallelTopology
from tests.launch import launch
from tests.tiny import make_samples, projected_layers, tiny_llama


def _gathered(heads: int, kv_heads: int, tokens: int = 64, dim: int = 16) -> tuple[Tensor, Tensor, Tensor]:
    """Query, key and value ``[1, tokens, h, dim]`` as views into one buffer, as a chunk's all-to-all gathers them."""
    buffer = torch.randn(1, tokens, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(0))
    q, k, v = buffer.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.unflatten(-1, (heads, dim)), k.unflatten(-1, (kv_heads, dim)), v.unflatten(-1, (kv_heads, dim))


def _autograd(fn: Callable[..., Tensor], arguments: tuple[Tensor, ...], grad: Tensor) -> list[Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in arguments]
    return list(torch.autograd.grad(fn(*leaves), leaves, grad))


def _eager(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Attention with its ``[h, N, N]`` probabilities saved for the backward (the math backend's way)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(q.shape[2] // k.shape[2], dim=2))
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).triu(1)
    probabilities = (scores / math.sqrt(q.shape[-1])).masked_fill(causal, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probabilities, v.repeat_interleave(q.shape[2] // v.shape[2], dim=2))


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)])
def test_a_kept_graph_differentiates_as_autograd_without_its_forward(heads: int, kv_heads: int) -> None:
    """SDPA (CPU's flash kernel, GQA natively) keeps its graph: the backward from it, given copies of the arguments
    and result with other strides (rebuilt with the saved ones), equals autograd's, exactly, and runs no forward."""
    q, k, v = _gathered(heads, kv_heads)
    kept, got, expected = _kept_against_autograd(q, k, v)
    for g, e in zip(got, expected, strict=True):
        assert g is not None and torch.equal(g, e)
    with pytest.raises(AssertionError, match="once"):
        kept.grads([q, k, v], torch.empty(0), torch.empty(0))


def _kept_against_autograd(q: Tensor, k: Tensor, v: Tensor) -> tuple[Any, list[Tensor | None], list[Tensor]]:
    """SDPA on ``q, k, v`` through :func:`keep_graph` (one kernel forward, a graph kept), then the gradients of a
    random output gradient from the kept graph, given copies of the arguments and result (no forward), and
    autograd's."""
    calls: list[int] = []

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        calls.append(1)
        return sdpa_attention(q, k, v, None)

    out, kept = keep_graph(attend, (q, k, v))
    assert kept is not None and len(calls) == 1, "the call saved a tensor the kept graph cannot rebuild"
    grad = torch.randn_like(out)
    expected = _autograd(attend, (q, k, v), grad)
    calls.clear()
    got = kept.grads([t.clone() for t in (q, k, v)], out.clone(), grad)
    assert not calls
    return kept, got, expected


def test_a_kept_graph_holds_no_argument_or_result() -> None:
    """What a kept graph holds is its small saved tensors: the log-sum-exp ``[1, h, N]`` fp32, 1 / D of the output
    (the arguments' and result's storages are freed once the caller drops them)."""
    q, k, v = _gathered(4, 2)
    out, kept = keep_graph(lambda q, k, v: sdpa_attention(q, k, v, None), (q, k, v))
    assert kept is not None
    held = [s.tensor for s in kept.saved if s.tensor is not None]
    assert [tuple(t.shape) for t in held] == [(1, 4, 64)]
    storages = {t.untyped_storage().data_ptr() for t in (q, out)}
    assert not any(t.untyped_storage().data_ptr() in storages for t in held)


@pytest.mark.parametrize(
    "attend",
    [
        pytest.param(_eager, id="eager-probabilities"),
        pytest.param(lambda q, k, v: sdpa_attention(q, k, v, None, dropout_p=0.5), id="sdpa-dropout"),
        pytest.param(lambda q, k, v: sdpa_attention(q, k, v, None, window=8), id="sdpa-window-blocks"),
        pytest.param(lambda q, k, v: sdpa_attention(q.contiguous(), k, v, None), id="copied-query"),
    ],
)
def test_a_call_saving_what_it_cannot_rebuild_keeps_no_graph(attend: Callable[..., Tensor]) -> None:
    """The eager attention's ``[h, N, N]`` probabilities, SDPA's math kernel under dropout (its mask), query blocks of
    a sliding window (slices of the query, not permutations) and a copy of the query: no kept graph (the caller
    recomputes), and the result is the call's."""
    q, k, v = _gathered(4, 2)
    torch.manual_seed(1)
    out, kept = keep_graph(attend, (q, k, v))
    torch.manual_seed(1)
    assert kept is None and torch.equal(out, attend(q, k, v))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
def test_cuda_kernels_keep_their_graph_in_bf16(backend: str) -> None:
    """SDPA's CUDA kernels in bf16, each forced: the call keeps its graph (its saved query, key, value and output are
    permuted views, the rest small), and the backward from it, given re-gathered copies, equals autograd's within the
    kernels' own run-to-run spread (their backward may sum in a nondeterministic order), without a forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.to("cuda", torch.bfloat16) for t in _gathered(4, 4, tokens=256, dim=64))
    with sdpa_kernel(getattr(SDPBackend, backend)):
        _, got, expected = _kept_against_autograd(q, k, v)
    for g, e in zip(got, expected, strict=True):
        assert g is not None and ((g.float() - e.float()).norm() / e.float().norm()).item() < 1e-2


def projected_layer_kernels(args: dict[str, Any]) -> dict[str, Any]:
    """A tiny Llama at sp=2 with ``head_chunks=2`` (projections inside the chunks), one forward + backward per
    setting: SDPA kernel calls and the gradients, with and without activation checkpointing; plain Ulysses'
    gradients for reference."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = SequenceParallelGroups.create(SequenceParallelTopology(2, 2, rank), "cpu")
    samples = make_samples(1, 32)
    batch = prepare_batch({"input_ids": torch.stack([s["input_ids"] for s in samples])}, 2)
    batch = shard_batch(batch, rank, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls: list[int] = []

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return sdpa(*a, **kw)

    results: dict[str, Any] = {}
    for name, head_chunks, checkpointing in (("plain", None, False), ("chunks", 2, False), ("checkpointed", 2, True)):
        model = tiny_llama(hidden_size=48, num_attention_heads=8, num_key_value_heads=4, head_dim=16).train()
        apply_ulysses_attention(model, world, "sdpa", head_chunks=head_chunks)
        if checkpointing:
            apply_memory_options(model, MemoryOptions(activation_checkpointing=True))
        calls.clear()
        torch.nn.functional.scaled_dot_product_attention = counted
        try:
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            logits.pow(2).mean().backward()
        finally:
            torch.nn.functional.scaled_dot_product_attention = sdpa
        results[name] = {
            "calls": len(calls),
            "projected": projected_layers(model),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        }
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def projected_results() -> list[dict[str, Any]]:
    return launch("tests.test_kept_graph:projected_layer_kernels", 2, {})


@pytest.mark.distributed
def test_projection_chunks_attend_twice_per_step_three_times_checkpointed(
    projected_results: list[dict[str, Any]],
) -> None:
    """2 layers x 2 chunks, projections inside: each chunk's kernel runs in its forward and in its region's
    recomputation for the backward (2 x 4 calls); under checkpoint_activations on the device the layer's
    recomputation runs it once more (3 x 4): keeping the chunk outputs for the regions' recomputation would add a
    hidden-state tensor to the peak (docs/benchmarks/chunk_cost.md). The gradients equal plain Ulysses'."""
    for got in projected_results:
        assert got["chunks"]["projected"] == got["checkpointed"]["projected"] != []
        assert (got["chunks"]["calls"], got["checkpointed"]["calls"]) == (2 * 4, 3 * 4)
        for name, expected in got["plain"]["grads"].items():
            for setting in ("chunks", "checkpointed"):
                torch.testing.assert_close(got[setting]["grads"][name], expected, rtol=1e-5, atol=1e-6, msg=name)
