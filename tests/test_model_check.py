"""The set-up check of a patched transformers model: exact or refused, decided by what the model does.

Single-process cases run the check at ``sp_size=1`` (mask-only windows, biases, attention arguments,
attention masks given to the model); the two-rank launch runs it at ``sp=2`` (token mixers outside
attention, length-dependent RoPE made exact, a module adding a loss of its own in the backward). "Exact" is always
against the plain, unpatched model on the whole sequence.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.masking_utils import chunked_causal_mask_function, sliding_window_causal_mask_function

from lightning_ulysses.attention import gather_sequence
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf import (
    ULYSSES_ATTN_IMPLEMENTATION,
    UnsupportedModelError,
    apply_ulysses_attention,
    remove_ulysses_attention,
    unpatched,
)
from lightning_ulysses.hf.interface import LayerPlan, read_layer_call
from lightning_ulysses.hf.masks import MaskPattern, identify_pattern
from lightning_ulysses.sharding import prepare_batch, shard_batch
from lightning_ulysses.topology import SequenceParallelTopology
from tests.launch import launch
from tests.tiny import AuxiliaryLossMoE
from tests.zoo_configs import tiny_recipe

pytestmark = pytest.mark.distributed

VOCAB = 97
SEQ = 40


def tiny_model(model_type: str, attn_implementation: str = "sdpa", **overrides: Any) -> PreTrainedModel:
    """A seeded fp32 model of ``model_type`` with small sizes, in eval mode (no dropout)."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    fields.update(overrides)
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **fields)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


def packed_ids_and_positions(seed: int = 1) -> tuple[Tensor, Tensor]:
    """``[2, SEQ]`` token ids; row 0 one document, row 1 two documents (positions restart at 17)."""
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(SEQ).repeat(2, 1)
    positions[1, 17:] -= 17
    return ids, positions


def plain_logits(model: PreTrainedModel, ids: Tensor, positions: Tensor) -> Tensor:
    """The unpatched model on whole rows, each document on its own (nothing can cross a document border)."""
    rows = []
    for row_ids, row_positions in zip(ids, positions):
        starts = [*(row_positions == 0).nonzero().flatten().tolist(), len(row_ids)]
        rows.append(torch.cat([model(input_ids=row_ids[None, a:b]).logits[0] for a, b in zip(starts, starts[1:])]))
    return torch.stack(rows)


def relative_error(got: Tensor, expected: Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


# ------------------------------------------------------------------------------------------------
# the mask pattern, read from transformers' mask functions
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("function", "local_size", "expected"),
    [
        (lambda b, h, q, kv: kv <= q, None, MaskPattern()),
        (sliding_window_causal_mask_function(131072), 131072, MaskPattern(window=131072)),
        (sliding_window_causal_mask_function(3), 3, MaskPattern(window=3)),
        (chunked_causal_mask_function(8192, torch.zeros(1, dtype=torch.long)), 8192, MaskPattern(chunk=8192)),
        (lambda b, h, q, kv: (kv <= q) & (kv % 2 == 0), None, None),  # a pattern no kernel here runs
        (lambda b, h, q, kv: (kv <= q) & (q - kv < 7), 5, None),  # a window other than the one announced
        (lambda b, h, q, kv: kv <= q, 0, MaskPattern()),  # a window of 0 announced: switched off, no window
    ],
)
def test_identify_pattern_reads_windows_and_chunks_far_beyond_the_probe(function, local_size, expected) -> None:
    q_idx, kv_idx = torch.arange(22)[:, None], torch.arange(22)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    mask = function(zero, zero, q_idx, kv_idx)[None, None]
    assert identify_pattern(mask, function, local_size, 0, 0, index_based=True) == expected


def module_attributes(model: PreTrainedModel, identities: bool = True) -> dict[str, Any]:
    """What a patch may change: every module's instance attributes and hooks and every config's attributes, by
    identity (``identities=False``: by name only, for a model whose own forward updates its caches)."""

    def entries(obj: Any) -> dict[str, Any]:
        return {
            key: (id(value) if identities else None, tuple(value) if isinstance(value, dict) else ())
            for key, value in vars(obj).items()
        }

    configs = [model.config, *(getattr(model.config, key) for key in model.config.sub_configs)]
    return {
        "modules": {name: entries(module) for name, module in model.named_modules()},
        "configs": [entries(config) for config in configs if config is not None],
    }


