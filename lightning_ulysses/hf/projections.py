"""Head chunks with the projections inside: an attention module run once per chunk of its heads.

``head_chunks`` alone (:mod:`lightning_ulysses.attention.head_chunks`) cuts the attention into chunks of heads, but
the layer's query, key and value projections still make every head's ``[B, N/P, H, D]`` shard, which the layer keeps
for its backward next to their gradients. Where a transformers attention module computes each head from its own rows
of the projections, this runs the module's own forward once per chunk instead::

    chunk j:  q_proj, k_proj, v_proj narrowed to the rows of the chunk's heads    [B, N/P, C] -> [B, N/P, P * h_j * D]
              the module's own forward (RoPE, q/k norms per head, gates)          P * h_j query, P * kv_j K/V heads
              plain Ulysses attention of those heads (rank r attends the chunk's heads r * h_j ... (r + 1) * h_j - 1)
              o_proj narrowed to their columns (its bias in chunk 0 only)          -> [B, N/P, C], summed over chunks

Each chunk is one checkpoint region (recomputed in the backward), so the layer keeps only its inputs, and the
projections' outputs, the whole-sequence tensors and their gradients exist for one chunk at a time. In a layer
checkpointed by :func:`~lightning_ulysses.memory.checkpoint_activations` with its activations offloaded off the
device, the layer's recomputation takes the chunks' sum its forward kept instead of running them again
(:mod:`lightning_ulysses.replay`): each chunk runs in the forward and once more, for its backward. Elsewhere a
checkpointed layer runs each chunk three times, its attention kernel's forward included: in the forward, in the
layer's recomputation (the operations after the chunks saved their sum) and in the chunk's own recomputation (its
backward needs the attention's output, which nothing keeps: keeping the layer's chunk outputs from its
recomputation to its chunks' backward would spare the third kernel forward but add a hidden-state tensor to the peak,
docs/benchmarks/chunk_cost.md). The chunk's heads are the ones
:func:`~lightning_ulysses.attention.head_chunks.chunk_heads` routes: every rank of the group computes the same
chunks, and the all-to-all inside hands each rank the chunk's slots of the full layout.

Which modules run so is decided by behaviour: the set-up check (:mod:`lightning_ulysses.hf.check.projections`) calls
each candidate this way and keeps it only where the chunks sum to the module's own output, write into its arguments what
the module writes (key-value states shared with later layers are not), and the module draws no random numbers outside
its attention kernel (a dropout after the output projection would drop each chunk's partial sum on its own); the rest
keep attention-only chunks. Narrowing reads the weights inside the projections' own calls (``index_select`` on the
parameter, so its gradient reaches the whole weight, and ZeRO-3's hooks have gathered it). Per-head parameters of the
module's own (attention sinks, ``[heads]``) are narrowed to the chunk's query heads; the module reads them outside any
call of its own in a chunk's recomputation, so under ZeRO-3, which partitions them, such a module is not chunked so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from lightning_ulysses.attention.head_chunks import chunk_heads
from lightning_ulysses.heads import HeadLayout, plan_heads
from lightning_ulysses.hf.plan import ProjectionChunks
from lightning_ulysses.hf.state import PatchState
from lightning_ulysses.replay import kept_for_replay
from lightning_ulysses.tiling import recomputed_in_backward

PROJECTION_NAMES = {
    "query": ("q_proj", "query"),
    "key": ("k_proj", "key"),
    "value": ("v_proj", "value"),
    "output": ("o_proj", "out_proj", "dense", "o"),
}
"""The child names a query, key, value and output projection go by in transformers' attention modules."""

HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_key_value_groups")
"""Head counts a module may read in its forward: set per chunk."""

WIDTHS = ("embed_dim", "hidden_size", "all_head_size")
"""Widths a module may reshape its heads' output to: set per chunk where they are the heads' output width."""


