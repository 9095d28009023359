"""``ulysses_attention`` against single-process attention, forward and backward, on gloo.

The reference is a dense ``[N, N]``-masked attention written here, independent of the backends and of
the head layout: every case must match it for the output and the gradients of ``q``, ``k`` and ``v``
(and of the attention sinks, where a case has them).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import sys
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ulysses.attention import (
    CORE_ATTENTION,
    Documents,
    documents_of,
    length_class,
    plan_packed,
    resolve_attn_implementation,
    ring_attention,
    sdpa_attention,
    sink_attention,
    ulysses_attention,
)
from lightning_ulysses.attention.backends import _REQUIRED_MODULE
from lightning_ulysses.attention.core import pad_head_dims
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.heads import check_heads, plan_heads
from lightning_ulysses.sequence_parallel import compute_dtype
from lightning_ulysses.topology import SequenceParallelTopology
from tests.launch import launch

pytestmark = pytest.mark.distributed

PACKED = [
    [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2],  # borders inside shards and on shard borders (4, 8, 12)
    [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
]
ARANGE = [list(range(16))] * 2
# name -> batch, seq, heads, kv_heads, position_ids rows (None: one document per row), sliding window, chunk size
# (chunked attention), sinks (one attention sink logit per head), the head size of queries and keys and that of the
# values (8 and 8 unless given; multi-head latent attention's differ, DeepSeek V3's 192 and 128)
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
    # chunk 5: chunk borders inside shards; chunk 4 on PACKED row 1: at columns 8 and 12, on shard borders
    "chunked": dict(batch=2, seq=16, heads=4, kv_heads=2, positions=ARANGE, chunk=5),
    "chunked_packed": dict(batch=2, seq=16, heads=6, kv_heads=3, positions=PACKED, chunk=4),
    "sinks_mha": dict(batch=2, seq=16, heads=4, kv_heads=4, sinks=True),
    "sinks_heads6_mqa": dict(batch=2, seq=16, heads=6, kv_heads=1, sinks=True),
    "sinks_sliding_window": dict(batch=2, seq=16, heads=4, kv_heads=2, window=5, sinks=True),
    "sinks_heads6_kv2_packed_window": dict(
        batch=2, seq=16, heads=6, kv_heads=2, positions=PACKED, window=3, sinks=True
    ),
    "sinks_heads5_chunked_packed": dict(batch=2, seq=16, heads=5, kv_heads=5, positions=PACKED, chunk=3, sinks=True),
    "mla_packed": dict(batch=2, seq=16, heads=4, kv_heads=4, positions=PACKED, head_dim=24, value_dim=16),
    "mla_heads5_packed_window": dict(
        batch=2, seq=16, heads=5, kv_heads=5, positions=PACKED, window=3, head_dim=24, value_dim=16
    ),
    "mla_larger_values_gqa_window": dict(batch=2, seq=16, heads=6, kv_heads=2, window=5, head_dim=8, value_dim=16),
    "mla_sinks_heads6_kv3_chunked_packed": dict(
        batch=2, seq=16, heads=6, kv_heads=3, positions=PACKED, chunk=4, sinks=True, head_dim=24, value_dim=16
    ),
    "mla_larger_values_sinks_window": dict(
        batch=2, seq=16, heads=4, kv_heads=2, window=5, sinks=True, head_dim=8, value_dim=16
    ),
}
MLA_CASES = [name for name, case in CASES.items() if name.startswith("mla") and not case.get("sinks")]  # + SINK_CASES
SINK_CASES = [name for name, case in CASES.items() if case.get("sinks")]
SP_SIZES = (4, 2)


def reference_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor | None,
    window: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """``[B, H, N, N]`` scaled scores, -inf where an explicit dense mask forbids: independent of our backends."""
    n = q.shape[1]
    index = torch.arange(n, device=q.device)
    distance = index[:, None] - index[None, :]
    mask = (distance >= 0) & (distance < (window or n))
    if position_ids is not None:
        starts = position_ids == 0  # every row starts with position 0 in these cases
        if chunk is not None:
            starts |= position_ids % chunk == 0
        doc = starts.long().cumsum(1)
        mask = mask & (doc[:, :, None] == doc[:, None, :])
    mask = mask.expand(q.shape[0], n, n)
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    return scores.masked_fill(~mask[:, None], float("-inf"))


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position_ids: torch.Tensor | None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense masked attention; ``sinks`` as in transformers' gpt-oss eager attention: one more logit per head
    joins each query's softmax, and its probability is dropped."""
    scores = reference_scores(q, k, position_ids, window, chunk)
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probs = scores.softmax(-1)[..., : q.shape[1]]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(q.shape[2] // v.shape[2], dim=2))


def _tensors(case: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """``q [B, N, H, D]``, ``k [B, N, H_kv, D]``, ``v [B, N, H_kv, D_v]``, the output gradient ``[B, N, H, D_v]``
    and the position ids of ``case``."""
    g = torch.Generator().manual_seed(0)
    batch, seq, head_dim = case["batch"], case["seq"], case.get("head_dim", 8)
    value_dim = case.get("value_dim", head_dim)
    q = torch.randn(batch, seq, case["heads"], head_dim, generator=g)
    k = torch.randn(batch, seq, case["kv_heads"], head_dim, generator=g)
    v = torch.randn(batch, seq, case["kv_heads"], value_dim, generator=g)
    grad = torch.randn(batch, seq, case["heads"], value_dim, generator=g)
    pos = torch.tensor(case["positions"]) if "positions" in case else None
    return q, k, v, grad, pos


def sink_logits(case: dict[str, Any]) -> torch.Tensor | None:
    """Sink logits near the log-sum-exps of these cases (0.5 to 3), so that they take a real share of each softmax."""
    if not case.get("sinks"):
        return None
    return 1.5 + torch.randn(case["heads"], generator=torch.Generator().manual_seed(1))


def _options(case: dict[str, Any]) -> dict[str, Any]:
    return dict(window=case.get("window"), chunk=case.get("chunk"))


def attention_worker(args: dict[str, Any]) -> dict[tuple[str, int], float]:
    """Every case over the whole world (sp=4) and over pairs of ranks (sp=2)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # the SP groups of the whole world (sp=4) and of pairs of ranks (sp=2), as UlyssesStrategy builds them
    groups = {sp: SequenceParallelGroups.create(SequenceParallelTopology(world, sp, rank), "cpu") for sp in SP_SIZES}
    errors = {}
    for (name, case), sp in itertools.product(CASES.items(), SP_SIZES):
        q, k, v, grad, pos = _tensors(case)
        sinks = sink_logits(case)
        full = [t.clone().requires_grad_() for t in (q, k, v) + ((sinks,) if sinks is not None else ())]
        expected = reference(*full[:3], pos, **_options(case), sinks=None if sinks is None else full[3])
        expected.backward(grad)

        sp_rank = rank % sp
        local = slice(sp_rank * q.shape[1] // sp, (sp_rank + 1) * q.shape[1] // sp)
        shards = [t[:, local].clone().requires_grad_() for t in (q, k, v)]
        rank_sinks = None if sinks is None else sinks.clone().requires_grad_()
        out = ulysses_attention(
            *shards,
            group=groups[sp],
            attn_implementation="sdpa",
            **_options(case),
            sinks=rank_sinks,
            position_ids=None if pos is None else pos[:, local],
        )
        out.backward(grad[:, local])
        compared = [(out, expected[:, local])] + [(s.grad, f.grad[:, local]) for s, f in zip(shards, full)]
        if sinks is not None:  # each rank holds the gradient of the heads it attended: whole once summed
            dist.all_reduce(rank_sinks.grad, group=groups[sp].sp)
            compared.append((rank_sinks.grad, full[3].grad))
        errors[name, sp] = max(((a - b).norm() / b.norm()).item() for a, b in compared)

    positions = torch.tensor(PACKED)  # its largest position id, 11, sits in the last shard only
    for sp in SP_SIZES:
        local = slice(rank % sp * 16 // sp, (rank % sp + 1) * 16 // sp)
        errors["max_position", sp] = documents_of(positions[:, local], groups[sp]).max_position
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
    """Output and q/k/v (and sink) gradients on every rank, relative error < 1e-5."""
    for rank, errors in enumerate(distributed_errors):
        assert errors[name, sp] < 1e-5, f"rank {rank}: relative error {errors[name, sp]:.2e}"


@pytest.mark.parametrize("sp", SP_SIZES)
def test_documents_know_the_largest_position_of_the_whole_rows(
    distributed_errors: list[dict[tuple[str, int], Any]], sp: int
) -> None:
    """Every rank reads the largest position id of the whole rows, 0-d, though only the last shard holds it."""
    for errors in distributed_errors:
        assert errors["max_position", sp].shape == () and errors["max_position", sp].item() == 11


def _documents(case: dict[str, Any], pos: torch.Tensor | None) -> Documents | None:
    return None if pos is None else Documents.from_position_ids(pos, case.get("chunk"))


@pytest.mark.parametrize("significant_bits", [None, 3, 1])
@pytest.mark.parametrize("name", CASES)
def test_sdpa_backend_matches_dense_reference(name: str, significant_bits: int | None) -> None:
    """Length classes of exact lengths (``None``: no padding), of the default 3 bits and of powers of two (1: up to
    twice the length in padding). The log-sum-exp of every path (one document, windowed query blocks, classes) too."""
    case = CASES[name]
    q, k, v, _, pos = _tensors(case)
    got, lse = sdpa_attention(
        q, k, v, _documents(case, pos), window=case.get("window"), return_lse=True, significant_bits=significant_bits
    )
    torch.testing.assert_close(got, reference(q, k, v, pos, **_options(case)), rtol=1e-5, atol=1e-6)
    expected_lse = reference_scores(q, k, pos, **_options(case)).logsumexp(-1).transpose(1, 2)  # [B, N, H]
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-6)
    plain = sdpa_attention(q, k, v, _documents(case, pos), window=case.get("window"), significant_bits=significant_bits)
    torch.testing.assert_close(plain, got, rtol=1e-5, atol=1e-6)


def _relative_errors(got: list[torch.Tensor], expected: list[torch.Tensor]) -> list[float]:
    return [((a - b).norm() / b.norm()).item() for a, b in zip(got, expected)]


def _sink_errors(name: str, attend: Any, dtype: torch.dtype = torch.float32) -> list[float]:
    """Relative errors of ``attend(q, k, v, sinks)`` and of its q, k, v, sinks gradients against the reference."""
    case = CASES[name]
    q, k, v, grad, pos = (None if t is None else t.to(dtype) for t in _tensors(case))
    inputs = [t.requires_grad_() for t in (q, k, v, sink_logits(case).to(dtype))]
    expected = reference(*inputs[:3], pos, **_options(case), sinks=inputs[3])
    expected_grads = torch.autograd.grad(expected, inputs, grad)
    got = attend(*inputs)
    return _relative_errors([got, *torch.autograd.grad(got, inputs, grad)], [expected, *expected_grads])


@pytest.mark.parametrize("significant_bits", [None, 3, 1])
@pytest.mark.parametrize("name", SINK_CASES)
def test_sink_attention_matches_dense_reference(name: str, significant_bits: int | None) -> None:
    """Output and the q, k, v, sinks gradients, relative error < 1e-5 (fp32) and < 1e-12 (float64): the gradient of
    the log-sum-exp, which SDPA does not give, is exact."""
    case = CASES[name]
    pos = _tensors(case)[4]
    core = functools.partial(sdpa_attention, significant_bits=significant_bits)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        return sink_attention(core, q, k, v, _documents(case, pos), sinks, window=case.get("window"))

    assert max(_sink_errors(name, attend)) < 1e-5
    assert max(_sink_errors(name, attend, torch.float64)) < 1e-12


def test_sink_attention_needs_the_log_sum_exp_gradient() -> None:
    """The same attention with the log-sum-exp taken as a constant: the output matches, the q and k gradients do not.
    And without the sinks the output differs: the sink cases are not vacuous."""
    case = CASES["sinks_heads6_kv2_packed_window"]
    pos = _tensors(case)[4]

    def constant_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        out, lse = sdpa_attention(q, k, v, _documents(case, pos), window=case["window"], return_lse=True)
        return out * torch.sigmoid(lse - sinks)[..., None]

    out, grad_q, grad_k, grad_v, grad_sinks = _sink_errors("sinks_heads6_kv2_packed_window", constant_lse)
    assert max(out, grad_v, grad_sinks) < 1e-5 and min(grad_q, grad_k) > 1e-2
    q, k, v, _, _ = _tensors(case)
    without = reference(q, k, v, pos, **_options(case))
    assert _relative_errors([without], [reference(q, k, v, pos, **_options(case), sinks=sink_logits(case))])[0] > 0.1


def test_sinks_match_transformers_gpt_oss_attention() -> None:
    """``ulysses_attention(sinks=...)`` on one process equals transformers' gpt-oss eager attention (its own sink
    formula) given the same packed, windowed mask: output and the q, k, v, sinks gradients."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    case = CASES["sinks_heads6_kv2_packed_window"]
    q, k, v, grad, pos = _tensors(case)
    sinks = sink_logits(case)
    inputs = [t.requires_grad_() for t in (q, k, v, sinks)]
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = inputs[3], case["heads"] // case["kv_heads"]
    additive_mask = reference_scores(q, k, pos, case["window"]).isinf()[:, :1] * torch.finfo(q.dtype).min
    expected, _ = eager_attention_forward(
        module, *(t.transpose(1, 2) for t in inputs[:3]), additive_mask, scaling=q.shape[-1] ** -0.5
    )
    got = ulysses_attention(*inputs[:3], group=None, position_ids=pos, window=case["window"], sinks=inputs[3])
    errors = _relative_errors(
        [got, *torch.autograd.grad(got, inputs, grad)], [expected, *torch.autograd.grad(expected, inputs, grad)]
    )
    assert max(errors) < 1e-5, errors


def test_sinks_are_refused_with_dropout_or_the_wrong_shape() -> None:
    q, k, v, _, _ = _tensors(CASES["sinks_mha"])
    with pytest.raises(ValueError, match="without attention dropout"):
        ulysses_attention(q, k, v, group=None, sinks=torch.zeros(4), dropout_p=0.1)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        ulysses_attention(q, k, v, group=None, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="position_ids"):
        ulysses_attention(q, k, v, group=None, chunk=4)


def test_length_classes() -> None:
    assert [length_class(n, 3) for n in (1, 7, 8, 9, 10, 11, 17, 100)] == [1, 7, 8, 10, 10, 12, 20, 112]
    assert [length_class(n, 1) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, 16]
    assert length_class(9, None) == 9
    # a 128k row of 64-token documents is one batched call; lengths 3, 6, 4, 3, 4 and 12, 8: five classes
    row = Documents.from_position_ids((torch.arange(2**17) % 64)[None])
    assert [(c.length, c.gather.numel()) for c in plan_packed(row).classes] == [(64, 2**17)]
    mixed = Documents.from_position_ids(
        torch.tensor(
            [
                [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3],
                [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7],
            ]
        )
    )
    plan = plan_packed(mixed)
    assert [c.length for c in plan.classes] == [3, 4, 6, 8, 12]
    assert sorted(torch.cat([c.gather[c.keep] for c in plan.classes]).tolist()) == list(range(40))


def _attend(backend: str, case: dict[str, Any], pos: torch.Tensor | None) -> Any:
    """``attend(q, k, v[, sinks])``: a core backend (with :func:`sink_attention` for sinks) on the case's documents."""
    core, documents = CORE_ATTENTION[backend], _documents(case, pos)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if sinks is None:
            return core(q, k, v, documents, window=case.get("window"))
        return sink_attention(core, q, k, v, documents, sinks, window=case.get("window"))

    return attend


@pytest.mark.parametrize(
    "name",
    [
        "packed_documents",
        "packed_sliding_window",
        "heads6_mqa",
        "sliding_window",
        "chunked_packed",
        *SINK_CASES,
        *MLA_CASES,
    ],
)
def test_flex_backend_forward_on_cpu(name: str) -> None:
    """torch's flex attention has no CPU backward (torch 2.13 still refuses it); its forward (eager), log-sum-exp
    included, must match the dense reference."""
    case = CASES[name]
    q, k, v, _, pos = _tensors(case)
    with torch.no_grad():
        got = _attend("flex_attention", case, pos)(q, k, v, sink_logits(case))
        _, lse = CORE_ATTENTION["flex_attention"](
            q, k, v, _documents(case, pos), window=case.get("window"), return_lse=True
        )
    expected = reference(q, k, v, pos, **_options(case), sinks=sink_logits(case))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected_lse = reference_scores(q, k, pos, **_options(case)).logsumexp(-1).transpose(1, 2)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)