# ------------------------------------------------------------------------------------------------
# one process: what the attention layers ask for
# ------------------------------------------------------------------------------------------------
def _patched_logits(model: PreTrainedModel, ids: Tensor, positions: Tensor) -> Tensor:
    apply_ulysses_attention(model, group=None, attn_implementation="sdpa")
    return model(input_ids=ids, position_ids=positions).logits


def test_a_window_applied_only_through_the_mask_is_kept() -> None:
    # Qwen2-MoE passes no sliding_window to attention: the window lives in the mask transformers builds
    model = tiny_model(
        "qwen2_moe",
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    ids, positions = packed_ids_and_positions()
    expected = plain_logits(model, ids, positions)
    got = _patched_logits(model, ids, positions)
    windows = [layer.self_attn._ulysses_plan.pattern.window for layer in model.model.layers]
    assert windows == [5, None]
    assert relative_error(got, expected) < 1e-5
    remove_ulysses_attention(model)
    no_window = [m._ulysses_plan for m in model.modules() if "_ulysses_plan" in m.__dict__]
    assert no_window == []


def test_a_window_switched_off_is_no_window() -> None:
    # Qwen2-MoE with use_sliding_window=False holds sliding_window=0 and still builds a sliding mask of that window
    model = tiny_model(
        "qwen2_moe",
        use_sliding_window=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    assert model.config.sliding_window == 0
    ids, positions = packed_ids_and_positions()
    expected = plain_logits(model, ids, positions)
    got = _patched_logits(model, ids, positions)
    assert [layer.self_attn._ulysses_plan.pattern for layer in model.model.layers] == [MaskPattern(), MaskPattern()]
    assert relative_error(got, expected) < 1e-5
    plan, problems = read_layer_call(model.model.layers[0].self_attn, MaskPattern(), "", {"sliding_window": 0})
    assert (plan, problems) == (LayerPlan(MaskPattern()), [])  # as passed to attention by Mistral-style layers


def test_a_loss_of_its_own_in_the_backward_runs_at_sp_size_1() -> None:
    """One process per sequence computes the auxiliary loss from the whole sequence: exact, not refused (at ``sp=2``
    it is: :func:`test_token_mixers_and_local_indices_are_refused_on_every_rank`)."""
    model = _llama_with_an_auxiliary_loss()
    ids, positions = packed_ids_and_positions()
    expected = plain_logits(model, ids, positions)
    assert relative_error(_patched_logits(model, ids, positions), expected) < 1e-5


def test_a_bias_added_through_the_mask_is_refused_and_the_model_left_plain() -> None:
    model = tiny_model("doge")  # Doge adds a model-computed dynamic bias to the mask
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.self_attn \(DogeAttention\): adds a bias"):
        apply_ulysses_attention(model, group=None, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"
    assert not any("_ulysses_state" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(
    ("model_type", "overrides", "refusal"),
    [
        (
            "gemma2",
            dict(head_dim=8, attn_logit_softcapping=50.0, attn_implementation="eager"),
            r"Gemma2Attention\): passes softcap=50\.0",
        ),
        ("llama", dict(), None),
    ],
)
def test_attention_arguments_that_change_the_result_are_refused(model_type, overrides, refusal) -> None:
    model = tiny_model(model_type, **overrides)
    if refusal is None:
        apply_ulysses_attention(model, group=None, attn_implementation="sdpa")
        return
    with pytest.raises(UnsupportedModelError, match=refusal):
        apply_ulysses_attention(model, group=None, attn_implementation="sdpa")


GPT_OSS = dict(
    num_local_experts=4,
    num_experts_per_tok=2,
    head_dim=8,
    sliding_window=5,
    layer_types=["sliding_attention", "full_attention"],
    attn_implementation="eager",
)
LLAMA4 = dict(
    attention_chunk_size=6,
    num_local_experts=2,
    intermediate_size_mlp=48,
    head_dim=8,
    layer_types=["chunked_attention", "full_attention"],
    no_rope_layers=[1, 0],
)


@pytest.mark.parametrize(
    ("model_type", "overrides", "plans"),
    [
        ("gpt_oss", GPT_OSS, [(MaskPattern(window=5), True), (MaskPattern(), True)]),  # attention sinks
        ("llama4_text", LLAMA4, [(MaskPattern(chunk=6), False), (MaskPattern(), False)]),  # chunked attention
    ],
)
def test_sinks_and_chunks_run_exactly(model_type: str, overrides: dict[str, Any], plans: list[Any]) -> None:
    model = tiny_model(model_type, **overrides)
    ids, positions = packed_ids_and_positions()
    expected = plain_logits(model, ids, positions)
    got = _patched_logits(model, ids, positions)
    assert [
        (m._ulysses_plan.pattern, m._ulysses_plan.sinks) for m in model.modules() if "_ulysses_plan" in m.__dict__
    ] == plans
    assert relative_error(got, expected) < 1e-5


def test_a_bidirectional_attention_layer_is_refused() -> None:
    model = tiny_model("llama")
    model.model.layers[1].self_attn.is_causal = False
    with pytest.raises(
        UnsupportedModelError, match=r"layers\.1\.self_attn \(LlamaAttention\): attends bidirectionally"
    ):
        apply_ulysses_attention(model, group=None, attn_implementation="sdpa")


def test_head_counts_that_vary_per_layer_are_checked_not_crashed_on() -> None:
    # DOTS3's indexed-attention layers have half the heads of the others (a heterogeneous config, whose global head
    # count transformers refuses to read): the set-up check runs and refuses the indexed attention
    model = tiny_recipe("dots3_note").build("sdpa")
    heads = {layer.self_attn.num_heads for layer in model.model.layers}
    assert len(heads) == 2, heads
    with pytest.raises(UnsupportedModelError, match=r"Dots3NoteTextAttention\): passes indices"):
        apply_ulysses_attention(model, group=None, attn_implementation="sdpa")


def test_a_padding_mask_given_to_the_model_is_folded_or_refused() -> None:
    model = tiny_model("llama")
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    batch = prepare_batch({"input_ids": ids, "attention_mask": mask}, sp_size=1)
    apply_ulysses_attention(model, group=None, attn_implementation="sdpa")
    with_mask = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask).logits
    without = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    torch.testing.assert_close(with_mask, without, rtol=0, atol=0)
    with unpatched(model):
        plain = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert relative_error(with_mask[real], plain[real]) < 1e-5

    inside_a_document = torch.ones(2, 12, dtype=torch.long)
    inside_a_document[0, 4] = 0
    with pytest.raises(ValueError, match="masks tokens inside a document"):
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=inside_a_document)
    with pytest.raises(ValueError, match=r"attention_mask of shape \(2, 1, 12, 12\)"):
        model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool),
        )


