"""Training with Ulysses x Ring equals one process on whole sequences (loss of every micro-batch and the update).

Four processes: dp 2 x ring 2 x Ulysses 1 and ring 2 x Ulysses 2, under ZeRO 1, 2 and 3, with packed documents
whose borders fall on ring-block borders, on Ulysses-shard borders and inside chunks, a length that needs
padding, and activation checkpointing with tiled MLPs. The reference is plain transformers in one process
(tests/tiny.py), as in tests/test_equivalence.py.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesStrategy
from lightning_ulysses.prediction import token_log_probs
from tests.launch import launch
from tests.tiny import (
    SaveAndStop,
    TinyCausalLM,
    collate,
    cpu_trainer,
    make_packed_samples,
    make_samples,
    reference_loss,
    reference_training,
    relative_update_error,
    tiny_llama,
)

pytestmark = pytest.mark.distributed

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
    # the ring's point-to-point exchanges again in the recomputation of checkpointed layers
    "ring2_ulysses2_zero2_checkpointed_tiled_mlp": dict(
        sp=4, stage=2, packed=(12, 3), strategy=dict(activation_checkpointing=True, tiled_mlp=True)
    ),
    # head_chunks: chunks of one head, the projections inside them (each chunk's all-to-all and ring attention again
    # in its recomputation)
    "ring2_ulysses2_zero2_packed_head_chunks2": dict(
        sp=4, stage=2, packed=(12, 3), strategy=dict(head_chunks=2), projected=True
    ),
}


def _samples(case: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    if "packed" in case:
        return make_packed_samples(8, SEQ, borders=case["packed"])
    return make_samples(8, case.get("seq_len", SEQ))


def train_worker(args: dict[str, Any]) -> dict[str, Any]:
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown deletes it
    results = {name: _fit(case, world_size) for name, case in CASES.items()}
    results["evaluation"] = _evaluate_and_reload(world_size, args["checkpoint"])
    return results


class EvaluatedLM(TinyCausalLM):
    """Records each validation batch's loss and its per-token log-probabilities gathered in sequence order."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.val_losses: list[float] = []
        self.val_log_probs: list[torch.Tensor] = []

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        self.val_losses.append(self.causal_lm_loss(logits, batch["shift_labels"]).item())
        self.val_log_probs.append(self.trainer.strategy.gather_sequence(token_log_probs(logits, batch["shift_labels"])))


def _evaluate_and_reload(devices: int, checkpoint: str) -> dict[str, Any]:
    """ring 2 x Ulysses 2 (ZeRO-3): train, save, validate; then resume training from that checkpoint at ring 1 x
    Ulysses 4 for one more step."""
    import deepspeed

    def trainer(ring_size: int, max_steps: int) -> L.Trainer:
        return cpu_trainer(
            devices,
            UlyssesStrategy(sp_size=4, ring_size=ring_size, stage=3, attn_implementation="sdpa"),
            max_steps=max_steps,
            num_sanity_val_steps=0,
        )

    def train_loader() -> DataLoader:
        return DataLoader(make_samples(8, SEQ), batch_size=BATCH, collate_fn=collate)

    module = EvaluatedLM(lr=LR)
    ring_trainer = trainer(ring_size=2, max_steps=-1)
    ring_trainer.callbacks.append(SaveAndStop(STEPS, checkpoint, zero_stage_3=True))  # saved inside the epoch
    ring_trainer.fit(module, train_loader())
    ring_trainer.validate(module, _val_loader())
    resumed = EvaluatedLM(lr=LR)
    trainer(ring_size=1, max_steps=STEPS + 1).fit(resumed, train_loader(), ckpt_path=checkpoint)
    with deepspeed.zero.GatheredParameters(list(resumed.model.parameters())):
        params = {name: p.detach().clone() for name, p in resumed.model.named_parameters()}
    return {
        "val_losses": module.val_losses,
        "log_probs": module.val_log_probs,
        "resumed_losses": resumed.losses,
        "resumed_params": params,
    }


def _val_loader() -> DataLoader:
    return DataLoader(make_samples(4, SEQ - 3, seed=7), batch_size=BATCH, collate_fn=collate)


def _fit(case: dict[str, Any], devices: int) -> dict[str, Any]:
    import deepspeed

    module = TinyCausalLM(lr=LR, **case.get("model", {}))
    strategy = UlyssesStrategy(
        sp_size=case["sp"], ring_size=2, stage=case["stage"], attn_implementation="sdpa", **case.get("strategy", {})
    )
    trainer = cpu_trainer(devices, strategy, max_steps=STEPS)
    trainer.fit(module, DataLoader(_samples(case), batch_size=BATCH, collate_fn=collate))
    with deepspeed.zero.GatheredParameters(list(module.model.parameters()), enabled=case["stage"] == 3):
        state = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    return {
        "losses": module.losses,
        "params": state,
        "dp_rank": strategy.dp_rank,
        "layout": (strategy.dp_size, strategy.ring_size, strategy.sp_size // strategy.ring_size),
        "projected": module.projected,
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    checkpoint = str(tmp_path_factory.mktemp("ring") / "ring2.ckpt")
    return launch("tests.test_ring_training:train_worker", 4, {"checkpoint": checkpoint})


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
        assert bool(got["projected"]) == case.get("projected", False), got["projected"]
        if got["dp_rank"] == 0:
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"


def test_evaluation_and_checkpoints_do_not_depend_on_the_ring(results: list[dict[str, Any]]) -> None:
    """Validation under ring 2 x Ulysses 2 equals the trained reference model on whole sequences (loss, and the
    per-token log-probabilities gathered back in sequence order); training resumed from its ZeRO-3 checkpoint at
    ring 1 x Ulysses 4 takes the third step exactly as one process does."""
    _, trained = reference_training(make_samples(8, SEQ), steps=STEPS, batch_size=BATCH, lr=LR)
    third_losses, third = reference_training(make_samples(8, SEQ), steps=STEPS + 1, batch_size=BATCH, lr=LR)
    model = tiny_llama()
    model.load_state_dict(trained)
    val = _val_loader()
    with torch.no_grad():
        expected_losses = [reference_loss(model, batch).item() for batch in val]
        expected_log_probs = [
            torch.log_softmax(model(input_ids=b["input_ids"]).logits[:, :-1], -1).gather(
                -1, b["input_ids"][:, 1:, None]
            )[..., 0]
            for b in val
        ]
    for rank, result in enumerate(results):
        got = result["evaluation"]
        torch.testing.assert_close(torch.tensor(got["val_losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        for log_probs, expected in zip(got["log_probs"], expected_log_probs):
            n = expected.shape[1]  # the whole rows: N - 1 labelled tokens, then the last token and the padding
            torch.testing.assert_close(log_probs[:, :n], expected, rtol=1e-5, atol=1e-6)
            assert not log_probs[:, n:].any()
        torch.testing.assert_close(
            torch.tensor(got["resumed_losses"]), torch.tensor(third_losses[STEPS:]), rtol=1e-5, atol=0
        )
        error = relative_update_error(trained, third, got["resumed_params"])
        assert error < 1e-4, f"rank {rank}: relative weight-update error of the resumed step {error:.2e}"
