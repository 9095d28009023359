"""Head chunks with the projections inside (:mod:`lightning_ulysses.hf.projections`), in one process.

The chunks of an attention module, each with its projections narrowed to the chunk's heads (as two ranks' layout
routes them), sum to the module's output and gradients; a chunked layer keeps only its inputs for the backward; the
set-up check's step keeps attention-only chunks where a head's output depends on other heads, where the chunks write
other key-value states into the module's arguments than the module does (Gemma 3n's and Gemma 4's KV-sharing layers)
and where the module draws random numbers outside its attention kernel (Starcoder2's residual dropout). Training at
sp=2 with the KV-sharing models and the residual dropout's draws under SP are here too (one launch); training at sp=2
and 4 with the other cases (ZeRO 1-3, packed documents, windows, GQA with replicated K/V, ring) is in
``test_attention_training.py``, ``test_equivalence.py``, ``test_memory.py`` and ``test_ring_training.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import GPTJForCausalLM

from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.heads import plan_heads
from lightning_ulysses.hf import apply_ulysses_attention
from lightning_ulysses.hf.apply import Patch
from lightning_ulysses.hf.check import probe_ids
from lightning_ulysses.hf.check.projections import projection_chunks_of
from lightning_ulysses.hf.check.whole import whole_sequence_run
from lightning_ulysses.hf.plan import ProjectionChunks
from lightning_ulysses.hf.projections import chunked_call, find_projections
from lightning_ulysses.hf.state import PatchState
from lightning_ulysses.memory import checkpoint_activations
from lightning_ulysses.offload import ActivationOffload
from lightning_ulysses.sharding import prepare_batch, shard_batch
from lightning_ulysses.topology import SequenceParallelTopology
from tests.cases import CaseTable
from tests.test_attention_training import _check
from tests.test_offload import RecordingStreams
from tests.tiny import make_samples, projected_layers, tiny_llama

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


@pytest.mark.parametrize(("offload", "runs"), [("device", 2), (False, 3), (True, 3)])
def test_a_checkpointed_layer_recomputes_each_chunk_once_where_offloaded(offload: Any, runs: int) -> None:
    """In a layer checkpointed by checkpoint_activations with its activations offloaded off the device ("device": CPU
    tensors playing device ones), the layer's recomputation takes the chunks' sum its forward kept: each chunk's
    projections run in the forward and once more for its backward (2 x chunks calls, 3 x before). Kept on the device
    (no offload; offload on CPU, which moves nothing) it would add to the peak: the recomputation runs them again.
    Gradients equal the same layer's unchekpointed, with attention dropout in the chunks and a dropout after them
    (the recomputation draws what the forward drew)."""
    model = tiny_llama(**dict(MODEL, attention_dropout=0.3)).train()
    attention, kwargs = _layer_call(model, tokens=12)
    hidden = kwargs.pop("hidden_states")
    chunks, layout = 2, plan_heads(8, 4, SP)
    spec = _spec(attention, chunks)
    calls: list[int] = []
    attention.q_proj.register_forward_hook(lambda module, args, out: calls.append(1))
    offloading = ActivationOffload(RecordingStreams()) if offload == "device" else offload

    def layer(x: Tensor) -> Tensor:
        out = chunked_call(attention, spec, layout, attention.forward, (x * 2,), kwargs)[0]
        return torch.nn.functional.dropout(out, 0.5) + x

    def step(checkpointed: bool) -> list[Tensor]:
        x = hidden.clone().requires_grad_()
        torch.manual_seed(3)
        out = checkpoint_activations(layer, x, offload=offloading) if checkpointed else layer(x)
        out.pow(2).sum().backward()
        grads = [x.grad, *(p.grad for p in attention.parameters())]
        attention.zero_grad(set_to_none=True)
        return [out.detach(), *grads]

    expected = step(checkpointed=False)
    calls.clear()
    got = step(checkpointed=True)
    assert len(calls) == runs * chunks
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def _whole_run(model: nn.Module) -> Any:
    state = PatchState(SequenceParallelGroups.of(None), "sdpa", 1, head_chunks=2)
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


# 6 layers, the last 2 reusing the key-value states that layers 2 (sliding) and 3 (full) store; 4 K/V heads, so that
# on two ranks each chunk of head_chunks=2 makes 2 of them (with 2 K/V heads every chunk would make both)
KV_SHARING = dict(
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    num_kv_shared_layers=2,
    layer_types=["sliding_attention", "full_attention"] * 3,
    sliding_window=5,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=61,
)
GEMMA3N = dict(KV_SHARING, model_type="gemma3n_text", laurel_rank=8, activation_sparsity_pattern=[0.0] * 6)
GEMMA4 = dict(KV_SHARING, model_type="gemma4_text", global_head_dim=16)  # full layers' heads of 16
NEITHER_STORES_NOR_REUSES = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
# residual dropout applied to the output projection's result (p = 0.5), no other dropout
STARCODER2 = dict(model_type="starcoder2", residual_dropout=0.5, attention_dropout=0.0, embedding_dropout=0.0)
SEED_OSS = dict(model_type="seed_oss", residual_dropout=0.5, attention_dropout=0.0, head_dim=8)
GPTJ = dict(
    model_type="gptj", resid_pdrop=0.5, attn_pdrop=0.0, embd_pdrop=0.0, rotary_dim=4, bos_token_id=0, eos_token_id=0
)


def test_the_check_keeps_attention_only_chunks_where_chunks_write_other_shared_states() -> None:
    """Gemma 3n's layers 2 and 3 store their key and value heads for layers 4 and 5, which a call per chunk would
    overwrite with the last chunk's heads: they keep attention-only chunks (layers 4 and 5 have no key projection), and
    the check writes nothing into the arguments the whole-sequence run recorded."""
    model = tiny_llama(**GEMMA3N)
    state, whole = _whole_run(model)
    stored = whole.calls["model.layers.2.self_attn"][0].kwargs["shared_kv_states"]
    before = {name: [t.clone() for t in states] for name, states in stored.items()}
    projected = [
        name
        for name, module in model.named_modules()
        if name.endswith("self_attn") and projection_chunks_of(module, name, whole, state, SP) is not None
    ]
    assert projected == NEITHER_STORES_NOR_REUSES
    assert stored.keys() == before.keys()
    for name, states in stored.items():
        assert all(torch.equal(t, b) for t, b in zip(states, before[name], strict=True)), name


@pytest.mark.parametrize(
    ("model", "dropout"),
    [
        pytest.param(STARCODER2, "residual_dropout", id="starcoder2"),
        pytest.param(SEED_OSS, "residual_dropout", id="seed_oss"),
        pytest.param(
            GPTJ,
            "resid_pdrop",
            id="gptj",
            marks=pytest.mark.skipif(
                not GPTJForCausalLM._supports_attention_backend,
                reason="this transformers' GPT-J has no attention interface (5.17's: eager attention only)",
            ),
        ),
    ],
)
def test_the_check_keeps_attention_only_chunks_where_the_module_draws_outside_attention(
    model: dict[str, Any], dropout: str
) -> None:
    """Dropout on the output projection's result (Starcoder2's and Seed-OSS's residual dropout, GPT-J's resid_pdrop)
    would drop each chunk's partial sum with a mask of its own: with it no layer runs its projections in chunks,
    without it both do. The check leaves the modules' eval mode and the random number generator's state as they
    were."""
    for p, expected in ((0.5, 0), (0.0, 2)):
        tiny = tiny_llama(**dict(model, **{dropout: p}))
        state, whole = _whole_run(tiny)
        rng = torch.get_rng_state()
        projected = [
            name
            for name, module in tiny.named_modules()
            if name in whole.heads and projection_chunks_of(module, name, whole, state, SP) is not None
        ]
        assert len(whole.heads) == 2 and len(projected) == expected, (p, projected)
        assert torch.equal(torch.get_rng_state(), rng)
        assert not any(module.training for module in tiny.modules())


SEQ = 24  # test_attention_training's


def every_parameter_partitioned() -> dict[str, Any]:
    """A ZeRO-3 config under which no parameter stays gathered once fetched (the tiny models' all fall below ZeRO-3's
    default persistence threshold); a new dict per case, as Lightning completes it in place."""
    return {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }


TRAINING = CaseTable(
    "projection_training_results",
    "tests.test_attention_training:fit_case",
    2,
    {
        "sp2_gemma3n_kv_sharing_head_chunks2": dict(
            sp=2, stage=1, model=GEMMA3N, strategy=dict(head_chunks=2), projected=True
        ),
        "sp2_gemma3n_kv_sharing_head_chunks_auto": dict(
            sp=2, stage=2, model=GEMMA3N, strategy=dict(head_chunks="auto"), projected=True
        ),
        # Gemma 3n's decoder layer reads AltUp's correct_output_scale outside AltUp's call (and, in training,
        # correction_coefs.weight outside that linear layer's): the set-up check's calls of the model must find them
        # as DeepSpeed's engine does in a step
        "sp2_gemma3n_kv_sharing_zero3_head_chunks2": dict(
            sp=2,
            stage=3,
            model=GEMMA3N,
            strategy=dict(head_chunks=2, config=every_parameter_partitioned()),
            projected=True,
        ),
        "sp2_gemma4_kv_sharing_head_chunks2": dict(
            sp=2,
            stage=3,
            model=GEMMA4,
            strategy=dict(head_chunks=2, config=every_parameter_partitioned()),
            projected=True,
        ),
    },
    also={"residual_dropout": "tests.test_projections:residual_dropout_draws"},
)
projection_training_results = TRAINING.fixture()


@pytest.mark.distributed
@TRAINING.each_case
def test_kv_sharing_models_with_head_chunks_equal_one_process(
    projection_training_results: list[dict[str, Any]], name: str
) -> None:
    """Gemma 3n and Gemma 4 with KV-sharing layers, with head chunks, train as one process of the plain model does
    (loss and update), under ZeRO 1, 2 and 3 (every parameter partitioned); only the layers that neither store nor
    reuse key-value states run their projections in the chunks."""
    _check(projection_training_results, name, TRAINING.cases[name])
    for rank in projection_training_results:
        assert rank[name]["projected"] == NEITHER_STORES_NOR_REUSES


def residual_dropout_draws(world_size: int) -> dict[str, Any]:
    """Layer 0's attention output of Starcoder2 with residual dropout, patched with ``head_chunks=2`` on the world,
    on this rank's shard: in eval mode, and in training mode (seeded); the layers that run their projections in
    chunks."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = tiny_llama(**STARCODER2)
    world = SequenceParallelGroups.create(SequenceParallelTopology(world_size, world_size, dist.get_rank()), "cpu")
    apply_ulysses_attention(model, world, "sdpa", head_chunks=2)
    batch = prepare_batch({"input_ids": torch.stack([s["input_ids"] for s in make_samples(4, SEQ)])}, world_size)
    batch = shard_batch(batch, dist.get_rank(), world_size)
    outputs: list[Tensor] = []
    model.model.layers[0].self_attn.register_forward_hook(lambda module, args, out: outputs.append(out[0].detach()))
    torch.manual_seed(dist.get_rank())
    for training in (False, True):
        model.train(training)
        with torch.no_grad():
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    return {"projected": projected_layers(model), "eval": outputs[0], "train": outputs[1]}


@pytest.mark.distributed
def test_residual_dropout_under_head_chunks_drops_the_summed_output(
    projection_training_results: list[dict[str, Any]],
) -> None:
    """With head chunks under SP, Starcoder2's attention output in training mode is, element by element, either 0 or
    the eval output scaled by 1 / (1 - p), as one dropout on the summed output gives (each chunk's partial sum dropped
    on its own gives neither for about half of them), and keeps about 1 - p of them."""
    p = STARCODER2["residual_dropout"]
    for rank in projection_training_results:
        draws = rank["residual_dropout"]
        assert draws["projected"] == []
        y, z = draws["eval"], draws["train"]
        dropped = z == 0
        kept = torch.isclose(z, y / (1 - p), rtol=1e-5, atol=1e-6)
        assert bool((dropped | kept).all()), f"{(~(dropped | kept)).float().mean():.2f} neither dropped nor kept"
        assert 0.45 < kept.float().mean().item() < 0.55  # about 1 500 elements per rank, seeded