def test_unpatched_runs_the_plain_model_and_restores_the_patch() -> None:
    model = tiny_model("mistral", sliding_window=5)
    ids, positions = packed_ids_and_positions()
    patched = _patched_logits(model, ids, positions)
    with unpatched(model):
        assert model.config._attn_implementation == "sdpa"
        # transformers masks packed documents (position ids that restart) only without a KV cache
        plain = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        per_document = plain_logits(model, ids, positions)
    assert model.config._attn_implementation == ULYSSES_ATTN_IMPLEMENTATION
    assert relative_error(patched, plain) < 1e-5
    assert relative_error(plain, per_document) < 1e-5


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("llama", dict()),
        ("lfm2", dict(layer_types=["conv", "full_attention"])),  # a token mixer run head-sharded
        (
            "qwen2_moe",
            dict(
                use_sliding_window=True,
                sliding_window=5,
                max_window_layers=1,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=16,
            ),
        ),
        ("doge", dict()),
    ],  # refused: the refusal undoes the patch
)
def test_remove_restores_the_model_exactly(model_type: str, overrides: dict[str, Any]) -> None:
    model = tiny_model(model_type, **overrides)
    ids, positions = packed_ids_and_positions()
    before = module_attributes(model)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    expected = model(input_ids=ids, position_ids=positions).logits
    assert module_attributes(model) == before
    try:
        _patched_logits(model, ids, positions)
    except UnsupportedModelError:
        assert model_type == "doge"
    else:
        assert module_attributes(model) != before
        remove_ulysses_attention(model)
    assert module_attributes(model) == before
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())
    torch.testing.assert_close(model(input_ids=ids, position_ids=positions).logits, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# two ranks: what only a split sequence shows
# ------------------------------------------------------------------------------------------------
class CausalCumulativeMean(nn.Module):
    """A user-written token mixer: each token becomes the running mean of the tokens up to it."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        counts = torch.arange(1, hidden_states.shape[1] + 1, device=hidden_states.device)[None, :, None]
        return hidden_states.cumsum(dim=1) / counts


class CausalConvolution(nn.Module):
    """A user-written causal convolution over the sequence that also returns its zero-padded output (a tail of
    ``K - 1`` tokens past the sequence): ``[B, N, C] -> ([B, N, C], [B, N + K - 1, C])``."""

    def __init__(self, channels: int, width: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, width, groups=channels, padding=width - 1)

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        padded = self.conv(hidden_states.transpose(1, 2)).transpose(1, 2)
        return padded[:, : hidden_states.shape[1]], padded


class FirstOutput(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.module(hidden_states)[0]


def _recurrent_gemma() -> PreTrainedModel:
    return tiny_model("recurrent_gemma", use_cache=False, attention_window_size=8)  # two recurrent (RG-LRU) layers


def _llama_with_a_mixer(mixer: type[nn.Module] = CausalCumulativeMean) -> PreTrainedModel:
    model = tiny_model("llama")
    torch.manual_seed(1)
    extra = FirstOutput(mixer(model.config.hidden_size)) if mixer is CausalConvolution else mixer()
    model.model.layers[1].mlp = nn.Sequential(model.model.layers[1].mlp, extra)
    return model


def _llama_with_a_convolution() -> PreTrainedModel:
    return _llama_with_a_mixer(CausalConvolution)


def _llama_with_an_auxiliary_loss() -> PreTrainedModel:
    """A checkpoint's Llama (``save_pretrained`` / ``from_pretrained``) whose layers run an MoE that, in training,
    adds DeepSeek-V2's load-balancing loss through the backward only (:class:`~tests.tiny.AuxiliaryLossMoE`)."""
    distributed = dist.is_initialized()
    with tempfile.TemporaryDirectory() as own_folder:
        folder = [own_folder]
        if distributed:  # transformers writes on rank 0 only: every rank reads rank 0's folder
            dist.broadcast_object_list(folder, src=0)
        tiny_model("llama").save_pretrained(folder[0])
        if distributed:
            dist.barrier()
        model = AutoModelForCausalLM.from_pretrained(folder[0], attn_implementation="sdpa").eval()
        if distributed:  # rank 0 removes its folder once every rank has read it
            dist.barrier()
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.mlp = AuxiliaryLossMoE(model.config.hidden_size).eval()
    return model


SP_CASES: dict[str, Any] = {  # the sequence (SEQ=40) runs beyond the original maximum position (16) of both RoPEs
    "dynamic_rope": lambda: tiny_model(
        "llama",
        max_position_embeddings=16,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    ),
    "longrope": lambda: tiny_model(
        "phi3",
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_parameters={
            "rope_type": "longrope",
            "short_factor": [1.0] * 4,
            "long_factor": [3.0] * 4,
            "original_max_position_embeddings": 16,
            "rope_theta": 10000.0,
        },
    ),
    "attention_sinks": lambda: tiny_model("gpt_oss", **GPT_OSS),
    "chunked_attention": lambda: tiny_model("llama4_text", **{**LLAMA4, "attn_temperature_tuning": False}),
    "local_index_scale": lambda: tiny_model("llama4_text", **LLAMA4),  # temperature tuning scales q by local index
    # known mixers: sharded
    "short_convolution": lambda: tiny_model("lfm2", layer_types=["conv", "full_attention"]),
    "recurrent_block": _recurrent_gemma,  # RecurrentGemma's convolution + RG-LRU
    # mixers with no sharded form
    "user_written_mixer": _llama_with_a_mixer,
    "user_written_mixer_gathered": _llama_with_a_mixer,
    "user_written_mixer_ring": _llama_with_a_mixer,
    "user_written_mixer_gathered_ring": _llama_with_a_mixer,
    "padded_convolution_gathered": _llama_with_a_convolution,  # the gathered module returns N + 2 tokens too
    "padded_convolution_gathered_ring": _llama_with_a_convolution,
    "auxiliary_loss": _llama_with_an_auxiliary_loss,  # a loss of its own in the backward, per rank's shard
}
GATHERED = {
    "user_written_mixer_gathered",
    "user_written_mixer_gathered_ring",
    "padded_convolution_gathered",
    "padded_convolution_gathered_ring",
}  # sequence_mixers="gather"
RING = {"user_written_mixer_ring", "user_written_mixer_gathered_ring", "padded_convolution_gathered_ring"}  # ring 2
# compared with each document on its own: mask no packed documents (gpt-oss, Llama4) or reset a mixer's state at them
PER_DOCUMENT = {"attention_sinks", "chunked_attention", "local_index_scale", "short_convolution", "recurrent_block"}


def sp_worker(args: dict[str, Any]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    rank, results = dist.get_rank(), {}
    # ring 2 x Ulysses 1: the ring over the world, and plain Ulysses over the world
    ring = SequenceParallelGroups.create(SequenceParallelTopology(2, 2, rank, ring_size=2), "cpu")
    plain = SequenceParallelGroups.create(SequenceParallelTopology(2, 2, rank), "cpu")
    for name, factory in SP_CASES.items():
        model = factory()
        ids, positions = packed_ids_and_positions()
        # the plain model on the whole batch: transformers masks the packed documents, and length-dependent RoPE reads
        # the largest position of the batch (PER_DOCUMENT: each document alone)
        if name in PER_DOCUMENT:
            expected = plain_logits(model, ids, positions)
        else:
            expected = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        expected.sum().backward()
        expected_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        before = module_attributes(model, identities=False)
        ring_size = 2 if name in RING else 1
        group = ring if name in RING else plain
        try:
            mixers = "gather" if name in GATHERED else "refuse"
            apply_ulysses_attention(model, group, attn_implementation="sdpa", sequence_mixers=mixers)
        except UnsupportedModelError as error:
            results[name] = {"refused": str(error), "undone": module_attributes(model, identities=False) == before}
            continue
        batch = prepare_batch({"input_ids": ids, "position_ids": positions}, 2, ring_size)
        batch = shard_batch(batch, rank, 2, ring_size)
        local = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        local.sum().backward()  # summed over the ranks: the gradient of the whole sequence's logits sum
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if n in expected_grads}
        for grad in grads.values():
            dist.all_reduce(grad)
        results[name] = {
            "error": relative_error(gather_sequence(local, group), expected),
            "grad_error": max(relative_error(grads[n], g) for n, g in expected_grads.items() if g.norm() > 0),
            "whole_sequence_rotary": [n for n, m in model.named_modules() if "_ulysses_rotary_hooks" in m.__dict__],
            "gathered": [n for n, m in model.named_modules() if "_ulysses_gather_hooks" in m.__dict__],
            "sharded": [n for n, m in model.named_modules() if "_ulysses_mixer_forward" in m.__dict__],
        }
        if name == "recurrent_block":  # with a cache, whose states would hold this rank's heads only
            block, hidden = model.model.layers[0].temporal_block, torch.zeros(2, SEQ // 2, model.config.hidden_size)
            try:
                block(hidden, position_ids=batch["position_ids"], attention_mask=None, use_cache=True)
            except ValueError as error:
                results[name]["cache_refused"] = str(error)
        remove_ulysses_attention(model)
        results[name]["undone"] = module_attributes(model, identities=False) == before
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def sp_results() -> list[dict[str, Any]]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return launch("tests.test_model_check:sp_worker", 2)


@pytest.mark.parametrize("name", ["dynamic_rope", "longrope"])
def test_length_dependent_rope_sees_the_whole_sequence(sp_results: list[dict[str, Any]], name: str) -> None:
    for rank_results in sp_results:
        got = rank_results[name]
        assert got["whole_sequence_rotary"] == ["model.rotary_emb"]
        assert got["error"] < 1e-5 and got["grad_error"] < 1e-5


@pytest.mark.parametrize("name", ["attention_sinks", "chunked_attention"])
def test_sinks_and_chunks_run_exactly_across_ranks(sp_results: list[dict[str, Any]], name: str) -> None:
    for rank_results in sp_results:
        assert rank_results[name]["error"] < 1e-5 and rank_results[name]["grad_error"] < 1e-5


@pytest.mark.parametrize(
    ("name", "refusal"),
    [
        (
            "local_index_scale",
            r"model\.layers\.1\.self_attn \(Llama4TextAttention\): builds token indices from the "
            r"length of its input \(torch\.arange at modeling_llama4\.py:\d+\)",
        ),
        (
            "user_written_mixer",
            r"model\.layers\.1\.mlp\.1 \(CausalCumulativeMean\): changes its output when the "
            r"sequence is split",
        ),
        # under Ulysses x Ring too (the zigzag shards), with the gather fallback suggested (it runs under the ring)
        (
            "user_written_mixer_ring",
            r"model\.layers\.1\.mlp\.1 \(CausalCumulativeMean\): changes its output when the "
            r"sequence is split(.|\n)*UlyssesStrategy\(sequence_mixers='gather'\) runs "
            r"such layers",
        ),
        # the router's load-balancing loss would be each shard's: refused before any step, whatever the module's mode
        (
            "auxiliary_loss",
            r"model\.layers\.0\.mlp \(AuxiliaryLossMoE\): adds a gradient of its own in training(.|\n)*sp_size=1, or "
            r"disable the auxiliary loss(.|\n)*model\.layers\.1\.mlp \(AuxiliaryLossMoE\): adds a gradient",
        ),
        # a gathered output longer than the sequence has no zigzag shard
        (
            "padded_convolution_gathered_ring",
            r"The gathered token mixer CausalConvolution returns an output 2 tokens "
            r"longer than the sequence(.|\n)*Use ring_size=1",
        ),
    ],
)
def test_token_mixers_and_local_indices_are_refused_on_every_rank(
    sp_results: list[dict[str, Any]], name: str, refusal: str
) -> None:
    messages = [rank_results[name]["refused"] for rank_results in sp_results]
    assert messages[0] == messages[1]  # every rank raises the same error
    assert re.search(refusal, messages[0])


@pytest.mark.parametrize(
    ("name", "gathered"),
    [
        ("user_written_mixer_gathered", ["model.layers.1.mlp.1"]),
        # the padded output: each rank keeps its rows and the 2 after them
        ("padded_convolution_gathered", ["model.layers.1.mlp.1.module"]),
        # zigzag shards: the gathered sequence in sequence order, each rank's zigzag shard of the outputs
        ("user_written_mixer_gathered_ring", ["model.layers.1.mlp.1"]),
    ],
)
def test_gathered_token_mixers_run_exactly(sp_results: list[dict[str, Any]], name: str, gathered: list[str]) -> None:
    for rank_results in sp_results:
        got = rank_results[name]
        assert got["gathered"] == gathered
        assert got["error"] < 1e-5 and got["grad_error"] < 1e-5


@pytest.mark.parametrize(
    ("name", "sharded"),
    [
        ("short_convolution", ["model.layers.0.conv"]),
        ("recurrent_block", ["model.layers.0.temporal_block", "model.layers.1.temporal_block"]),
    ],
)
def test_known_token_mixers_run_sharded(sp_results: list[dict[str, Any]], name: str, sharded: list[str]) -> None:
    """LFM2's short convolution and RecurrentGemma's recurrent blocks run head-sharded (not gathered), and reset at
    the packed document of row 1."""
    for rank_results in sp_results:
        got = rank_results[name]
        assert got["sharded"] == sharded and got["gathered"] == []
        assert got["error"] < 1e-5 and got["grad_error"] < 1e-5
    if name == "recurrent_block":
        assert all("without a cache (use_cache=False)" in r[name]["cache_refused"] for r in sp_results)


def test_remove_undoes_every_plan_across_ranks(sp_results: list[dict[str, Any]]) -> None:
    """Whole-sequence rotary, gathered and head-sharded mixers, refusals: the model's attributes as they were."""
    assert [name for rank_results in sp_results for name, got in rank_results.items() if not got["undone"]] == []


def test_the_local_index_trap_sees_arange_without_replacing_it() -> None:
    """The set-up check's trap sees a module's ``torch.arange`` over the shard's length through a mode of this thread:
    ``torch.arange`` itself stays torch's (it was swapped process-wide before)."""
    from lightning_ulysses.hf.check.training import local_index_trap
    from tests.tiny import tiny_llama

    model, arange = tiny_llama(), torch.arange
    with local_index_trap(model, 8) as found:
        assert torch.arange is arange
        model(input_ids=torch.ones(1, 8, dtype=torch.long))  # no position_ids: Llama numbers the tokens itself
    assert [f.where for f in found] == ["model (LlamaModel)"], found
    assert "torch.arange at modeling_llama.py:" in found[0].problem
