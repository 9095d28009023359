"""The recurrent block of Griffin / RecurrentGemma: a depthwise causal convolution and the RG-LRU, sharded by heads.

Per token the block computes ``y = act(linear_y(u))`` and ``x = linear_x(u)`` (``lru_width = H x bw`` channels);
then, along the sequence, a depthwise causal convolution of ``x`` (kernel ``K``, padding ``K - 1``, cut to ``N``)
and the RG-LRU: gates block-diagonal per head (``[H, bw, bw]``), a recurrence diagonal per channel, restarted
where the position id is 0; then ``linear_out(rg_lru(conv(x)) * y)``. transformers computes both sequential parts
inline (no kernel function to swap), and both are head-local, so :func:`sharded_recurrent_forward` runs them
together between one pair of all-to-alls of :class:`~lightning_ulysses.hf.mixers.core.ShardedCore`::

    x [B, N/P, H, bw] --all-to-all--> [B, N, h, bw]   (all tokens of this rank's heads, sequence order)
                                        | one row per document (packed rows only)
                                        | the convolution, then the RG-LRU
    y [B, N/P, H, bw] <--all-to-all-- [B, N, h, bw]

``lru_width`` elements per token in and as many out (again in backward): what the convolution alone would cost,
the RG-LRU adding nothing. The reset flags come from the whole rows' position ids, which every layer shares
(once per batch with the documents, :func:`~lightning_ulysses.attention.documents.whole_position_ids`: the strategy's
whole rows, or gathered without it).
Packed rows run one row per document, so the convolution's window and the recurrence start afresh at every
document. :func:`rg_lru` is the layer's own
computation (the same operations in the same order, transformers' ``_rnn_scan`` and its bounded-gradient square
root) on some heads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_ulysses.attention import Documents
from lightning_ulysses.attention.documents import whole_position_ids
from lightning_ulysses.engines import transformers as transformers_engine
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf.mixers.core import ShardedCore

_BLOCK_PARTS = ("linear_x", "linear_y", "linear_out", "act_fn", "conv_1d", "rg_lru")
_RG_LRU_PARTS = (
    "recurrent_param",
    "input_gate_weight",
    "input_gate_bias",
    "recurrent_gate_weight",
    "recurrent_gate_bias",
    "num_attention_heads",
    "block_width",
    "_rnn_scan",
)


# ``module: Any``: the layer's parts are read by name, which nn.Module's stubs type as ``Tensor | Module``
def is_recurrent_block(module: Any) -> bool:
    """A block built like Griffin's recurrent block: per-token ``linear_x`` / ``linear_y`` / ``linear_out``, a depthwise
    causal ``conv_1d`` (padding ``K - 1``) over the ``C`` channels and an ``rg_lru`` child with ``recurrent_param``
    ``[C]``, per-head gates ``input_gate_weight`` / ``recurrent_gate_weight`` ``[H, bw, bw]`` and their biases
    ``[H, bw]``, ``C = H x bw``, whose forward bounds its square root's gradient and runs ``_rnn_scan``."""
    if not all(hasattr(module, part) for part in _BLOCK_PARTS):
        return False
    conv, lru = module.conv_1d, module.rg_lru
    if not isinstance(conv, nn.Conv1d) or not all(hasattr(lru, part) for part in _RG_LRU_PARTS):
        return False
    channels, (width,) = conv.in_channels, conv.kernel_size
    heads, block = lru.num_attention_heads, lru.block_width
    forward = inspect.unwrap(type(lru).forward)
    return (
        conv.out_channels == conv.groups == channels == heads * block
        and conv.stride == (1,)
        and conv.dilation == (1,)
        and conv.padding == (width - 1,)
        and conv.padding_mode == "zeros"
        and _shape(lru.recurrent_param) == (channels,)
        and _shape(lru.input_gate_weight) == _shape(lru.recurrent_gate_weight) == (heads, block, block)
        and _shape(lru.input_gate_bias) == _shape(lru.recurrent_gate_bias) == (heads, block)
        and "SqrtBoundDerivative" in getattr(getattr(forward, "__code__", None), "co_names", ())
    )


