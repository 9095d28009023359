"""Training through ``L.Trainer`` with the attention features equals one process.

Head counts that do not divide by ``sp_size``, packed documents whose borders fall inside and exactly on
shard borders, batches whose size and length change from step to step (with a validation loader of
another batch size), multi-head latent attention (value heads smaller than the query's: DeepSeek V3, MiniCPM3)
and a window switched off (Qwen2-MoE writes ``sliding_window=0``). Each case compares, against plain
transformers in one process (packed documents run one by one through the model), the loss of every
micro-batch (relative 1e-5) and the final weights (``|update_sp - update_ref| / |update_ref| < 1e-4``), as
``tests/test_equivalence.py`` does.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesStrategy
from tests.cases import CaseTable
from tests.test_model_check import GPT_OSS as MODEL_CHECK_GPT_OSS
from tests.tiny import (
    TinyCausalLM,
    collate,
    collate_padded,
    make_packed_samples,
    make_samples,
    reference_loss,
    reference_training,
    relative_update_error,
    tiny_llama,
)

pytestmark = pytest.mark.distributed

SEQ, LR = 24, 0.5
SIX_HEADS = dict(hidden_size=48, num_attention_heads=6, head_dim=8)
GPT_OSS = dict(MODEL_CHECK_GPT_OSS, model_type="gpt_oss", head_dim=12)  # sinks, a window on every other layer, MoE
EIGHT_HEADS = dict(hidden_size=64, num_attention_heads=8, head_dim=12)  # head_dim against hidden / heads = 8
# DeepSeek V3's proportions shrunk by 8: qk_nope 128 : qk_rope 64 : v 128 (query and key heads of 24, values of 16),
# kv_lora_rank 4x and q_lora_rank 12x the nope dims, hidden 14x the kv rank, its yarn RoPE (whose mscale changes the
# softmax scale), a dense layer and a routed-MoE one
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    hidden_size=896,
    intermediate_size=2304,
    moe_intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=4,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    kv_lora_rank=64,
    q_lora_rank=192,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    max_position_embeddings=163840,
    rope_parameters=YARN,
)
# MiniCPM3-4B's proportions (qk_nope 64 : qk_rope 32 : v 64, kv_lora_rank 256, q_lora_rank 768, hidden 2560) shrunk by 4
MINICPM3 = dict(
    model_type="minicpm3",
    hidden_size=640,
    intermediate_size=1600,
    num_attention_heads=4,
    num_key_value_heads=4,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    kv_lora_rank=64,
    q_lora_rank=192,
    tie_word_embeddings=True,
)
# use_sliding_window=False: transformers sets sliding_window=0 and still builds a sliding mask of that window
QWEN2_MOE_NO_WINDOW = dict(
    model_type="qwen2_moe",
    use_sliding_window=False,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
)
# name -> case: sp, ZeRO stage, model overrides, data ("uniform", "packed" with forced borders, "variable")
FOUR_RANKS = CaseTable(
    "four_rank_results",
    "tests.test_attention_training:fit_case",
    4,
    {
        "sp4_heads6": dict(sp=4, stage=2, model=dict(SIX_HEADS, num_key_value_heads=6)),
        "sp4_heads6_mqa": dict(sp=4, stage=3, model=dict(SIX_HEADS, num_key_value_heads=1)),
        "sp4_packed": dict(sp=4, stage=2, data="packed", borders=(SEQ // 4, SEQ // 2)),
        # head_chunks (lightning_ulysses.attention.head_chunks): 6 heads, 1 K/V head on 4 ranks, chunks of one head
        "sp4_heads6_mqa_head_chunks2": dict(
            sp=4, stage=3, model=dict(SIX_HEADS, num_key_value_heads=1), strategy=dict(head_chunks=2)
        ),  # inert head slots: attention-only chunks (a projection chunk would sum an inert copy's output)
        # 8 heads, 2 K/V heads replicated over 4 ranks: the projections inside chunks of one query slot per rank (4
        # chunks asked, 2 slots per rank)
        "sp4_gqa_kv2_head_chunks4": dict(
            sp=4, stage=2, model=dict(EIGHT_HEADS, num_key_value_heads=2), strategy=dict(head_chunks=4), projected=True
        ),
    },
)
TWO_RANKS = CaseTable(
    "two_rank_results",
    "tests.test_attention_training:fit_case",
    2,
    {
        "sp2_heads6_kv3": dict(sp=2, stage=1, model=dict(SIX_HEADS, num_key_value_heads=3)),
        "sp2_packed": dict(sp=2, stage=3, data="packed", borders=(SEQ // 2,)),
        "sp2_variable_batches": dict(sp=2, stage=2, data="variable"),
        "sp2_deepseek_v3_mla": dict(sp=2, stage=2, model=DEEPSEEK_V3),
        "sp2_deepseek_v3_mla_heads3_packed": dict(
            sp=2,
            stage=3,
            model=dict(DEEPSEEK_V3, num_attention_heads=3, num_key_value_heads=3),
            data="packed",
            borders=(SEQ // 2,),
        ),
        "sp2_minicpm3_mla": dict(sp=2, stage=1, model=MINICPM3),
        "sp2_qwen2_moe_window_off": dict(sp=2, stage=2, model=QWEN2_MOE_NO_WINDOW),
        # head_chunks: one chunk of all heads (packed, ZeRO-3), chunks of 2 heads (8 heads), of 1 head with a sliding
        # window (Mistral), "auto" (6 heads, 3 K/V heads): each with the projections inside the chunks
        # (lightning_ulysses.hf.projections), Qwen 3 with its per-head q/k norms too; OLMo 2's q/k norms over all heads
        # and DiffLlama's mixing weights (parameters of its attention module) keep attention-only chunks
        "sp2_packed_head_chunks1": dict(
            sp=2, stage=3, data="packed", borders=(SEQ // 2,), strategy=dict(head_chunks=1), projected=True
        ),
        "sp2_heads8_head_chunks2": dict(
            sp=2, stage=2, model=dict(EIGHT_HEADS, num_key_value_heads=4), strategy=dict(head_chunks=2), projected=True
        ),
        "sp2_mistral_window_head_chunks2": dict(
            sp=2,
            stage=2,
            model=dict(model_type="mistral", sliding_window=7),
            strategy=dict(head_chunks=2),
            projected=True,
        ),
        "sp2_heads6_kv3_head_chunks_auto": dict(
            sp=2,
            stage=1,
            model=dict(SIX_HEADS, num_key_value_heads=3),
            strategy=dict(head_chunks="auto"),
            projected=True,
        ),
        "sp2_qwen3_head_chunks_auto": dict(
            sp=2,
            stage=3,
            model=dict(model_type="qwen3", hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16),
            strategy=dict(head_chunks="auto"),
            projected=True,
        ),
        # gpt-oss: its sinks narrowed with the chunk's query heads, a window on every other layer, MoE; under ZeRO-3
        # (which partitions the sinks, read outside the module's call) attention-only chunks
        "sp2_gpt_oss_sinks_head_chunks2": dict(
            sp=2, stage=2, model=GPT_OSS, strategy=dict(head_chunks=2), projected=True
        ),
        "sp2_gpt_oss_sinks_zero3_head_chunks2": dict(sp=2, stage=3, model=GPT_OSS, strategy=dict(head_chunks=2)),
        "sp2_olmo2_head_chunks2": dict(sp=2, stage=3, model=dict(model_type="olmo2"), strategy=dict(head_chunks=2)),
        "sp2_diffllama_head_chunks2": dict(
            sp=2, stage=2, model=dict(model_type="diffllama"), strategy=dict(head_chunks=2)
        ),
    },
)
# CUDA, 2+ GPUs: the packed sp=2 case with the GPU backends; flash-attn needs bf16 (looser tolerances)
GPU_TWO_RANKS: dict[str, dict[str, Any]] = {
    "sp2_packed_flex_attention": dict(TWO_RANKS.cases["sp2_packed"], attn="flex_attention", accelerator="cuda"),
    "sp2_packed_flash_attention_2": dict(
        TWO_RANKS.cases["sp2_packed"], attn="flash_attention_2", accelerator="cuda", precision="bf16-mixed"
    ),
}
# loss rtol, weight-update error; a factor of 2 anywhere still gives an error near 1
TOLERANCE = {"cpu": (1e-5, 1e-4), "32-true": (1e-4, 1e-4), "bf16-mixed": (2e-2, 5e-2)}
# "variable": 5 samples of random lengths, batches of 2 -> 2, 2, then the last smaller batch of 1;
# validation: 5 other samples in batches of 3 -> 3, 2
BATCH = 2
STEPS = {"uniform": 2, "packed": 2, "variable": 3}
VAL_BATCH = 3


def _samples(case: dict[str, Any], seed: int = 1) -> list[dict[str, Tensor]]:
    data = case.get("data", "uniform")
    if data == "packed":
        return make_packed_samples(8, SEQ, seed=seed, borders=case["borders"])
    if data == "variable":
        lengths = torch.randint(9, SEQ + 1, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        return [make_samples(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)]
    return make_samples(8, SEQ, seed=seed)


def _collate(case: dict[str, Any]) -> Any:
    return collate_padded if case.get("data") == "variable" else collate


class TinyCausalLMWithValidation(TinyCausalLM):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.val_losses: list[float] = []
        self.batch_shapes: list[tuple[int, ...]] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.batch_shapes.append(tuple(batch["input_ids"].shape))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        self.val_losses.append(self.causal_lm_loss(logits, batch["shift_labels"]).item())


def fit_case(name: str, case: dict[str, Any], world_size: int) -> dict[str, Any]:
    import deepspeed

    module = TinyCausalLMWithValidation(lr=LR, **case.get("model", {}))
    strategy = UlyssesStrategy(
        sp_size=case["sp"],
        stage=case["stage"],
        attn_implementation=case.get("attn", "sdpa"),
        **case.get("strategy", {}),
    )
    validate = case.get("data") == "variable"
    trainer = L.Trainer(
        accelerator=case.get("accelerator", "cpu"),
        devices=world_size,
        precision=case.get("precision", "32-true"),
        strategy=strategy,
        max_steps=STEPS[case.get("data", "uniform")],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(_samples(case), batch_size=BATCH, collate_fn=_collate(case))
    val_loader = DataLoader(_samples(case, seed=100), batch_size=VAL_BATCH, collate_fn=_collate(case))
    trainer.fit(module, loader, val_loader if validate else None)
    with deepspeed.zero.GatheredParameters(list(module.model.parameters()), enabled=case["stage"] == 3):
        state = {name: p.detach().float().cpu() for name, p in module.model.named_parameters()}
    return {
        "losses": module.losses,
        "val_losses": module.val_losses,
        "params": state,
        "batch_shapes": module.batch_shapes,
        "sp_rank": strategy.sp_rank,
        "projected": module.projected,
    }


def _check(results: list[dict[str, Any]], name: str, case: dict[str, Any]) -> None:
    loss_rtol, update_tolerance = TOLERANCE[case.get("precision", "32-true") if "accelerator" in case else "cpu"]
    overrides = case.get("model", {})
    samples = _samples(case)
    expected_losses, expected = reference_training(
        samples,
        steps=STEPS[case.get("data", "uniform")],
        batch_size=BATCH,
        lr=LR,
        collate_fn=_collate(case),
        **overrides,
    )
    initial = {n: p.detach() for n, p in tiny_llama(**overrides).named_parameters()}
    for rank, result in enumerate(results):
        got = result[name]
        assert got["sp_rank"] == rank % case["sp"]
        assert bool(got["projected"]) == case.get("projected", False), got["projected"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=loss_rtol, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < update_tolerance, f"{name} rank {rank}: relative weight-update error {error:.2e}"
    if case.get("data") == "variable":
        _check_variable(results[0][name], case, expected)


def _check_variable(got: dict[str, Any], case: dict[str, Any], trained: dict[str, Tensor]) -> None:
    """Batch sizes and lengths did change (shards of [B, N/sp]); validation matches the trained reference model."""
    assert [shape[0] for shape in got["batch_shapes"]] == [2, 2, 1]
    assert len({shape[1] for shape in got["batch_shapes"]}) > 1, got["batch_shapes"]
    model = tiny_llama(**case.get("model", {}))
    model.load_state_dict(trained)
    val = _samples(case, seed=100)
    with torch.no_grad():
        expected = [reference_loss(model, collate_padded(val[i : i + VAL_BATCH])).item() for i in (0, VAL_BATCH)]
    torch.testing.assert_close(torch.tensor(got["val_losses"]), torch.tensor(expected), rtol=1e-5, atol=0)


def test_packed_data_has_borders_inside_and_on_shard_borders() -> None:
    """The packed cases exercise what they claim: 3-5 documents per row, borders on and off shard borders."""
    for case in (FOUR_RANKS.cases["sp4_packed"], TWO_RANKS.cases["sp2_packed"]):
        shard = SEQ // case["sp"]
        starts = [(s["position_ids"] == 0).nonzero().flatten().tolist() for s in _samples(case)]
        assert all(3 <= len(row) <= 5 for row in starts)
        borders = [b for row in starts for b in row[1:]]
        assert any(b % shard == 0 for b in borders) and any(b % shard for b in borders)


def test_the_latent_attention_and_window_cases_hold_what_they_claim() -> None:
    """The MLA models' value heads are smaller than their query heads (and DeepSeek's yarn changes the softmax scale);
    Qwen2-MoE's switched-off window is a window of 0, not None."""
    for config in (DEEPSEEK_V3, MINICPM3):
        attention = tiny_llama(**config).model.layers[0].self_attn
        assert (attention.qk_head_dim, attention.v_head_dim) == (24, 16), config["model_type"]
    assert tiny_llama(**DEEPSEEK_V3).model.layers[0].self_attn.scaling > 1.5 * 24**-0.5
    assert tiny_llama(**QWEN2_MOE_NO_WINDOW).config.sliding_window == 0