def find_projections(
    module: nn.Module, heads: int, kv_heads: int, qk_dim: int, value_dim: int, chunks: int
) -> ProjectionChunks | str:
    """``module``'s projections as a :class:`ProjectionChunks` of ``chunks``, given the head shapes it passed to
    attention; or why it has none that narrow per head (the chunked call is still to be compared by the caller)."""
    own = dict(module.named_parameters(recurse=False))
    other = [name for name, p in own.items() if tuple(getattr(p, "ds_shape", p.shape))[:1] != (heads,)]  # ZeRO-3
    if other:
        return f"holds parameters of its own that are not one per head ({', '.join(other)})"
    # read by its forward in each chunk, outside the module's own call, where ZeRO-3 has not gathered them
    partitioned = [name for name, p in own.items() if hasattr(p, "ds_id")]
    if partitioned:
        return f"holds parameters of its own ({', '.join(partitioned)}) that ZeRO-3 partitions"
    children = dict(module.named_children())
    found: dict[str, str] = {}
    for role, names in PROJECTION_NAMES.items():
        name = next((name for name in names if isinstance(children.get(name), nn.Linear)), None)
        if name is None:
            return f"has no nn.Linear {role} projection (fused or latent projections, or adapters)"
        found[role] = name
    features = {role: cast(nn.Linear, children[name]) for role, name in found.items()}
    for role, linear in features.items():  # narrowed, a projection computes nn.Linear's forward on its rows
        if type(linear).forward is not nn.Linear.forward:
            return f"its {role} projection is a {type(linear).__name__} with a forward of its own"
    expected = {"query": heads * qk_dim, "key": kv_heads * qk_dim, "value": kv_heads * value_dim}
    for role, width in expected.items():
        if features[role].out_features != width:
            return f"its {role} projection has {features[role].out_features} outputs, not one row block per head"
    if features["output"].in_features != heads * value_dim:
        return f"its output projection reads {features['output'].in_features} features, not its heads' outputs"
    gates = tuple(
        (name, child.out_features // heads)
        for name, child in children.items()
        if name not in found.values()
        and isinstance(child, nn.Linear)
        and type(child).forward is nn.Linear.forward
        and child.out_features in (heads * qk_dim, heads * value_dim, heads)
    )
    return ProjectionChunks(
        chunks,
        found["query"],
        found["key"],
        found["value"],
        found["output"],
        gates,
        tuple(own),
        heads,
        kv_heads,
        qk_dim,
        value_dim,
    )


def chunked_call(
    module: nn.Module,
    spec: ProjectionChunks,
    layout: HeadLayout,
    forward: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
) -> Any:
    """``forward(*args, **kwargs)`` of the attention ``module``, computed as the sum of its chunks (see the module
    docstring), each a checkpoint region when autograd records. ``layout``: the heads over the Ulysses group."""
    # a checkpoint saves its positional tensors through autograd (an enclosing checkpoint drops them) but holds its
    # other arguments as they are: every tensor of the call goes positionally
    leaves, tree = tree_flatten((args, kwargs))
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
    skeleton = [None if isinstance(leaf, Tensor) else leaf for leaf in leaves]
    values = [leaves[i] for i in tensors]
    heads = chunk_heads(layout, spec.chunks)

    def compute() -> Any:
        total: Tensor | None = None
        tail: tuple | None = None  # the module's other outputs (attention weights: None), from the last chunk
        for index, (query_heads, kv_heads) in enumerate(heads):
            chunk = functools.partial(
                _chunk, module, spec, query_heads, kv_heads, index == 0, forward, skeleton, tensors, tree
            )
            out = recomputed_in_backward(chunk)(*values)
            first, tail = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
            total = first if total is None else total + first
        return total if tail is None else (total, *tail)

    def replay(result: Any) -> Any:  # each chunk's checkpoint saves its inputs through the layer's
        for _ in heads:
            recomputed_in_backward(_nothing)(*values)
        return result

    # in a checkpointed layer's recomputation the sum its forward kept where it did (offloaded activations)
    return kept_for_replay(compute, replay)


def _nothing(*values: Tensor) -> None:
    return None


def _chunk(
    module: nn.Module,
    spec: ProjectionChunks,
    query_heads: tuple[int, ...],
    kv_heads: tuple[int, ...],
    first: bool,
    forward: Callable[..., Any],
    skeleton: list[Any],
    tensors: list[int],
    tree: TreeSpec,
    *values: Tensor,
) -> Any:
    leaves = list(skeleton)
    for i, value in zip(tensors, values, strict=True):
        leaves[i] = value
    args, kwargs = tree_unflatten(leaves, tree)
    with narrowed(module, spec, query_heads, kv_heads, first):
        return forward(*args, **kwargs)


@contextmanager
def narrowed(
    module: nn.Module, spec: ProjectionChunks, query_heads: tuple[int, ...], kv_heads: tuple[int, ...], first: bool
) -> Iterator[None]:
    """Within the block, ``module`` computes only ``query_heads`` (and their ``kv_heads``): its projections and gates
    narrowed, its head counts and output width set to the chunk's; the output projection's bias only if ``first``."""
    device = _linear(module, spec.query).weight.device
    narrowing = [
        (spec.query, _linear_rows(_rows(query_heads, spec.qk_dim, device))),
        (spec.key, _linear_rows(_rows(kv_heads, spec.qk_dim, device))),
        (spec.value, _linear_rows(_rows(kv_heads, spec.value_dim, device))),
        (spec.output, _linear_columns(_rows(query_heads, spec.value_dim, device), first)),
        *((name, _linear_rows(_rows(query_heads, per_head, device))) for name, per_head in spec.gates),
    ]
    with ExitStack() as stack:
        for name, forward in narrowing:
            stack.enter_context(_forward(_linear(module, name), forward))
        heads, kv = len(query_heads), len(kv_heads)
        counts = dict(zip(HEAD_COUNTS, (heads, heads, kv, heads // kv), strict=True))
        counts |= {
            name: heads * spec.value_dim
            for name in WIDTHS
            if getattr(module, name, None) == spec.heads * spec.value_dim
        }
        stack.enter_context(_attributes(module, {k: v for k, v in counts.items() if hasattr(module, k)}))
        query_index = _rows(query_heads, 1, device)
        for name in spec.per_head:  # an instance attribute is found before the registered parameter
            stack.enter_context(_attributes(module, {name: getattr(module, name).index_select(0, query_index)}))
        yield


def _linear(module: nn.Module, name: str) -> nn.Linear:
    return cast(nn.Linear, getattr(module, name))


@functools.lru_cache(maxsize=1024)
def _rows(heads: tuple[int, ...], width: int, device: torch.device) -> Tensor:
    """The rows (or columns) of ``heads`` in a weight laid out head by head, ``width`` each, in order."""
    index = torch.tensor(heads, dtype=torch.long).mul(width).unsqueeze(1) + torch.arange(width)
    return index.flatten().to(device)


def _linear_rows(rows: Tensor) -> Callable[[nn.Linear, Tensor], Tensor]:
    def forward(linear: nn.Linear, x: Tensor) -> Tensor:
        bias = None if linear.bias is None else linear.bias.index_select(0, rows)
        return F.linear(x, linear.weight.index_select(0, rows), bias)

    return forward


def _linear_columns(columns: Tensor, bias: bool) -> Callable[[nn.Linear, Tensor], Tensor]:
    def forward(linear: nn.Linear, x: Tensor) -> Tensor:
        return F.linear(x, linear.weight.index_select(1, columns), linear.bias if bias else None)

    return forward


@contextmanager
def _forward(linear: nn.Linear, forward: Callable[[nn.Linear, Tensor], Tensor]) -> Iterator[None]:
    """``linear`` computes ``forward(linear, x)`` in the block: called as a module, so that its hooks (ZeRO-3's
    gathering of the weight) still run around it."""
    saved = linear.__dict__.get("forward")
    setattr(linear, "forward", functools.partial(forward, linear))  # noqa: B010 - an instance's method
    try:
        yield
    finally:
        if saved is None:
            del linear.forward
        else:
            setattr(linear, "forward", saved)  # noqa: B010


@contextmanager
def _attributes(module: nn.Module, values: dict[str, Any]) -> Iterator[None]:
    """``module``'s instance attributes set to ``values`` in the block (a parameter's name shadowed by a tensor)."""
    saved = {name: module.__dict__[name] for name in values if name in module.__dict__}
    try:
        module.__dict__.update(values)
        yield
    finally:
        for name in values:
            if name in saved:
                module.__dict__[name] = saved[name]
            else:
                del module.__dict__[name]


def projected_forward(module: nn.Module, spec: ProjectionChunks, state: PatchState) -> Callable[..., Any]:
    """The forward of an attention ``module`` planned with ``spec``: chunked under sequence parallelism, its own
    otherwise (unpatched, or sequence parallelism disabled)."""
    own = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not state.enabled or state.sp_size == 1:
            return own(*args, **kwargs)
        layout = plan_heads(spec.heads, spec.kv_heads, state.group.topology.ulysses_size)  # the heads' all-to-all group
        return chunked_call(module, spec, layout, own, args, kwargs)

    return forward
