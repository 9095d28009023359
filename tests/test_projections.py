"""Head chunks with the projections inside (:mod:`lightning_ulysses.hf.projections`), in one process.

The chunks of an attention module, each with its projections narrowed to the chunk's heads (as two ranks' layout
routes them), sum to the module's output and gradients; a chunked layer keeps only its inputs for the backward; the
set-up check's step keeps attention-only chunks where a head's output depends on other heads. Training at sp=2 and 4
with them (ZeRO 1-3, packed documents, windows, GQA with replicated K/V, ring) is in ``test_attention_training.py``,
``test_equivalence.py``, ``test_memory.py`` and ``test_ring_training.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_ulysses.heads import plan_heads
from lightning_ulysses.hf.apply import Patch
from lightning_ulysses.hf.check import probe_ids
from lightning_ulysses.hf.check.projections import projection_chunks_of
from lightning_ulysses.hf.check.whole import whole_sequence_run
from lightning_ulysses.hf.plan import ProjectionChunks
from lightning_ulysses.hf.projections import chunked_call, find_projections
from lightning_ulysses.hf.state import PatchState
from tests.tiny import tiny_llama

# head_dim 16 against hidden / heads = 6: the output projection reads 128 features from a hidden size of 48
MODEL = dict(hidden_size=48, num_attention_heads=8, num_key_value_heads=4, head_dim=16, attn_implementation="eager")
SP = 2


def _layer_call(model: nn.Module, tokens: int = 10) -> tuple[nn.Module, dict[str, Any]]:
    """Layer 0's attention module and the keyword arguments the decoder layer calls it with."""
    attention = model.model.layers[0].self_attn
    hidden = torch.randn(1, tokens, MODEL["hidden_size"], generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(tokens)[None]
    cos, sin = model.model.rotary_emb(hidden, position_ids)
    return attention, dict(hidden_states=hidden, position_embeddings=(cos, sin), attention_mask=None)


def _spec(attention: nn.Module, chunks: int) -> ProjectionChunks:
    spec = find_projections(attention, 8, 4, 16, 16, chunks)
    assert isinstance(spec, ProjectionChunks), spec
    return spec


def test_chunks_sum_to_the_module_and_its_gradients() -> None:
    """One chunk of every head, chunks of whole K/V groups (2 of 4 slots per rank) and of one query slot per rank (4,
    each K/V head computed in both chunks of its two query heads): output, input gradient and every weight's gradient
    equal the whole module's."""
    model = tiny_llama(**MODEL)
    attention, kwargs = _layer_call(model)
    hidden = kwargs.pop("hidden_states").requires_grad_()
    whole = attention(hidden, **kwargs)[0]
    grad_out = torch.randn_like(whole)
    expected = torch.autograd.grad(whole, [hidden, *attention.parameters()], grad_out)
    layout = plan_heads(8, 4, SP)
    for chunks in (1, 2, 4):
        out = chunked_call(attention, _spec(attention, chunks), layout, attention.forward, (hidden,), kwargs)[0]
        torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
        got = torch.autograd.grad(out, [hidden, *attention.parameters()], grad_out)
        for g, e, name in zip(got, expected, ["hidden", *(n for n, _ in attention.named_parameters())], strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=f"{chunks} chunks: {name}")


def test_a_chunked_layer_keeps_only_its_inputs() -> None:
    """What autograd saves across the chunked call is its inputs (hidden states, cos, sin), nothing the projections
    made: the chunks are recomputed in the backward."""
    model = tiny_llama(**MODEL)
    attention, kwargs = _layer_call(model, tokens=12)
    hidden = kwargs.pop("hidden_states").requires_grad_()
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = chunked_call(attention, _spec(attention, 2), plan_heads(8, 4, SP), attention.forward, (hidden,), kwargs)
    inputs = {hidden.data_ptr(), *(t.data_ptr() for t in kwargs["position_embeddings"])}
    assert saved and {t.data_ptr() for t in saved if t.numel()} <= inputs, [tuple(t.shape) for t in saved]
    out[0].sum().backward()
    assert hidden.grad is not None and all(p.grad is not None for p in attention.parameters())


def _whole_run(model: nn.Module) -> Any:
    state = PatchState(None, "sdpa", 1, head_chunks=2)
    Patch(model, state)
    ids = probe_ids(model, 22, torch.device("cpu"))
    model.eval()
    with torch.no_grad():
        findings, whole = whole_sequence_run(model, state, ids, torch.arange(22).expand_as(ids))
    assert not findings
    return state, whole


def test_the_check_keeps_attention_only_chunks_where_heads_mix() -> None:
    """Layer 0's queries centred over all heads' features (a norm over every head without a weight, which no shape
    gives away) differ in chunks, so only layer 1 runs its projections in them; a projection with a forward of its own
    is not narrowed at all."""
    model = tiny_llama(**dict(MODEL, attn_implementation="sdpa"))
    layers = model.model.layers
    layers[0].self_attn.q_proj.register_forward_hook(lambda m, args, out: out - out.mean(-1, keepdim=True))
    state, whole = _whole_run(model)
    verdicts = [
        projection_chunks_of(layer.self_attn, f"model.layers.{i}.self_attn", whole, state, SP)
        for i, layer in enumerate(layers)
    ]
    assert verdicts[0] is None and verdicts[1] == _spec(layers[1].self_attn, 2)

    class Scaled(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            return 2 * super().forward(x)

    attention = layers[1].self_attn
    attention.k_proj = Scaled(MODEL["hidden_size"], 64, bias=False)
    assert find_projections(attention, 8, 4, 16, 16, 2) == "its key projection is a Scaled with a forward of its own"
