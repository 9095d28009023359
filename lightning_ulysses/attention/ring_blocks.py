"""The block kernels of ring attention: one ``(query chunk, key chunk)`` pair, forward with its log-sum-exp, and the
backward that takes the *merged* output and log-sum-exp of all blocks back.

Layouts: ``query [b, n, h, D]``, ``key [b, m, kv_h, D]``, ``value [b, m, kv_h, D_v]`` (``h`` a multiple of ``kv_h``),
output ``[b, n, h, D_v]``, log-sum-exp ``[b, n, h]`` fp32 (``-inf`` for a query that reads no key of the block);
``kind`` is ``"full"`` (every query reads every key), ``"causal"`` (a diagonal block, ``n == m``) or ``"masked"``
(``mask [b or 1, n, m]`` bool, ``True`` where a query reads a key).

* CPU: torch's flash kernel for CPU (``_scaled_dot_product_flash_attention_for_cpu`` and its backward), GQA fused,
  the mask as an additive bias.
* CUDA: torch's memory-efficient kernel (``_scaled_dot_product_efficient_attention`` and its backward: fp32, fp16
  and bf16, an additive bias for the masked blocks), the kernel torch's own context parallelism runs per block.
  It wants as many K/V heads as query heads (GQA blocks are expanded, their gradients summed back per group), a bias
  whose rows are 16-element aligned, and hands its log-sum-exp out padded to a multiple of 32 queries (it is taken
  back in that layout). Its backward must get the output in the forward's memory layout, ``[b, n, h, D]``
  contiguous: in fp16/bf16 the kernel computes ``rowsum(dO * out)`` itself and steps over ``out``'s rows by
  ``h * D`` whatever its strides (``o_strideM()`` in torch's ``mem_eff_attention/kernel_backward.h``); fp32 computes
  it in ATen, which reads the strides.

Both kernels run one head size: a value head size other than the query's (MLA) is zero-padded to one block by block
(:func:`~lightning_ulysses.attention.core.equal_head_dims`), so the K/V blocks travel the ring unpadded and the set-up
check of equal head sizes covers the kernels that run.

:func:`check_block_kernels` runs the kernels of one device and dtype on a small problem (every kind, GQA, a query
that reads nothing in a block, a chunk length that is no multiple of 32) against attention in float64: the strategy
calls it at set-up, so a device whose kernels are not exact is refused before any step.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from lightning_ulysses.attention.core import equal_head_dims

BlockKind = Literal["causal", "full", "masked"]

_LSE_ALIGNMENT = 32  # the memory-efficient kernel pads its log-sum-exp to a multiple of this many queries
_BIAS_ALIGNMENT = 16  # ... and reads a bias whose rows start 16-element aligned


def block_forward(
    query: Tensor, key: Tensor, value: Tensor, kind: BlockKind, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention of one block (see the module docstring): ``[b, n, h, D_v]`` output, ``[b, n, h]`` fp32 log-sum-exp."""
    q, k, v = (t.transpose(1, 2) for t in equal_head_dims(query, key, value))  # [b, heads, tokens, max(D, D_v)]
    out, lse = _kernels(query.device)[0](q, k, v, kind, mask, scale)
    lse = lse.float()
    if mask is not None:  # a query that reads nothing: the kernels give it a log-sum-exp of 0 (CPU) or NaN outputs
        reads_nothing = ~mask.any(-1)[:, None]  # [b or 1, 1, n]
        lse = lse.masked_fill(reads_nothing, float("-inf"))
        out = out.masked_fill(reads_nothing[..., None], 0.0)
    return out[..., : value.shape[-1]].transpose(1, 2), lse.transpose(1, 2)


