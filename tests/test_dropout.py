"""Dropout under SP draws what one process draws, in distribution (:mod:`lightning_ulysses.hf.dropout`).

One launch of 2 CPU processes (sp=2) trains a tiny GPT-NeoX with hidden and attention dropout p=0.5 for 2 steps,
recording every dropout mask its forwards draw: the ``nn.Dropout`` masks (embeddings, attention and MLP outputs) of
each rank's half of the sequence, and the attention-dropout masks of each rank's heads (replayed from the generator
state each attention call started from). Every mask keeps ``1 - p`` of its elements, and the masks of the two shards
of one sequence, of heads on different ranks and of successive steps are independent (they agree on about half of
their elements, where a shared generator makes them agree on all). The forward leaves the shared generator alone.
With activation checkpointing the recompute draws the forward's masks: the update equals the one without. A model
with LayerDrop is refused at set-up on CPU.

The statistics run on ~8k-16k elements per comparison with fixed seeds: each bound is more than 5 standard deviations
of a fair binomial, so the test cannot flake, and a shared stream (agreement 1.0) fails it by far.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_ulysses import UlyssesStrategy
from lightning_ulysses.hf.dropout import SequenceParallelRNG, layerdrop_refusal, stream_seed
from tests.launch import launch
from tests.test_strategy import _error, _trainer
from tests.tiny import TinyCausalLM, collate, make_samples, tiny_llama

SEQ, NUM, BATCH, STEPS, P = 64, 4, 2, 2, 0.5
WORLD_SIZE = 2
SEED = 1234
MODEL = dict(model_type="gpt_neox", hidden_dropout=P, attention_dropout=P)


class AttentionDropoutMasks:
    """Wraps ``F.scaled_dot_product_attention``: for each call with dropout, the keep mask that call drew, replayed
    from the generator state it started from with the identity as values (``out[..., i, j] = keep_ij * p_ij /
    (1 - p)``), and checked to give the call's own output."""

    def __init__(self) -> None:
        self.masks: list[tuple[Tensor, Tensor]] = []  # (kept, attended): [B, H, L, S] bool
        self.original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self  # type: ignore[assignment]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *args: Any, dropout_p: float = 0.0, **kwargs: Any) -> Tensor:
        if not dropout_p:
            return self.original(q, k, v, *args, dropout_p=dropout_p, **kwargs)
        state = torch.get_rng_state()
        out = self.original(q, k, v, *args, dropout_p=dropout_p, **kwargs)
        identity = torch.eye(k.shape[-2]).expand(*k.shape[:-1], k.shape[-2])
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            replayed = self.original(q, k, identity, *args, dropout_p=dropout_p, **kwargs)
            attended = self.original(q, k, identity, *args, dropout_p=0.0, **kwargs) > 0
            values = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            torch.testing.assert_close(replayed @ values, out.detach(), rtol=1e-5, atol=1e-6)
        self.masks.append((replayed != 0, attended))
        return out

    def restore(self) -> None:
        F.scaled_dot_product_attention = self.original


