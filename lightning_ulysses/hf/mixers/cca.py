"""ZAYA's compressed convolutional attention projection (CCA), its convolutions sharded by heads.

The projection turns ``[B, N, C]`` hidden states into the attention's query, key and value; two steps mix tokens:

* the q|k projections ``[B, N, (Hq + Hkv) D]``, padded with ``K`` zeros before the sequence, run through a
  depthwise causal ``Conv1d`` and then a grouped one (one group of ``D`` channels per query or key head): a causal
  convolution over ``K + 1`` tokens, independent across the ``Hq + Hkv`` heads. Sharded like the kernels of
  :mod:`.kernels`, with one all-to-all pair::

      qk [B, N/P, Hq + Hkv, D]  --all-to-all-->  [B, N, h, D]  -- pad, both convolutions with this rank's heads'
      weights, one row per packed document (:class:`~lightning_ulysses.hf.mixers.core.ShardedCore`) -->
      [B, N, h, D]  --all-to-all-->  [B, N/P, Hq + Hkv, D]

* half of each value head comes from the previous token (``v_proj_delayed``), the first token of a sequence taking
  the projection of zeros: a one-token shift filled with that projection
  (:func:`~lightning_ulysses.hf.mixers.shift.shift_sequence`), afresh at every document start.

Everything else (the projections, the residual q/k paths, the padding mask ``conv_mask``, a per-token multiply)
runs on this rank's tokens as in the layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_ulysses.attention import Documents
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf.mixers.core import ShardedCore
from lightning_ulysses.hf.mixers.shift import shift_sequence

_PARTS = (
    "q_proj",
    "k_proj",
    "v_proj_current",
    "v_proj_delayed",
    "conv_qk_depthwise",
    "conv_qk_grouped",
    "conv_kernel_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_key_value_groups",
    "head_dim",
)


# ``module: Any``: the layer's parts are read by name, which nn.Module's stubs type as ``Tensor | Module``
def is_cca_projection(module: Any) -> bool:
    """A layer built like ZAYA's CCA projection: q, k, current and delayed value projections, a depthwise
    ``Conv1d`` over the q|k channels and a grouped one with a group of ``head_dim`` channels per head, their kernel
    sizes adding up to ``conv_kernel_size + 2``."""
    if not all(hasattr(module, part) for part in _PARTS):
        return False
    depthwise, grouped = module.conv_qk_depthwise, module.conv_qk_grouped
    heads = module.num_attention_heads + module.num_key_value_heads
    channels = heads * module.head_dim
    return (
        isinstance(depthwise, nn.Conv1d)
        and isinstance(grouped, nn.Conv1d)
        and depthwise.in_channels == depthwise.out_channels == depthwise.groups == channels
        and grouped.in_channels == grouped.out_channels == channels
        and grouped.groups == heads
        and depthwise.padding == grouped.padding == (0,)
        and depthwise.stride == grouped.stride == (1,)
        and depthwise.dilation == grouped.dilation == (1,)
        and depthwise.kernel_size[0] + grouped.kernel_size[0] - 2 == module.conv_kernel_size
    )


def _per_head(parameter: Tensor | None, heads: int) -> Tensor | None:
    """A convolution's ``[heads * D, ...]`` weight or bias -> ``[heads, D, ...]``."""
    return None if parameter is None else parameter.unflatten(0, (heads, -1))


# ``module: Any``: the layer's parts are read by name, which nn.Module's stubs type as ``Tensor | Module``
def sharded_cca_forward(
    module: Any, group: Callable[[], SequenceParallelGroups], documents: Callable[[], Documents | None]
) -> Callable[..., Any]:
    """The projection's forward on this rank's ``[B, N/P, C]`` tokens: ``(query [B, N/P, Hq, D], key and value
    [B, N/P, Hkv, D])`` as the layer returns them, its convolutions head-sharded over the whole sequence (see the
    module docstring)."""
    depthwise, grouped = module.conv_qk_depthwise, module.conv_qk_grouped
    heads, head_dim = module.num_attention_heads + module.num_key_value_heads, module.head_dim

    def forward(hidden_states: Tensor, cache: Any = None, conv_mask: Tensor | None = None, **kwargs: Any) -> Any:
        if cache is not None or kwargs.get("past_key_values") is not None:
            raise ValueError(
                f"{type(module).__name__} under sequence parallelism runs without a cache (training, use_cache=False)."
            )
        if conv_mask is not None:
            hidden_states = hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)
        batch, seq_len, _ = hidden_states.shape
        hidden_shape = (batch, seq_len, -1, head_dim)
        queries, keys = module.q_proj(hidden_states), module.k_proj(hidden_states)

        query_residual = queries.view(hidden_shape)
        key_residual = keys.view(hidden_shape).repeat_interleave(module.num_key_value_groups, dim=2)
        query_residual = (query_residual + key_residual) * 0.5
        key_residual = query_residual.view(batch, seq_len, -1, module.num_key_value_groups, head_dim).mean(dim=-2)

        core = ShardedCore(group(), heads, heads, documents())
        weights: list[Any] = [  # Tensor or None: the convolutions' weights and biases, this rank's heads
            core.local(cast(Tensor, _per_head(p, heads))) if p is not None else None
            for p in (depthwise.weight, depthwise.bias, grouped.weight, grouped.bias)
        ]
        local_heads = weights[0].shape[0]

        def convolutions(qk: Tensor) -> tuple[Tensor, None]:  # [b, n, h, D]: this rank's heads, whole rows
            x = F.pad(qk.flatten(2).transpose(1, 2), (module.conv_kernel_size, 0))
            flat: list[Any] = [None if w is None else w.flatten(0, 1) for w in weights]
            x = F.conv1d(x, flat[0], flat[1], groups=local_heads * head_dim)
            x = F.conv1d(x, flat[2], flat[3], groups=local_heads)
            return x.transpose(1, 2).unflatten(2, (local_heads, head_dim)).contiguous(), None

        qk = torch.cat([queries, keys], dim=-1).view(hidden_shape)
        qk = core.gather(core.run(convolutions, core.scatter(qk))[0]).flatten(2)
        query_size = module.num_attention_heads * head_dim
        query = qk[..., :query_size].view(hidden_shape) + query_residual
        key = qk[..., query_size:].view(hidden_shape) + key_residual

        first = module.v_proj_delayed(hidden_states.new_zeros(batch, 1, hidden_states.shape[-1]))  # [B, 1, C_v / 2]
        delayed = shift_sequence(module.v_proj_delayed(hidden_states), 1, group(), documents(), first)
        value = torch.cat([module.v_proj_current(hidden_states), delayed], dim=-1).view(hidden_shape)
        return query, key, value

    return forward
