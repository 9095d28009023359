"""Training with Ulysses x Ring equals one process on whole sequences (loss of every micro-batch and the update).

Four processes: dp 2 x ring 2 x Ulysses 1 and ring 2 x Ulysses 2, under ZeRO 1, 2 and 3, with packed documents
whose borders fall on ring-block borders, on Ulysses-shard borders and inside chunks, and a length that needs
padding. The reference is plain transformers in one process (tests/tiny.py), as in tests/test_equivalence.py.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesStrategy
from tests.launch import launch
from tests.tiny import (
    TinyCausalLM, collate, make_packed_samples, make_samples, reference_training, relative_update_error, tiny_llama,
)

SEQ, BATCH, STEPS, LR = 24, 2, 2, 0.5
# sp=2, ring 2 (dp 2): chunks of 6 tokens, ring blocks [0, 6) + [18, 24) and [6, 18)
# sp=4, ring 2 x Ulysses 2: the same chunks, each Ulysses rank holds one; borders at 6 and 18 are ring-block
# borders, 12 a Ulysses-shard border inside ring rank 1's block, 9 and 3 inside chunks
CASES: dict[str, dict[str, Any]] = {
    "dp2_ring2_ulysses1_zero2": dict(sp=2, stage=2),
    "dp2_ring2_ulysses1_zero1_packed": dict(sp=2, stage=1, packed=(6, 9)),
    "ring2_ulysses2_zero3": dict(sp=4, stage=3),
    "ring2_ulysses2_zero2_packed": dict(sp=4, stage=2, packed=(12, 3)),
    "ring2_ulysses2_zero1_mqa_padded": dict(sp=4, stage=1, model=dict(num_key_value_heads=1), seq_len=SEQ - 5),
}


def _samples(case: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    if "packed" in case:
        return make_packed_samples(8, SEQ, borders=case["packed"])
    return make_samples(8, case.get("seq_len", SEQ))


def train_worker(args: dict[str, Any]) -> dict[str, Any]:
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown deletes it
    return {name: _fit(case, world_size) for name, case in CASES.items()}


def _fit(case: dict[str, Any], devices: int) -> dict[str, Any]:
    import deepspeed

    module = TinyCausalLM(lr=LR, **case.get("model", {}))
    strategy = UlyssesStrategy(sp_size=case["sp"], ring_size=2, stage=case["stage"], attn_implementation="sdpa")
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(_samples(case), batch_size=BATCH, collate_fn=collate))
    with deepspeed.zero.GatheredParameters(list(module.model.parameters()), enabled=case["stage"] == 3):
        state = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    return {"losses": module.losses, "params": state, "dp_rank": strategy.dp_rank,
            "layout": (strategy.dp_size, strategy.ring_size, strategy.sp_size // strategy.ring_size)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch("tests.test_ring_training:train_worker", 4, {})


@pytest.mark.parametrize("name", CASES)
def test_ulysses_x_ring_training_equals_single_process(results: list[dict[str, Any]], name: str) -> None:
    case = CASES[name]
    dp_size = 4 // case["sp"]
    expected_losses, expected = reference_training(
        _samples(case), steps=STEPS, batch_size=BATCH, dp_size=dp_size, lr=LR, **case.get("model", {})
    )
    initial = {n: p.detach() for n, p in tiny_llama(**case.get("model", {})).named_parameters()}
    for rank, result in enumerate(results):
        got = result[name]
        assert got["layout"] == (dp_size, 2, case["sp"] // 2)
        if got["dp_rank"] == 0:
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"