def _flash_stand_in(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    window_size: tuple[int, int],
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """flash-attn's ``flash_attn_func`` (``[B, N, h, D]``, causal, ``window_size`` ``(left, 0)`` or ``(-1, -1)``) in
    plain torch, with its limit: one head size for the query, key and value."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "flash-attn 2 runs one head size"
    assert causal and window_size[1] in (0, -1) and not dropout_p
    index = torch.arange(q.shape[1])
    distance = index[:, None] - index[None, :]
    allowed = (distance >= 0) & ((window_size[0] < 0) | (distance <= window_size[0]))
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=allowed, scale=softmax_scale, enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("backend", ["flash_attention_2", "flash_attention_3"])
@pytest.mark.parametrize("name", MLA_CASES)
def test_flash_backends_run_value_heads_of_another_size(
    monkeypatch: pytest.MonkeyPatch, backend: str, name: str
) -> None:
    """The flash backends on a stand-in kernel (:func:`_flash_stand_in`, CPU, bf16) that takes one head size only:
    a value head size other than the query's runs padded to one, at the query's softmax scale, and the output and the
    q, k, v gradients equal the dense reference (one document per row; the varlen kernel is the same call)."""
    module = types.SimpleNamespace(flash_attn_func=_flash_stand_in, flash_attn_varlen_func=None)
    monkeypatch.setitem(sys.modules, _REQUIRED_MODULE[backend], module)
    case = CASES[name]
    q, k, v, grad, _ = _tensors(case)
    full = [t.requires_grad_() for t in (q, k, v)]
    expected = reference(*full, None, window=case.get("window"))
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    got = CORE_ATTENTION[backend](*low, None, window=case.get("window"))
    assert got.shape == expected.shape
    errors = _relative_errors(
        [got.float(), *(g.float() for g in torch.autograd.grad(got, low, grad.bfloat16()))],
        [expected, *torch.autograd.grad(expected, full, grad)],
    )
    assert max(errors) < 2e-2, errors


@pytest.mark.parametrize("return_lse", [False, True])
def test_sdpa_cuda_path_returns_the_value_head_size(return_lse: bool) -> None:
    """SDPA's device path (``F.scaled_dot_product_attention``; with the log-sum-exp, the memory-efficient kernel) on
    meta tensors, as on a GPU: queries and keys of 24, values of 16, GQA, a window -> ``[B, N, h, 16]``."""
    meta = torch.device("meta")
    q, k, v = (torch.empty(2, 40, heads, dim, device=meta) for heads, dim in ((6, 24), (2, 24), (2, 16)))
    result = sdpa_attention(q, k, v, None, window=16, return_lse=return_lse)
    out, lse = result if return_lse else (result, None)
    assert out.shape == (2, 40, 6, 16)
    assert lse is None or lse.shape == (2, 40, 6)


def test_a_window_of_zero_is_no_window() -> None:
    """``window=0`` (a window switched off, as Qwen2-MoE's config writes it) attends as no window, in every backend
    that runs here (flex forward only) and in the ring."""
    case = CASES["packed_documents"]
    q, k, v, _, pos = _tensors(case)
    documents = _documents(case, pos)
    expected = reference(q, k, v, pos)
    with torch.no_grad():
        outputs = {
            "sdpa": sdpa_attention(q, k, v, documents, window=0),
            "flex_attention": CORE_ATTENTION["flex_attention"](q, k, v, documents, window=0),
            "ulysses": ulysses_attention(q, k, v, group=None, position_ids=pos, window=0),
            "ring": ring_attention(q, k, v, documents, None, 1, 0, window=0),
        }
    for name, got in outputs.items():
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)


def test_flex_pads_small_head_sizes_exactly() -> None:
    """Head sizes under the CUDA flex kernel's 16 are zero-padded there (query/key 8 and value 16 padded to 32 here):
    the output and the q/k/v gradients equal attention's on the true sizes (SDPA here: torch has no flex backward on
    CPU, and the padding holds for any kernel that takes the scale)."""
    q, k, v, grad, _ = _tensors(CASES["mla_larger_values_sinks_window"])
    inputs = [t.transpose(1, 2).requires_grad_() for t in (q, k, v)]

    def attend(*qkv: torch.Tensor, minimum: int) -> torch.Tensor:
        query, key, value, scale = pad_head_dims(*qkv, scale=None, minimum=minimum)
        assert min(query.shape[-1], value.shape[-1]) >= minimum or minimum == 0
        return F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=True)[..., : v.shape[-1]]

    outputs = [attend(*inputs, minimum=minimum) for minimum in (0, 32)]
    gradients = [torch.autograd.grad(out, inputs, grad.transpose(1, 2)) for out in outputs]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    for padded, true in zip(gradients[1], gradients[0]):
        torch.testing.assert_close(padded, true, rtol=1e-5, atol=1e-6)


def _cuda_backend(name: str) -> None:
    if name in _REQUIRED_MODULE:
        pytest.importorskip(_REQUIRED_MODULE[name])


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_cudnn", "flash_attention_2", "flash_attention_3", "flex_attention"])
@pytest.mark.parametrize(
    "name", ["packed_documents", "packed_sliding_window", "heads6_mqa", "chunked_packed", *SINK_CASES, *MLA_CASES]
)
def test_cuda_backends_match_dense_reference(backend: str, name: str) -> None:
    """Forward and q/k/v (and sink) gradients of the backends on a GPU in bf16, against the fp32 dense reference."""
    _cuda_backend(backend)
    case = CASES[name]
    q, k, v, grad, pos = (None if t is None else t.cuda() for t in _tensors(case))
    sinks = [] if sink_logits(case) is None else [sink_logits(case).cuda().requires_grad_()]
    full = [t.requires_grad_() for t in (q, k, v)] + sinks
    expected = reference(*full[:3], pos, **_options(case), sinks=sinks[0] if sinks else None)
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)] + sinks
    got = _attend(backend, case, pos)(*low)
    got_grads = torch.autograd.grad(got, low, grad.bfloat16())
    for a, b in zip([got, *got_grads], [expected, *torch.autograd.grad(expected, full, grad)]):
        error = ((a.float() - b).norm() / b.norm()).item()
        assert error < 2e-2, f"{backend} {name}: relative error {error:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["gqa_kv_divisible", "packed_documents", "packed_sliding_window", "sliding_window"])
def test_cuda_sdpa_gqa_runs_a_fused_kernel(name: str, dtype: torch.dtype) -> None:
    """GQA on SDPA, packed and windowed included, with SDPA's math kernel (``[N, N]`` scores) forbidden: fp32 and
    masked calls repeat the K/V heads for the memory-efficient kernel, bf16 causal calls run flash with GQA."""
    _cuda_backend("sdpa")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    case = CASES[name]
    q, k, v, grad, pos = (None if t is None else t.cuda() for t in _tensors(case))
    full = [t.requires_grad_() for t in (q, k, v)]
    expected = reference(*full, pos, **_options(case))
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        got = _attend("sdpa", case, pos)(*low)
        got_grads = torch.autograd.grad(got, low, grad.to(dtype))
    for a, b in zip([got, *got_grads], [expected, *torch.autograd.grad(expected, full, grad)]):
        assert ((a.float() - b).norm() / b.norm()).item() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_backend_choice_follows_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """``"auto"`` takes flash-attn 2 (installed or not, here it is pretended installed) only on CUDA in fp16/bf16; a
    flash backend asked for fp32 is refused with what to change, at set-up and by the kernel itself."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name.startswith("flash_attn") else find_spec(name, *a)
    )
    assert resolve_attn_implementation("auto", "cuda", compute_dtype("bf16-mixed")) == "flash_attention_2"
    assert resolve_attn_implementation("auto", "cuda", compute_dtype("16-mixed")) == "flash_attention_2"
    assert resolve_attn_implementation("auto", "cuda", compute_dtype("32-true")) == "sdpa"
    assert resolve_attn_implementation("auto", "cpu", torch.bfloat16) == "sdpa"
    for name in ("flash_attention_2", "flash_attention_3"):
        assert resolve_attn_implementation(name, "cuda", torch.bfloat16) == name
        with pytest.raises(
            ValueError,
            match=f"attn_implementation='{name}' runs fp16 and bf16 only, and this run "
            r"computes in torch.float32: train in bf16 \(Trainer\(precision='bf16-mixed'\)\)",
        ):
            resolve_attn_implementation(name, "cuda", compute_dtype("32-true"))
    with pytest.raises(ValueError, match="runs fp16 and bf16 only, and this run computes in torch.float32"):
        CORE_ATTENTION["flash_attention_2"](*_tensors(CASES["mha"])[:3], None)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "shape", [dict(heads=8, kv_heads=2, head_dim=128), dict(heads=4, kv_heads=4, head_dim=64, positions=True)]
)
def test_cuda_cudnn_runs_and_matches_float64(shape: dict[str, Any]) -> None:
    """At model-like head sizes in bf16, ``sdpa_cudnn`` runs torch's cuDNN kernel (seen by the profiler, forward and
    backward) and its output and q/k/v gradients match the float64 dense reference in bf16 tolerance."""
    if not torch.backends.cudnn.is_available():
        pytest.skip("torch has no cuDNN")
    rows = [[*range(300), *range(212), *range(512)]] * 2  # packed: three length classes
    case = dict(batch=2, seq=1024, **shape, positions=rows if shape.get("positions") else None)
    case = {key: value for key, value in case.items() if value is not None}
    q, k, v, grad, pos = (None if t is None else t.cuda() for t in _tensors(case))
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected = reference(*full, None if pos is None else pos, **_options(case))
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = _attend("sdpa_cudnn", case, pos)(*low)
        got_grads = torch.autograd.grad(got, low, grad.bfloat16())
    ops = {event.name for event in profile.events()}
    assert {"aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_cudnn_attention_backward"} <= ops
    for a, b in zip([got, *got_grads], [expected, *torch.autograd.grad(expected, full, grad.double())]):
        error = ((a.double() - b).norm() / b.norm()).item()
        assert error < 2e-2, f"sdpa_cudnn {shape}: relative error {error:.2e}"


