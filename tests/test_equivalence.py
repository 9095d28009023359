"""The central test: training with UlyssesStrategy equals one process on whole sequences.

Every case trains a tiny Llama with SGD through ``L.Trainer`` on CPU processes (gloo) and compares,
against a single-process run of plain transformers on the same data, the loss of every micro-batch
and the final weights: ``|update_sp - update_ref| / |update_ref| < 1e-4``. A factor of 2 anywhere in
the loss or its gradient gives an error near 1.

The ``*short*`` cases train whole epochs of 5 micro-batches with 2 a step, against the unpatched model under plain
Lightning on one process: 3 optimizer steps an epoch, the last one on a single micro-batch (its loss divided by 2,
as Lightning divides every micro-batch), and the next epoch's first step on that epoch's batches only.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesStrategy
from tests.cases import CaseTable
from tests.tiny import (
    TinyCausalLM,
    collate,
    cpu_trainer,
    make_samples,
    plain_lightning_training,
    reference_training,
    relative_update_error,
    tiny_llama,
)

pytestmark = pytest.mark.distributed

SEQ = 24
# name -> case. "data" feeds make_samples; "model" overrides the tiny Llama config.
TWO_RANKS = CaseTable(
    "two_rank_results",
    "tests.test_equivalence:fit_case",
    2,
    {
        "sp2_zero1": dict(sp=2, stage=1),
        "sp2_zero2": dict(sp=2, stage=2),
        "sp2_zero3": dict(sp=2, stage=3),
        "sp2_accumulate2": dict(sp=2, stage=2, accumulate=2),
        "sp2_gqa_one_kv_head": dict(sp=2, stage=2, model=dict(num_key_value_heads=1)),
        "sp2_length_not_divisible": dict(sp=2, stage=2, data=dict(seq_len=SEQ - 1)),
        "sp2_rank_without_valid_tokens": dict(sp=2, stage=2, data=dict(masked_spans=[(SEQ // 2 - 1, SEQ)])),
        "sp2_right_padding": dict(sp=2, stage=3, data=dict(padding=SEQ // 2 + 3)),
        # "epochs": whole epochs of 5 micro-batches (10 samples / batch 2 / dp), 2 a step
        "sp2_zero1_short_last_window": dict(sp=2, stage=1, accumulate=2, epochs=1, data=dict(num=10)),
        "sp2_zero2_short_windows_two_epochs": dict(sp=2, stage=2, accumulate=2, epochs=2, data=dict(num=10)),
        "sp2_zero3_short_last_window": dict(sp=2, stage=3, accumulate=2, epochs=1, data=dict(num=10)),
    },
)
FOUR_RANKS = CaseTable(
    "four_rank_results",
    "tests.test_equivalence:fit_case",
    4,
    {
        "sp4_zero2": dict(sp=4, stage=2),
        "sp4_zero3_gqa_kv2": dict(sp=4, stage=3, model=dict(num_key_value_heads=2)),
        "dp2_sp2_zero1": dict(sp=2, stage=1),
        "dp2_sp2_zero3_accumulate2": dict(sp=2, stage=3, accumulate=2),
        # chunks of one head, the projections inside them
        "dp2_sp2_zero2_head_chunks2": dict(sp=2, stage=2, strategy=dict(head_chunks=2), projected=True),
        "sp4_length_not_divisible": dict(sp=4, stage=2, data=dict(seq_len=SEQ - 3)),
        "dp2_sp2_zero2_short_windows_two_epochs": dict(sp=2, stage=2, accumulate=2, epochs=2, data=dict(num=20)),
    },
)
BATCH, STEPS, LR = 2, 2, 0.5


def _data(case: dict[str, Any]) -> dict[str, Any]:
    return {"num": 16, "seq_len": SEQ, **case.get("data", {})}


def fit_case(name: str, case: dict[str, Any], world_size: int) -> dict[str, Any]:
    return _fit(case, world_size, strategy_kwargs=case.get("strategy"))


def _fit(
    case: dict[str, Any],
    devices: int,
    num_nodes: int = 1,
    module_class: type[TinyCausalLM] = TinyCausalLM,
    strategy_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    import deepspeed

    module = module_class(lr=LR, **case.get("model", {}))
    strategy = UlyssesStrategy(
        sp_size=case["sp"], stage=case["stage"], attn_implementation="sdpa", **(strategy_kwargs or {})
    )
    trainer = cpu_trainer(
        devices,
        strategy,
        num_nodes=num_nodes,
        max_steps=-1 if "epochs" in case else STEPS,
        max_epochs=case.get("epochs"),
        accumulate_grad_batches=case.get("accumulate", 1),
    )
    loader = DataLoader(make_samples(**_data(case)), batch_size=BATCH, collate_fn=collate)
    trainer.fit(module, loader)
    params = list(module.model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=case["stage"] == 3):
        state = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    return {
        "losses": module.losses,
        "params": state,
        "sp_rank": strategy.sp_rank,
        "dp_rank": strategy.dp_rank,
        "steps": trainer.global_step,
        "ring_size": strategy.ring_size,
        "sp_group_ranks": dist.get_process_group_ranks(strategy.sp_group),
        "dp_group_ranks": dist.get_process_group_ranks(strategy.dp_group),
        "cluster_environment": type(strategy.cluster_environment).__name__,
        "projected": module.projected,
    }


def _check(results: list[dict[str, Any]], name: str, case: dict[str, Any]) -> None:
    if "epochs" in case:
        _check_whole_epochs(results, name, case)
        return
    assert all(bool(r[name]["projected"]) == case.get("projected", False) for r in results), name
    world_size = len(results)
    dp_size = world_size // case["sp"]
    accumulate = case.get("accumulate", 1)
    expected_losses, expected = reference_training(
        make_samples(**_data(case)),
        steps=STEPS,
        batch_size=BATCH,
        dp_size=dp_size,
        accumulate=accumulate,
        lr=LR,
        **case.get("model", {}),
    )
    initial = {n: p.detach() for n, p in tiny_llama(**case.get("model", {})).named_parameters()}
    for rank, result in enumerate(results):
        got = result[name]
        assert got["steps"] == STEPS
        assert (got["sp_rank"], got["dp_rank"]) == (rank % case["sp"], rank // case["sp"])
        if got["dp_rank"] == 0:  # every rank of the SP group reports the group's loss
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"


def _check_whole_epochs(results: list[dict[str, Any]], name: str, case: dict[str, Any]) -> None:
    """Against plain Lightning on one process, whose micro-batches hold every DP rank's rows (the rows have equal
    token counts, so its loss is the mean of the DP ranks' losses)."""
    dp_size = len(results) // case["sp"]
    expected_losses, expected, expected_steps = plain_lightning_training(
        make_samples(**_data(case)),
        batch_size=BATCH,
        dp_size=dp_size,
        accumulate=case["accumulate"],
        epochs=case["epochs"],
        lr=LR,
    )
    assert expected_steps == 3 * case["epochs"], "plain Lightning steps on each epoch's last, shorter window"
    initial = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    dp_losses = torch.tensor([results[d * case["sp"]][name]["losses"] for d in range(dp_size)])
    torch.testing.assert_close(dp_losses.mean(0), torch.tensor(expected_losses), rtol=1e-5, atol=0)
    for rank, result in enumerate(results):
        got = result[name]
        assert got["steps"] == expected_steps, f"{name} rank {rank}: {got['steps']} optimizer steps"
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"


two_rank_results = TWO_RANKS.fixture()
four_rank_results = FOUR_RANKS.fixture()


@TWO_RANKS.each_case
def test_two_ranks_equal_single_process(two_rank_results: list[dict[str, Any]], name: str) -> None:
    _check(two_rank_results, name, TWO_RANKS.cases[name])


@FOUR_RANKS.each_case
def test_four_ranks_equal_single_process(four_rank_results: list[dict[str, Any]], name: str) -> None:
    _check(four_rank_results, name, FOUR_RANKS.cases[name])
