"""The FSDP2 engine (``UlyssesFSDPStrategy``) equals one process of the plain, unpatched model, as DeepSpeed does.

Every case trains the tiny Llama of ``tests/tiny.py`` with SGD on CPU processes (gloo) and compares, against
:func:`~tests.tiny.reference_training` (one process, whole sequences), the loss of every micro-batch and the final
weights gathered from their shards: ``|update - update_ref| / |update_ref| < 1e-4`` (a factor of 2 anywhere gives an
error near 1). One launch per table: sp=2 (plain; activation checkpointing + tiled loss, counting the recomputed
layers and the loss tiles; a checkpoint saved after step 1 and resumed to step 2; tied embeddings, one FSDP unit
with ``lm_head``, with 2 micro-batches a step) and dp=2 x sp=2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesFSDPStrategy
from tests.cases import CaseTable
from tests.tiny import (
    TinyCausalLM,
    collate,
    cpu_trainer,
    make_samples,
    reference_training,
    relative_update_error,
    tiny_llama,
)

pytestmark = pytest.mark.distributed

SEQ, BATCH, STEPS, LR = 24, 2, 2, 0.5


class CountingCausalLM(TinyCausalLM):
    """The loss through ``forward_causal_lm_loss`` (tiled when the strategy's ``tiled_loss`` is on), counting the
    calls of the first decoder layer (its MLP) and of ``lm_head`` in training (recomputations included)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls = {"layer": 0, "lm_head": 0}
        self.model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: self._count("layer"))
        self.model.lm_head.register_forward_hook(lambda *_: self._count("lm_head"))

    def _count(self, name: str) -> None:
        self.calls[name] += 1

    def on_train_start(self) -> None:  # the set-up checks ran the model before
        self.calls = dict.fromkeys(self.calls, 0)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.forward_causal_lm_loss(self.model, batch)
        self.losses.append(loss.item())
        return loss


class SaveAfterStep(L.Callback):
    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def _full_parameters(model: torch.nn.Module) -> dict[str, Tensor]:
    """Every parameter whole, gathered from its FSDP2 shards (a collective)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def fit_case(name: str, case: dict[str, Any], world_size: int, folder: str) -> dict[str, Any]:
    module = CountingCausalLM(lr=LR, **case.get("model", {}))
    loader = DataLoader(make_samples(num=16, seq_len=SEQ), batch_size=BATCH, collate_fn=collate)
    strategy = UlyssesFSDPStrategy(sp_size=case["sp"], attn_implementation="sdpa", **case.get("strategy", {}))
    resume_from = None
    if case.get("resume"):
        resume_from = str(Path(folder) / f"{name}.ckpt")
        first = UlyssesFSDPStrategy(sp_size=case["sp"], attn_implementation="sdpa")
        saved_by = CountingCausalLM(lr=LR)
        cpu_trainer(world_size, first, max_steps=STEPS, callbacks=[SaveAfterStep(1, resume_from)]).fit(saved_by, loader)
    trainer = cpu_trainer(world_size, strategy, max_steps=STEPS, accumulate_grad_batches=case.get("accumulate", 1))
    trainer.fit(module, loader, ckpt_path=resume_from)
    mesh = strategy.device_mesh
    return {
        "losses": module.losses,
        "params": _full_parameters(module.model),
        "dtensor_parameters": all(isinstance(p, DTensor) for p in module.model.parameters()),
        "mesh": (mesh.mesh_dim_names, mesh.mesh.tolist(), mesh["dp_sp"].mesh.tolist()),
        "sp_rank": strategy.sp_rank,
        "dp_rank": strategy.dp_rank,
        "steps": trainer.global_step,
        "calls": module.calls,
        "resumed": resume_from is not None and Path(resume_from).is_dir(),
    }


TWO_RANKS = CaseTable(
    "fsdp_two_rank_results",
    "tests.test_fsdp:fit_case",
    2,
    {
        "sp2": dict(sp=2),
        "sp2_checkpointing_tiled_loss": dict(sp=2, strategy=dict(activation_checkpointing=True, tiled_loss=3)),
        "sp2_resumed_after_step_1": dict(sp=2, resume=True),
        "sp2_tied_embeddings_accumulate2": dict(sp=2, model=dict(tie_word_embeddings=True), accumulate=2),
    },
)
FOUR_RANKS = CaseTable("fsdp_four_rank_results", "tests.test_fsdp:fit_case", 4, {"dp2_sp2": dict(sp=2)})


def _folder(cases: Any, folder: Path) -> dict[str, Any]:
    return {"folder": str(folder)}


fsdp_two_rank_results = TWO_RANKS.fixture(_folder)
fsdp_four_rank_results = FOUR_RANKS.fixture(_folder)


def _check(results: list[dict[str, Any]], name: str, case: dict[str, Any]) -> None:
    world_size, sp = len(results), case["sp"]
    dp = world_size // sp
    expected_losses, expected = reference_training(
        make_samples(num=16, seq_len=SEQ),
        steps=STEPS,
        batch_size=BATCH,
        dp_size=dp,
        accumulate=case.get("accumulate", 1),
        lr=LR,
        **case.get("model", {}),
    )
    initial = {n: p.detach() for n, p in tiny_llama(**case.get("model", {})).named_parameters()}
    for rank, result in enumerate(results):
        got = result[name]
        assert got["steps"] == STEPS
        assert got["dtensor_parameters"], "fully_shard left plain parameters"
        grid = [[list(range(d * sp, (d + 1) * sp))] for d in range(dp)]  # [dp, ring=1, ulysses=sp]
        assert got["mesh"] == (("dp", "ring", "ulysses"), grid, list(range(dp * sp)))
        assert (got["sp_rank"], got["dp_rank"]) == (rank % sp, rank // sp)
        # a resumed run trained the second step only
        losses = expected_losses[1:] if case.get("resume") else expected_losses
        if got["dp_rank"] == 0:
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"


@TWO_RANKS.each_case
def test_fsdp_two_ranks_equal_single_process(fsdp_two_rank_results: list[dict[str, Any]], name: str) -> None:
    _check(fsdp_two_rank_results, name, TWO_RANKS.cases[name])


def test_fsdp_memory_options_act(fsdp_two_rank_results: list[dict[str, Any]]) -> None:
    """Checkpointing runs the layer twice a step (forward, recomputation); the tiled loss calls ``lm_head`` once per
    tile in the forward and again in the backward's recomputation."""
    plain = fsdp_two_rank_results[0]["sp2"]["calls"]
    options = fsdp_two_rank_results[0]["sp2_checkpointing_tiled_loss"]["calls"]
    assert plain == {"layer": STEPS, "lm_head": STEPS}
    assert options == {"layer": 2 * STEPS, "lm_head": 2 * 3 * STEPS}