def block_backward(
    grad: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    kind: BlockKind,
    mask: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of one block's ``query``, ``key`` and ``value`` (their layouts) for the output gradient ``grad``,
    given the merged ``out [b, n, h, D_v]`` and ``lse [b, n, h]`` of the queries over all blocks (then each block's
    share of the softmax, and so its gradient, is exact)."""
    q, k, v, g, o = (t.transpose(1, 2) for t in equal_head_dims(query, key, value, grad, out))
    lse = lse.transpose(1, 2).contiguous()
    grads = _kernels(query.device)[1](g, q, k, v, o, lse, kind, mask, scale)
    return tuple(d[..., : t.shape[-1]].transpose(1, 2) for d, t in zip(grads, (query, key, value)))


def merge_blocks(acc: tuple[Tensor, Tensor] | None, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge one block's ``out [b, n, h, D_v]`` and ``lse [b, n, h]`` into the running ones (fp32; online softmax)."""
    if acc is None:
        return out.float(), lse
    acc_out, acc_lse = acc
    merged = torch.logaddexp(acc_lse, lse)
    return (
        acc_out * torch.exp(acc_lse - merged)[..., None] + out.float() * torch.exp(lse - merged)[..., None],
        merged,
    )


# ----------------------------------------------------------------------------------------------
# CPU: torch's flash kernel for CPU
# ----------------------------------------------------------------------------------------------
def _bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``[b, n, m]`` bool -> ``[b, 1, n, m]`` additive mask (0 / -inf) for the kernels' ``[b, h, n, m]`` scores."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))[:, None]


def _cpu_forward(
    q: Tensor, k: Tensor, v: Tensor, kind: BlockKind, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, kind == "causal", attn_mask=None if mask is None else _bias(mask, q.dtype), scale=scale
    )


def _cpu_backward(
    g: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    kind: BlockKind,
    mask: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g,
        q,
        k,
        v,
        o,
        lse,
        0.0,
        kind == "causal",
        attn_mask=None if mask is None else _bias(mask, q.dtype),
        scale=scale,
    )


# ----------------------------------------------------------------------------------------------
# CUDA: torch's memory-efficient attention
# ----------------------------------------------------------------------------------------------
def _aligned_bias(mask: Tensor, dtype: torch.dtype, batch: int, heads: int) -> Tensor:
    """The additive bias of ``mask [b or 1, n, m]`` as the memory-efficient kernel reads it: ``[batch, heads, n, m]``
    (a broadcast view), its rows in a buffer padded to 16 elements."""
    n, m = mask.shape[-2:]
    padded = math.ceil(m / _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT
    buffer = torch.full((mask.shape[0], 1, n, padded), float("-inf"), dtype=dtype, device=mask.device)
    bias = buffer[..., :m]
    bias.masked_fill_(mask[:, None], 0.0)
    return bias.expand(batch, heads, n, m)


def _expand_heads(t: Tensor, heads: int) -> Tensor:
    """``[b, kv_h, m, D]`` -> ``[b, heads, m, D]``: each K/V head repeated for the query heads of its group."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _in_forward_layout(t: Tensor) -> Tensor:
    """``t [b, h, n, D]`` over the memory of a contiguous ``[b, n, h, D]`` (a copy only where it is laid out otherwise):
    the layout the memory-efficient forward hands its output out in, which its 16-bit backward assumes."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _cuda_forward(
    q: Tensor, k: Tensor, v: Tensor, kind: BlockKind, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    batch, heads, n = q.shape[:3]
    bias = None if mask is None else _aligned_bias(mask, q.dtype, batch, heads)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _expand_heads(k, heads), _expand_heads(v, heads), bias, True, 0.0, kind == "causal", scale=scale
    )
    return out, lse[..., :n]


def _cuda_backward(
    g: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    kind: BlockKind,
    mask: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    batch, heads, n = q.shape[:3]
    bias = None if mask is None else _aligned_bias(mask, q.dtype, batch, heads)
    padded = math.ceil(n / _LSE_ALIGNMENT) * _LSE_ALIGNMENT
    lse = torch.nn.functional.pad(lse, (0, padded - n))  # the layout the forward handed out
    no_dropout = torch.empty((), dtype=torch.long)  # the philox seed and offset, unread without dropout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        _in_forward_layout(g),
        q,
        _expand_heads(k, heads),
        _expand_heads(v, heads),
        bias,
        _in_forward_layout(o),
        lse,
        no_dropout,
        no_dropout,
        0.0,
        [True, True, True, False],
        kind == "causal",
        scale=scale,
    )
    kv_heads = k.shape[1]
    if kv_heads != heads:  # each K/V head's gradient is the sum over the query heads of its group
        dk, dv = (t.unflatten(1, (kv_heads, heads // kv_heads)).sum(2) for t in (dk, dv))
    return dq, dk, dv


_KERNELS = {"cuda": (_cuda_forward, _cuda_backward)}
"""The (forward, backward) block kernels by device type; any other device runs the CPU ones."""


def _kernels(device: torch.device) -> tuple:
    """The (forward, backward) block kernels of ``device``, on ``[b, heads, tokens, D]`` layouts of one head size."""
    return _KERNELS.get(device.type, (_cpu_forward, _cpu_backward))


# ----------------------------------------------------------------------------------------------
# the set-up check of a device's kernels
# ----------------------------------------------------------------------------------------------
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
"""Relative error (norm of the difference / norm of the reference) allowed per dtype against float64."""


def check_block_kernels(device: torch.device, dtype: torch.dtype, chunk: int = 40) -> list[str]:
    """Run three blocks (causal, full, masked with a query that reads nothing in it) of ``chunk`` queries, 4 query
    heads over 2 K/V heads, through :func:`block_forward`, :func:`merge_blocks` and :func:`block_backward` on
    ``device`` in ``dtype``, against attention over the three blocks' keys at once in float64; the failures, as
    ``"what: relative error x > tolerance"`` (empty: exact)."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, scale = 4, 2, 64, 0.125

    def sample(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    query = sample(1, chunk, heads, head_dim)
    keys, values = sample(1, 3 * chunk, kv_heads, head_dim), sample(1, 3 * chunk, kv_heads, head_dim)
    grad = sample(1, chunk, heads, head_dim)
    masked = torch.rand(1, chunk, chunk, generator=generator) < 0.5
    masked[:, 3] = False  # query 3 reads no key of the masked block
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()[None]
    blocks: list[tuple[BlockKind, Tensor | None]] = [("causal", None), ("full", None), ("masked", masked)]
    allowed = torch.cat([causal, torch.ones_like(causal), masked], dim=-1)  # [1, chunk, 3 chunk]

    reference = _dense_attention(query, keys, values, allowed, scale, grad)
    try:
        ours = _blockwise_attention(query, keys, values, blocks, scale, grad, device, dtype)
    except RuntimeError as error:  # a kernel that does not run here (an unsupported head dim, dtype, alignment)
        return [f"{dtype}: the kernels fail: {str(error).splitlines()[0]}"]
    failures = []
    for what, ref, got in zip(("output", "log-sum-exp", "dQ", "dK", "dV"), reference, ours):
        relative_error = ((got.double().cpu() - ref).norm() / ref.norm()).item()
        if not relative_error <= TOLERANCE[dtype]:  # NaN fails too
            failures.append(f"{dtype} {what}: relative error {relative_error:.1e} > {TOLERANCE[dtype]:.0e}")
    return failures


def _dense_attention(
    query: Tensor, key: Tensor, value: Tensor, allowed: Tensor, scale: float, grad: Tensor
) -> tuple[Tensor, ...]:
    """Float64 attention of ``query [1, n, h, D]`` to ``key``/``value [1, m, kv_h, D]`` where ``allowed [1, n, m]``:
    output, log-sum-exp ``[1, n, h]`` and the gradients of query, key, value for the output gradient ``grad``."""
    query, key, value = (t.clone().requires_grad_() for t in (query, key, value))
    groups = query.shape[2] // key.shape[2]
    k, v = (t.repeat_interleave(groups, dim=2) for t in (key, value))
    scores = torch.einsum("bnhd,bmhd->bhnm", query, k) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.einsum("bhnm,bmhd->bnhd", torch.softmax(scores, -1), v)
    out.backward(grad)
    # the clones are leaves that require grad: backward has filled their .grad (typed Tensor | None)
    return out.detach(), lse.transpose(1, 2).detach(), query.grad, key.grad, value.grad  # type: ignore[return-value]


def _blockwise_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    blocks: list[tuple[BlockKind, Tensor | None]],
    scale: float,
    grad: Tensor,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Tensor, ...]:
    """The same as :func:`_dense_attention`, block by block as the ring runs it (the keys cut into ``len(blocks)``
    equal blocks), on ``device`` in ``dtype``."""
    query, grad = (t.to(device, dtype) for t in (query, grad))
    key_blocks, value_blocks = (t.to(device, dtype).chunk(len(blocks), dim=1) for t in (keys, values))
    device_blocks = [(kind, None if mask is None else mask.to(device)) for kind, mask in blocks]
    acc = None
    for (kind, mask), key, value in zip(device_blocks, key_blocks, value_blocks):
        acc = merge_blocks(acc, *block_forward(query, key, value, kind, mask, scale))
    assert acc is not None  # blocks is not empty
    out, lse = acc[0].to(dtype), acc[1]
    grad_query, grad_keys, grad_values = torch.zeros_like(query, dtype=torch.float32), [], []
    for (kind, mask), key, value in zip(device_blocks, key_blocks, value_blocks):
        dq, dk, dv = block_backward(grad, query, key, value, out, lse, kind, mask, scale)
        grad_query += dq
        grad_keys.append(dk)
        grad_values.append(dv)
    return out, lse, grad_query, torch.cat(grad_keys, dim=1), torch.cat(grad_values, dim=1)
