"""The sequential kernels of transformers' hybrid models, and how each one is sharded by heads.

transformers (5.x) calls every token mixer's sequential part through a few module-level kernel functions, each
a hub kernel with a torch fallback (``causal_conv1d_fn``, ``mamba2_chunk_scan``, ``mamba_selective_scan``,
``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``, RWKV's ``rwkv_linear_attention``); the
projections, gates and norms around them act per token. A
:class:`KernelSpec` says, for one such function, where its per-token streams keep their heads, which inputs are
shared by groups of heads and which are per-head weights; :func:`sharded_kernel` turns the function into one that
takes this rank's sequence shard and runs the original on the whole sequence for this rank's heads
(:class:`~lightning_ulysses.hf.mixers.core.ShardedCore`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lightning_ulysses.attention import Documents
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf.mixers.core import ShardedCore

# Stream layouts, each to and from the core's [batch, seq, heads, dim].
_TO_CORE: dict[str, Callable[[Tensor], Tensor]] = {
    "BNHD": lambda x: x,
    "BNH": lambda x: x.unsqueeze(-1),
    "BHN": lambda x: x.transpose(1, 2).unsqueeze(-1),  # channels first, one channel per head (convolutions, Mamba)
    "BDN": lambda x: x.transpose(1, 2).unsqueeze(2),  # one group of D channels, first (Mamba's shared B and C)
}
_FROM_CORE: dict[str, Callable[[Tensor], Tensor]] = {
    "BNHD": lambda x: x,
    "BNH": lambda x: x.squeeze(-1),
    "BHN": lambda x: x.squeeze(-1).transpose(1, 2),
    "BDN": lambda x: x.squeeze(2).transpose(1, 2),
}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel function's arguments by name.

    ``heads`` / ``grouped``: per-token streams ``name -> layout`` of the heads / of the groups the heads share;
    ``weights`` / ``group_weights``: per-head / per-group tensors (head axis first); ``output``: the layout of the
    (first) output; ``head_count`` / ``group_count``: ``(argument, axis)`` giving the number of heads / groups;
    ``no_state``: arguments that hand a recurrent state in or ask for it out (a cache: refused when set).
    """

    heads: dict[str, str]
    output: str
    head_count: tuple[str, int]
    grouped: dict[str, str] = field(default_factory=dict)
    group_count: tuple[str, int] | None = None
    weights: tuple[str, ...] = ()
    no_state: tuple[str, ...] = ()
    returns_state: bool = False
    """The kernel returns ``(output, state)``; the state is ``None`` when none is asked for."""


KERNELS: dict[str, KernelSpec] = {
    # depthwise causal convolution over [B, C, N], one channel per head (LFM2, Mamba's x|B|C, DeltaNet's q|k|v)
    "causal_conv1d_fn": KernelSpec(
        heads={"hidden_states": "BHN"},
        output="BHN",
        head_count=("hidden_states", 1),
        weights=("weight", "bias"),
    ),
    # Mamba2's chunked SSD scan: x [B, N, H, P], dt [B, N, H]; B, C [B, N, G, S] shared by H / G heads
    "mamba2_chunk_scan": KernelSpec(
        heads={"hidden_states": "BNHD", "dt": "BNH", "z": "BNHD"},
        output="BNHD",
        head_count=("hidden_states", 2),
        grouped={"B": "BNHD", "C": "BNHD"},
        group_count=("B", 2),
        weights=("A", "D", "dt_bias"),
        no_state=("initial_states", "return_final_states"),
    ),
    # Mamba's selective scan: x, dt, z [B, I, N], one channel per head; B, C [B, S, N] shared by every channel
    "mamba_selective_scan": KernelSpec(
        heads={"hidden_states": "BHN", "dt": "BHN", "z": "BHN"},
        output="BHN",
        head_count=("hidden_states", 1),
        grouped={"B": "BDN", "C": "BDN"},
        weights=("A", "D", "delta_bias"),
        no_state=("return_last_state",),
    ),
    # gated delta rule: q, k [B, N, H_k, D_k] shared by H_v / H_k value heads; v [B, N, H_v, D_v]; g, beta [B, N, H_v]
    "torch_chunk_gated_delta_rule": KernelSpec(
        heads={"value": "BNHD", "g": "BNH", "beta": "BNH"},
        output="BNHD",
        head_count=("value", 2),
        grouped={"query": "BNHD", "key": "BNHD"},
        group_count=("key", 2),
        no_state=("initial_state", "output_final_state"),
        returns_state=True,
    ),
    # Kimi delta attention (Kimi-Linear, Bailing hybrid): q, k, v [B, N, H, D], a decay per head and key channel
    # g [B, N, H, D_k], beta [B, N, H]
    "chunk_kimi_delta_attention": KernelSpec(
        heads={"query": "BNHD", "key": "BNHD", "value": "BNHD", "g": "BNHD", "beta": "BNH"},
        output="BNHD",
        head_count=("value", 2),
        no_state=("initial_state", "output_final_state"),
        returns_state=True,
    ),
    # RWKV's WKV: key, value [B, N, C], one decay and one bonus per channel (time_decay, time_first [C])
    "rwkv_linear_attention": KernelSpec(
        heads={"key": "BNH", "value": "BNH"},
        output="BNH",
        head_count=("key", 2),
        weights=("time_decay", "time_first"),
        no_state=("state", "return_state"),
        returns_state=True,
    ),
}