def test_fsdp_resume_loads_the_distributed_checkpoint(fsdp_two_rank_results: list[dict[str, Any]]) -> None:
    assert all(r["sp2_resumed_after_step_1"]["resumed"] for r in fsdp_two_rank_results)


@FOUR_RANKS.each_case
def test_fsdp_four_ranks_equal_single_process(fsdp_four_rank_results: list[dict[str, Any]], name: str) -> None:
    _check(fsdp_four_rank_results, name, FOUR_RANKS.cases[name])


def test_sharding_units_and_the_refusal_of_parameters_outside_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decoder layer, the embeddings (one unit), then the decoder as the root; a trainable head beside the model,
    whose gradients FSDP2 would not reduce, is refused before anything is sharded, naming it."""
    from lightning_ulysses import fsdp_strategy

    sharded: list[Any] = []
    monkeypatch.setattr(fsdp_strategy, "fully_shard", lambda module, **kwargs: sharded.append(module))
    llama = tiny_llama()
    module = torch.nn.ModuleDict({"model": llama, "head": torch.nn.Linear(4, 1)})
    with pytest.raises(ValueError, match=r"outside them.*: head\.weight, head\.bias\. Freeze them"):
        fsdp_strategy.shard_transformers_models(module, mesh=None)  # type: ignore[arg-type]
    assert sharded == []
    module["head"].requires_grad_(False)  # frozen: the same on every rank, nothing to reduce
    fsdp_strategy.shard_transformers_models(module, mesh=None)  # type: ignore[arg-type]
    layers = list(llama.model.layers)
    assert sharded == [*layers, [llama.model.embed_tokens, llama.lm_head], llama.model]


def test_nonfinite_loss_skip_is_refused() -> None:
    with pytest.raises(ValueError, match="nonfinite_loss='skip' relies on DeepSpeed"):
        UlyssesFSDPStrategy(nonfinite_loss="skip")