def test_auto_picks_cudnn_on_hopper_in_half_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """``"auto"`` takes SDPA's cuDNN backend on CUDA in fp16/bf16 from compute capability 9.0 (here cuDNN is
    pretended present), flash-attn 2 (pretended installed) or SDPA below it and without cuDNN, SDPA in fp32 and on
    CPU; ``"sdpa_cudnn"`` asked on CPU, in fp32 or without cuDNN is refused, naming what to choose."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name.startswith("flash_attn") else find_spec(name, *a)
    )
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    bf16, fp32 = compute_dtype("bf16-mixed"), compute_dtype("32-true")
    assert resolve_attn_implementation("auto", "cuda", bf16, (9, 0)) == "sdpa_cudnn"
    assert resolve_attn_implementation("auto", "cuda", compute_dtype("16-mixed"), (10, 0)) == "sdpa_cudnn"
    assert resolve_attn_implementation("auto", "cuda", bf16, (8, 0)) == "flash_attention_2"
    assert resolve_attn_implementation("auto", "cuda", fp32, (9, 0)) == "sdpa"
    assert resolve_attn_implementation("auto", "cpu", bf16) == "sdpa"
    assert resolve_attn_implementation("sdpa_cudnn", "cuda", bf16, (8, 0)) == "sdpa_cudnn"
    with pytest.raises(
        ValueError, match="'sdpa_cudnn' runs fp16 and bf16 only, and this run computes in torch.float32"
    ):
        resolve_attn_implementation("sdpa_cudnn", "cuda", fp32)
    with pytest.raises(ValueError, match="'sdpa_cudnn' runs on CUDA GPUs, and this run is on cpu: choose"):
        resolve_attn_implementation("sdpa_cudnn", "cpu", bf16)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert resolve_attn_implementation("auto", "cuda", bf16, (9, 0)) == "flash_attention_2"
    with pytest.raises(ValueError, match="'sdpa_cudnn' needs a torch built with cuDNN"):
        resolve_attn_implementation("sdpa_cudnn", "cuda", bf16)


def test_cudnn_runs_only_the_calls_torch_says_it_covers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sdpa_cudnn`` asks torch's check for every dense call (length classes, window blocks); a call it does not
    cover runs as ``sdpa`` runs it (here on CPU: every call, so the result is ``sdpa``'s bit for bit), and a covered
    call runs with cuDNN as the only kernel, so that it fails rather than runs another (CPU has no cuDNN kernel)."""
    from lightning_ulysses.attention import cudnn

    asked = []
    cover = cudnn.cudnn_covers
    monkeypatch.setattr(cudnn, "cudnn_covers", lambda *args: asked.append(args[3] is None) or cover(*args))
    case = CASES["packed_sliding_window"]
    q, k, v, _, pos = _tensors(case)
    got = _attend("sdpa_cudnn", case, pos)(q, k, v)
    assert torch.equal(got, _attend("sdpa", case, pos)(q, k, v))
    classes = plan_packed(_documents(case, pos)).classes
    assert len(asked) == sum(-(-c.length // case["window"]) for c in classes)  # one per window block of each class
    monkeypatch.setattr(cudnn, "cudnn_covers", lambda *args: True)
    with pytest.raises(RuntimeError, match="No viable backend|No available kernel"):
        _attend("sdpa_cudnn", case, pos)(q, k, v)


def test_cudnn_asks_torch_only_about_device_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build of torch on a machine without a CUDA driver raises in its cuDNN check (torch 2.11+cu130 on CPU:
    "CUDA driver version is insufficient"); ``sdpa_cudnn`` on host tensors does not ask it and runs as ``sdpa``."""

    def no_driver(*args: object) -> bool:
        raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")

    monkeypatch.setattr(torch.backends.cuda, "can_use_cudnn_attention", no_driver)
    case = CASES["packed_sliding_window"]
    q, k, v, _, pos = _tensors(case)
    assert torch.equal(_attend("sdpa_cudnn", case, pos)(q, k, v), _attend("sdpa", case, pos)(q, k, v))


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

    from lightning_ulysses.hf import apply_ulysses_attention

    common = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=5,
        attn_implementation="sdpa",
    )
    if family == "mistral":
        make = lambda: MistralForCausalLM(MistralConfig(**common))  # noqa: E731
    else:
        make = lambda: Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, max_window_layers=1))  # noqa: E731
    torch.manual_seed(0)
    reference_model = make()
    torch.manual_seed(0)
    model = make()
    apply_ulysses_attention(model, None, "sdpa")
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
    local = SequenceParallelGroups.of(None)  # what keeps the documents: the groups' cache (a patched model has its own)
    first = documents_of(positions, local)
    assert documents_of(positions, local) is first and first.one_per_row
    assert documents_of(positions.clone(), local) is not first
    positions[0, 6] = 0  # packs a second document into row 0
    again = documents_of(positions, local)
    assert again is not first and not again.one_per_row
    assert again.cu_seqlens.tolist() == [0, 6, 12, 24]
    chunked = documents_of(positions, local, chunk=4)  # layers alternating chunked and global attention
    assert documents_of(positions, local) is again and documents_of(positions, local, chunk=4) is chunked
    assert chunked.cu_seqlens.tolist() == [0, 4, 6, 8, 12, 16, 20, 24]  # row 0 reads 0..5, 0, 7..11
    # other groups, another cache: found again
    assert documents_of(positions, SequenceParallelGroups.of(None)) is not documents_of(
        positions, SequenceParallelGroups.of(None)
    )


def test_chunked_documents() -> None:
    """A chunk starts at every position id divisible by the chunk size, inside each packed document; the largest
    position id is read without a host sync."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0], [5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3]])
    documents = Documents.from_position_ids(positions, chunk=3)
    assert documents.starts.long().tolist() == [
        [1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 1],
        [1, 1, 0, 0, 1, 0, 0, 1, 1, 0, 0, 1],
    ]
    assert documents.cu_seqlens.tolist() == [0, 3, 6, 9, 11, 12, 13, 16, 19, 20, 23, 24] and documents.max_seqlen == 3
    assert documents.max_position.shape == () and documents.max_position.item() == 12
    assert Documents.from_position_ids(positions).cu_seqlens.tolist() == [0, 6, 11, 12, 20, 24]