# ``lru: Any``: the layer's parts are read by name, which nn.Module's stubs type as ``Tensor | Module``
def rg_lru(lru: Any, x: Tensor, reset: Tensor, heads: Callable[[Tensor], Tensor]) -> Tensor:
    """``[b, n, h x bw]`` activations and ``[b, n, 1]`` reset flags -> ``[b, n, h x bw]``: the RG-LRU ``lru`` over whole
    rows for the heads that ``heads`` selects from a per-head parameter (head axis first), from a zero state."""
    batch, seq_len, width = x.shape
    block = lru.block_width
    sqrt_bound = inspect.unwrap(type(lru).forward).__globals__["SqrtBoundDerivative"]
    per_head = x.reshape(batch * seq_len, width // block, block).permute(1, 0, 2)

    def gate(weight: Tensor, bias: Tensor) -> Tensor:
        res = torch.baddbmm(heads(bias)[:, None, :], per_head, heads(weight))
        return torch.sigmoid(res.transpose(0, 1).reshape(batch, seq_len, width))

    input_gate = gate(lru.input_gate_weight, lru.input_gate_bias)
    recurrent_gate = gate(lru.recurrent_gate_weight, lru.recurrent_gate_bias)
    recurrent_param = heads(lru.recurrent_param.view(-1, block)).reshape(width)
    log_recurrent_gate = -8.0 * recurrent_gate * F.softplus(recurrent_param)
    recurrent_gate = torch.exp(log_recurrent_gate)
    a_square = torch.exp(2 * log_recurrent_gate)
    gated_inputs = x * input_gate
    multiplier = sqrt_bound.apply(1 - a_square)
    multiplier = reset + ~reset * multiplier
    normalized_x = gated_inputs * multiplier.type(x.dtype)
    return transformers_engine.rnn_scan(lru, normalized_x, recurrent_gate, reset)


# ``module: Any``: the layer's parts are read by name, which nn.Module's stubs type as ``Tensor | Module``
def sharded_recurrent_forward(
    module: Any, group: Callable[[], SequenceParallelGroups], documents: Callable[[], Documents | None]
) -> Callable[..., Any]:
    """The block's forward on this rank's ``[B, N/P, C]`` tokens, its convolution and RG-LRU head-sharded over the
    whole sequence (see the module docstring); returns ``(output, None)`` as the block does. Training only: a
    cache (``use_cache=True``, the decoding states it writes) is refused."""
    conv, lru = module.conv_1d, module.rg_lru
    heads, block, (width,) = lru.num_attention_heads, lru.block_width, conv.kernel_size

    def forward(
        input_states: Tensor, position_ids: Tensor, attention_mask: Any = None, use_cache: bool = True, **kwargs: Any
    ) -> tuple[Tensor, None]:
        if use_cache:
            raise ValueError(
                f"{type(module).__name__} under sequence parallelism runs without a cache (use_cache=False): its "
                "convolution and recurrent states would hold this rank's heads only."
            )
        module.conv1d_state, lru.recurrent_states = None, None  # as the block does without a cache
        y_branch = module.act_fn(module.linear_y(input_states))
        x_branch = module.linear_x(input_states).unflatten(-1, (heads, block))
        core = ShardedCore(group(), heads, heads, documents())
        reset = (whole_position_ids(position_ids, core.group) == 0)[:, :, None]  # [B, N, 1]
        weight = core.local(conv.weight.view(heads, block, 1, width)).flatten(0, 1)
        bias = None if conv.bias is None else core.local(conv.bias.view(heads, block)).flatten()

        def on_rows(x: Tensor, reset: Tensor) -> tuple[Tensor, None]:  # [b, n, h, bw], [b, n, 1]
            seq_len = x.shape[1]
            x = x.flatten(2).transpose(1, 2)
            x = F.conv1d(x, weight, bias, padding=width - 1, groups=x.shape[1])[..., :seq_len]
            return rg_lru(lru, x.transpose(1, 2), reset, core.local).unflatten(-1, (-1, block)), None

        x_branch, _ = core.run(on_rows, core.scatter(x_branch), reset)
        hidden_states = core.gather(x_branch).flatten(2) * y_branch
        return module.linear_out(hidden_states), None

    return forward


def _shape(parameter: Tensor) -> tuple[int, ...]:
    """A parameter's shape, ZeRO-3's partitioned ones included (kept in ``ds_shape``)."""
    return tuple(getattr(parameter, "ds_shape", parameter.shape))