FUSED_LAYER_KERNELS = ("mamba2_split_conv1d_scan_combined", "mamba_inner_fn")
"""Kernels that compute a whole Mamba / Mamba2 layer at once (projection, convolution, scan, out-projection), which
the layer calls first in training when ``mamba_ssm`` is installed; their torch fallback returns ``None`` and the
layer then runs its separate kernels. Under sequence parallelism they would see this rank's shard alone, so their
sharded form returns ``None``: the layer takes the separate, sharded kernels (the set-up check reaches this
training-only branch only in its gradient probe, with sequence parallelism disabled: the whole sequence, exact)."""


def _no_fused_layer(*args: Any, **kwargs: Any) -> None:
    return None


def sharded_kernel(
    name: str,
    kernel: Callable[..., Any],
    group: Callable[[], SequenceParallelGroups],
    documents: Callable[[], Documents | None],
) -> Callable[..., Any]:
    """``kernel`` (the function transformers calls as ``name``) taking this rank's shard of the sequence; ``group``
    and ``documents`` give, at call time, the SP group and the documents of the whole rows."""
    if name in FUSED_LAYER_KERNELS:
        return _no_fused_layer
    spec = KERNELS[name]
    signature = inspect.signature(kernel)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        extra = arguments.pop(next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), ""), {})
        packed = [key for key in ("cu_seqlens", "seq_idx") if extra.get(key) is not None]
        state = [key for key in spec.no_state if arguments.get(key) not in (None, False)]
        if packed or state:
            raise ValueError(
                f"{name} under sequence parallelism takes neither a recurrent state nor packed-sequence offsets "
                f"(got {', '.join(packed + state)}): lightning-ulysses reads the documents from the position ids "
                "and trains without a cache."
            )
        extra = {key: value for key, value in extra.items() if value is not None}
        core = ShardedCore(group(), *_head_counts(spec, arguments), documents())
        layouts = {
            key: layout
            for streams in (spec.heads, spec.grouped)
            for key, layout in streams.items()
            if isinstance(arguments.get(key), Tensor)
        }
        streams = [core.scatter(_TO_CORE[layouts[key]](arguments[key]), key in spec.grouped) for key in layouts]
        for key in spec.weights:
            if isinstance(arguments.get(key), Tensor):
                arguments[key] = core.local(arguments[key])

        def on_rows(*rows: Tensor) -> tuple[Tensor, None]:  # [b, n, h, D] streams, whole rows or documents
            for key, row in zip(layouts, rows):
                arguments[key] = _FROM_CORE[layouts[key]](row)
            result = kernel(**arguments, **extra)
            return _TO_CORE[spec.output](result[0] if spec.returns_state else result), None

        output = _FROM_CORE[spec.output](core.gather(core.run(on_rows, *streams)[0]))
        return (output, None) if spec.returns_state else output

    return call


def _head_counts(spec: KernelSpec, arguments: dict[str, Any]) -> tuple[int, int]:
    """``(heads, groups)`` of one call: the groups are the heads themselves when nothing is shared, one when the
    shared inputs have no head axis (Mamba's B and C)."""
    heads = arguments[spec.head_count[0]].shape[spec.head_count[1]]
    if not spec.grouped:
        return heads, heads
    if spec.group_count is None:
        return heads, 1
    return heads, arguments[spec.group_count[0]].shape[spec.group_count[1]]
