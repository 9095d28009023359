"""Lightning attention (MiniMax): linear attention with a constant decay per head, sharded by heads.

``o_t = sum_{s <= t} exp(-lambda_h (t - s)) (q_t . k_s) v_s`` for head ``h``: independent across heads, sequential
along the sequence. transformers computes it inline in the layer's forward (no kernel function to swap), block by
block: within a block through the decayed ``[block, block]`` score matrix, across blocks through the running
``K^T V`` state. :func:`lightning_attention` is that computation for whole sequences of some heads (the same
operations in the same order); :func:`sharded_lightning_forward` runs the layer with it between the all-to-alls of
:class:`~lightning_ulysses.hf.mixers.core.ShardedCore`. The per-token parts (the activated q|k|v projection, the norm
over all heads, the output gate, the out-projection) run on this rank's tokens as in the layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_ulysses.attention import Documents
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf.mixers.core import ShardedCore

_PARTS = (
    "qkv_proj",
    "output_gate",
    "out_proj",
    "norm",
    "act_fn",
    "slope_rate",
    "query_decay",
    "key_decay",
    "diagonal_decay",
    "block_size",
    "num_attention_heads",
    "head_dim",
)


# ``module: Any``: the layer's parts are read by name, which nn.Module's stubs type as ``Tensor | Module``
def is_lightning_attention(module: Any) -> bool:
    """A layer built like transformers' lightning attention: a q|k|v projection, per-head decay buffers
    (``slope_rate`` ``[H, 1, 1]``, ``query_decay`` / ``key_decay`` ``[H, block, 1]``, ``diagonal_decay``
    ``[1, H, block, block]``), a norm, an output gate and an out-projection."""
    if not all(hasattr(module, part) for part in _PARTS):
        return False
    heads, block = module.num_attention_heads, module.block_size
    return (
        tuple(module.slope_rate.shape) == (heads, 1, 1)
        and tuple(module.query_decay.shape) == (heads, block, 1)
        and tuple(module.diagonal_decay.shape[-3:]) == (heads, block, block)
    )


# ``module: Any``: the layer's parts are read by name, which nn.Module's stubs type as ``Tensor | Module``
def lightning_attention(
    query: Tensor, key: Tensor, value: Tensor, module: Any, heads: Callable[[Tensor], Tensor]
) -> tuple[Tensor, Tensor]:
    """``[B, H', N, D]`` query, key, value -> ``[B, H', N, D]`` output and ``[B, H', D, D]`` final ``K^T V`` state:
    lightning attention of ``module`` over whole sequences for the heads that ``heads`` selects from a per-head
    buffer (head axis first)."""
    slope_rate, query_decay, key_decay = (heads(b) for b in (module.slope_rate, module.query_decay, module.key_decay))
    diagonal_decay = heads(module.diagonal_decay.transpose(0, 1)).transpose(0, 1)
    batch, num_heads, seq_len, head_dim = query.shape
    state = query.new_zeros(batch, num_heads, head_dim, head_dim)
    outputs = []
    for start in range(0, seq_len, module.block_size):
        end = min(start + module.block_size, seq_len)
        size = end - start
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        intra = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * diagonal_decay[:, :, :size, :size], v)
        inter = torch.matmul(q * query_decay[:, :size], state)
        outputs.append(inter + intra)
        state = state * torch.exp(-slope_rate * size) + torch.matmul((k * key_decay[:, -size:]).transpose(-1, -2), v)
    return torch.cat(outputs, dim=-2), state


# ``module: Any``: the layer's parts are read by name, which nn.Module's stubs type as ``Tensor | Module``
def sharded_lightning_forward(
    module: Any, group: Callable[[], SequenceParallelGroups], documents: Callable[[], Documents | None]
) -> Callable[..., Any]:
    """The layer's forward on this rank's ``[B, N/P, C]`` tokens, lightning attention head-sharded over the whole
    sequence; returns ``(output, state)`` as the layer does, the final state of every head gathered and detached
    (``None`` for packed rows, which run as one row per document)."""

    def forward(
        hidden_states: Tensor,
        position_embeddings: Any = None,
        attention_mask: Tensor | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        if cache is not None or (attention_mask is not None and attention_mask.dim() == 2):
            raise ValueError(
                f"{type(module).__name__} under sequence parallelism runs without a cache or a padding mask (padding "
                "is a document of its own, read from the position ids)."
            )
        batch, seq_len, _ = hidden_states.shape
        heads, head_dim = module.num_attention_heads, module.head_dim
        qkv = module.act_fn(module.qkv_proj(hidden_states)).reshape(batch, seq_len, heads, 3 * head_dim)
        core = ShardedCore(group(), heads, heads, documents())
        query, key, value = (core.scatter(t) for t in torch.split(qkv, head_dim, dim=3))

        def on_rows(*rows: Tensor) -> tuple[Tensor, Tensor]:  # [b, n, h, D] query, key, value
            # mypy cannot count the starred generator: the three rows are query, key and value
            out, state = lightning_attention(  # type: ignore[call-arg]
                *(t.transpose(1, 2) for t in rows),  # type: ignore[arg-type]
                module,
                core.local,
            )
            return out.transpose(1, 2), state

        out, state = core.run(on_rows, query, key, value)
        out = core.gather(out).reshape(batch, seq_len, heads * head_dim)
        out = F.sigmoid(module.output_gate(hidden_states)) * module.norm(out)
        return module.out_proj(out), None if state is None else core.gather_state(state)

    return forward