class DropoutLM(TinyCausalLM):
    """Records the masks of every ``nn.Dropout`` of its model and whether the forward touched the shared generator."""

    def __init__(self, attention: AttentionDropoutMasks | None = None) -> None:
        super().__init__(lr=0.1, **MODEL)
        self.attention = attention
        self.masks: list[dict[str, tuple[Tensor, Tensor]]] = []  # per forward: module -> (kept, input nonzero)
        self.mlp_dropout_calls = 0
        self.shared_untouched: list[bool] = []
        for name, module in self.model.named_modules():
            if isinstance(module, nn.Dropout):
                module.register_forward_hook(self._record(name))
        # a pre-hook: a recompute stops inside the layer's last op that saves a tensor (torch's early stop)
        self.model.gpt_neox.layers[0].post_mlp_dropout.register_forward_pre_hook(self._count_mlp_dropout)

    def _record(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            if module.training and self.masks:  # not the set-up check's training-mode probe, before any step
                self.masks[-1][name] = (output.detach() != 0, inputs[0].detach() != 0)

        return hook

    def _count_mlp_dropout(self, module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
        self.mlp_dropout_calls += module.training and bool(self.masks)

    def on_train_start(self) -> None:
        if self.attention is not None:  # drawn by the set-up check's training-mode probe, before any step
            self.attention.masks.clear()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.masks.append({})
        shared = torch.get_rng_state()
        loss = super().training_step(batch, batch_idx)
        self.shared_untouched.append(torch.equal(shared, torch.get_rng_state()))
        return loss


def worker(args: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    samples = make_samples(NUM, SEQ)
    for checkpointed in (False, True):
        L.seed_everything(SEED)
        attention = AttentionDropoutMasks()
        module = DropoutLM(attention)
        strategy = UlyssesStrategy(
            sp_size=2, stage=2, attn_implementation="sdpa", activation_checkpointing=checkpointed
        )
        loader = torch.utils.data.DataLoader(samples, batch_size=BATCH, collate_fn=collate)
        _trainer(WORLD_SIZE, strategy, max_steps=STEPS).fit(module, loader)
        attention.restore()
        result["checkpointed" if checkpointed else "plain"] = {
            "params": {n: p.detach().clone() for n, p in module.model.named_parameters()},
            "mlp_dropout_calls": module.mlp_dropout_calls,
            "masks": module.masks if not checkpointed else None,
            "attention": attention.masks if not checkpointed else None,
            "shared_untouched": module.shared_untouched,
        }
    layerdrop = TinyCausalLM(model_type="opt", layerdrop=0.25)
    strategy = UlyssesStrategy(sp_size=2, stage=2, attn_implementation="sdpa")
    loader = torch.utils.data.DataLoader(samples, batch_size=BATCH, collate_fn=collate)
    result["layerdrop"] = _error(lambda: _trainer(WORLD_SIZE, strategy, max_steps=STEPS).fit(layerdrop, loader))
    result["layerdrop_steps"] = len(layerdrop.losses)
    return result


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch("tests.test_dropout:worker", WORLD_SIZE, {})


def _agreement(a: Tensor, b: Tensor, where: Tensor) -> tuple[float, int]:
    """The fraction of the elements ``where`` is true at which masks ``a`` and ``b`` agree, and their count."""
    return float((a == b)[where].float().mean()), int(where.sum())


def _within_binomial(fraction: float, count: int, expected: float) -> bool:
    """``fraction`` of ``count`` fair draws is within 6 standard deviations of ``expected``."""
    return abs(fraction - expected) < 6 * (expected * (1 - expected) / count) ** 0.5


@pytest.mark.distributed
def test_every_dropout_mask_keeps_one_minus_p(results: list[dict[str, Any]]) -> None:
    for result in results:
        plain = result["plain"]
        kept = torch.cat([k[nonzero] for step in plain["masks"] for k, nonzero in step.values()])
        assert kept.numel() > 8000 and _within_binomial(float(kept.float().mean()), kept.numel(), 1 - P)
        heads = torch.cat([k[attended] for k, attended in plain["attention"]])
        assert heads.numel() > 8000 and _within_binomial(float(heads.float().mean()), heads.numel(), 1 - P)


@pytest.mark.distributed
def test_the_two_shards_of_a_sequence_draw_independent_masks(results: list[dict[str, Any]]) -> None:
    first, second = (r["plain"]["masks"] for r in results)
    assert [step.keys() for step in first] == [step.keys() for step in second]
    assert len(first[0]) == 5  # the embeddings', and each layer's attention and MLP output dropout
    pairs = [(first[s][m], second[s][m]) for s in range(STEPS) for m in first[s]]
    a = torch.cat([kept.flatten() for (kept, _), _ in pairs])
    b = torch.cat([kept.flatten() for _, (kept, _) in pairs])
    where = torch.cat([(n0 & n1).flatten() for (_, n0), (_, n1) in pairs])
    agreement, count = _agreement(a, b, where)
    assert count > 8000 and _within_binomial(agreement, count, 0.5), agreement  # a shared stream: 1.0


@pytest.mark.distributed
def test_heads_on_different_ranks_draw_independent_attention_masks(results: list[dict[str, Any]]) -> None:
    first, second = (r["plain"]["attention"] for r in results)
    assert len(first) == len(second) == 2 * STEPS  # 2 layers
    a = torch.cat([kept.flatten() for kept, _ in first])
    b = torch.cat([kept.flatten() for kept, _ in second])
    where = torch.cat([(a0 & a1).flatten() for (_, a0), (_, a1) in zip(first, second)])
    agreement, count = _agreement(a, b, where)
    assert count > 8000 and _within_binomial(agreement, count, 0.5), agreement  # a shared stream: 1.0


@pytest.mark.distributed
def test_each_step_draws_new_masks_and_leaves_the_shared_generator_alone(results: list[dict[str, Any]]) -> None:
    for result in results:
        plain = result["plain"]
        steps = plain["masks"]
        a = torch.cat([k.flatten() for k, _ in steps[0].values()])
        b = torch.cat([k.flatten() for k, _ in steps[1].values()])
        where = torch.cat([(n0 & n1).flatten() for (_, n0), (_, n1) in zip(steps[0].values(), steps[1].values())])
        agreement, count = _agreement(a, b, where)
        assert _within_binomial(agreement, count, 0.5), agreement
        assert plain["shared_untouched"] == [True] * STEPS
        assert result["checkpointed"]["shared_untouched"] == [True] * STEPS


@pytest.mark.distributed
def test_checkpointed_layers_recompute_the_masks_of_their_forward(results: list[dict[str, Any]]) -> None:
    for result in results:
        plain, checkpointed = result["plain"], result["checkpointed"]
        assert (plain["mlp_dropout_calls"], checkpointed["mlp_dropout_calls"]) == (STEPS, 2 * STEPS)  # recomputed
        initial = {n: p.detach() for n, p in tiny_llama(**MODEL).named_parameters()}
        for name, weight in plain["params"].items():
            update = weight - initial[name]
            error = (checkpointed["params"][name] - weight).norm() / update.norm()
            assert update.norm() > 0 and error < 1e-5, f"{name}: relative update difference {error:.2e}"


def test_sp_ranks_seed_streams_of_their_own() -> None:
    seeds = {stream_seed(SEED, rank) for rank in range(8)}
    assert len(seeds) == 8 and SEED not in seeds
    rng = SequenceParallelRNG(stream_seed(SEED, 0))
    torch.manual_seed(SEED)
    shared = torch.get_rng_state()
    cpu = torch.device("cpu")
    with rng.drawing(cpu):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), shared)  # back at the shared state
    with rng.drawing(cpu):
        second = torch.rand(4)  # the stream went on from where it stopped
    expected = torch.rand(8, generator=torch.Generator().manual_seed(stream_seed(SEED, 0)))
    assert torch.equal(torch.cat([first, second]), expected)


@pytest.mark.distributed
def test_layerdrop_is_refused_at_set_up_on_cpu(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["layerdrop"].startswith(
            "UnsupportedModelError: OPTForCausalLM uses LayerDrop (model.decoder.layerdrop=0.25)"
        ), result["layerdrop"]
        assert result["layerdrop_steps"] == 0


def test_layerdrop_is_refused_on_cpu_only() -> None:
    model = tiny_llama(model_type="opt", layerdrop=0.25)
    refusal = layerdrop_refusal(model, torch.device("cpu"))
    assert refusal is not None and "Set the config's layerdrop to 0, or train on CUDA GPUs" in refusal
    assert layerdrop_refusal(model, torch.device("cuda", 0)) is None
    assert layerdrop_refusal(tiny_llama(model_type="opt"), torch.device("cpu")) is None