two_rank_results = TWO_RANKS.fixture()
four_rank_results = FOUR_RANKS.fixture()


@TWO_RANKS.each_case
def test_two_ranks_equal_single_process(two_rank_results: list[dict[str, Any]], name: str) -> None:
    _check(two_rank_results, name, TWO_RANKS.cases[name])


@FOUR_RANKS.each_case
def test_four_ranks_equal_single_process(four_rank_results: list[dict[str, Any]], name: str) -> None:
    _check(four_rank_results, name, FOUR_RANKS.cases[name])


@pytest.fixture(scope="module")
def gpu_two_rank_results() -> list[dict[str, Any]]:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    cases = {
        name: case
        for name, case in GPU_TWO_RANKS.items()
        if case["attn"] != "flash_attention_2" or importlib.util.find_spec("flash_attn") is not None
    }
    return CaseTable("gpu_two_rank_results", "tests.test_attention_training:fit_case", 2, cases).run()


@pytest.mark.cuda
@pytest.mark.parametrize("name", GPU_TWO_RANKS)
def test_gpu_backends_on_packed_documents_equal_single_process(
    gpu_two_rank_results: list[dict[str, Any]], name: str
) -> None:
    if name not in gpu_two_rank_results[0]:
        pytest.skip("flash-attn is not installed")
    _check(gpu_two_rank_results, name, GPU_TWO_RANKS[name])
