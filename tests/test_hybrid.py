"""Hybrid models whose token mixers run head-sharded (:mod:`lightning_ulysses.hf.mixers`) train exactly.

One family per sequential kernel (LFM2's short convolution, Mamba2's SSD scan, Jamba's Mamba scan, Qwen3-Next's
gated delta rule, Kimi delta attention, MiniMax's lightning attention, RecurrentGemma's convolution + RG-LRU, xLSTM's
mLSTM, RWKV's WKV and token shifts, ZAYA's CCA convolutions and delayed values), the zoo's tiny configs
(:mod:`tests.zoo_configs`), at sp=2 and sp=4, ZeRO-2 and ZeRO-3, dp=2 x sp=2, on packed documents whose borders fall
on and inside the shard borders, on rows of one long document and many short ones (the kernels' token count per
call is checked too), with head counts that do not divide by ``sp_size`` (inert head slots, groups replicated), and
under Ulysses x Ring (zigzag shards: ring 2 x Ulysses 2, dp 2 x ring 2 x Ulysses 1). Each case trains two SGD steps
with ``UlyssesStrategy`` and compares the losses (rtol 1e-5) and the update (< 1e-4) with one process running every
document of the plain model on its own. Both launches also check the token shift's halo
(:func:`~lightning_ulysses.hf.mixers.shift.shift_sequence`) against the shift of the whole rows. The zoo
(:mod:`tests.test_zoo`) covers every family at sp=2 and sp=4 on unpacked rows.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesStrategy
from lightning_ulysses.attention import Documents
from lightning_ulysses.flops import TransformerFlops
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf.mixers import KERNELS, kernels_called
from lightning_ulysses.hf.mixers.kernels import FUSED_LAYER_KERNELS
from lightning_ulysses.hf.mixers.mlstm import is_mlstm_backend, sharded_mlstm_forward
from lightning_ulysses.hf.mixers.shift import shift_sequence
from lightning_ulysses.sharding import positions_within_runs, shard_index
from lightning_ulysses.topology import SequenceParallelTopology
from tests.cases import CaseTable
from tests.tiny import (
    collate,
    cpu_trainer,
    epoch_order,
    gathered_parameters,
    make_packed_samples,
    reference_loss,
    relative_update_error,
)
from tests.zoo import LR, ZooModule, build_model
from tests.zoo_configs import SEQ_LEN, TinyRecipe, tiny_recipe

pytestmark = pytest.mark.distributed

ROWS, STEPS = 2, 2
# name -> case: family, sp, ZeRO stage, document borders forced on even rows (random ones besides), config overrides,
# the attention layers where the config's layer_types do not name them
TWO_RANKS = CaseTable(
    "two_rank_results",
    "tests.test_hybrid:fit_case",
    2,
    {
        "lfm2_zero3_packed": dict(family="lfm2", sp=2, stage=3, borders=(SEQ_LEN // 2,)),
        # as if mamba_ssm were installed: the training-only fused-layer kernel must not run on a shard
        "mamba2_zero3_packed_fused_kernel": dict(family="mamba2", sp=2, stage=3, borders=(SEQ_LEN // 2,), fused=True),
        "jamba_zero2_packed_fused_kernel": dict(family="jamba", sp=2, stage=2, borders=(SEQ_LEN // 2 - 1,), fused=True),
        "qwen3_next_zero3_packed": dict(family="qwen3_next", sp=2, stage=3, borders=(SEQ_LEN // 2,)),
        "kimi_linear_zero2_packed": dict(family="kimi_linear", sp=2, stage=2, borders=(SEQ_LEN // 2 + 1,)),
        "minimax_zero3_packed": dict(family="minimax", sp=2, stage=3, borders=(SEQ_LEN // 2,)),
        # the convolution and the RG-LRU in one head-sharded core; a border inside rank 1's shard
        "recurrent_gemma_zero3_packed": dict(family="recurrent_gemma", sp=2, stage=3, borders=(SEQ_LEN // 2, 21)),
        # one long document and many short ones: the kernels must not see every document padded to the longest
        "qwen3_next_zero2_skewed_packing": dict(family="qwen3_next", sp=2, stage=2, lengths=(17, 3, 3, 3, 3, 3)),
        "mamba2_zero2_skewed_packing": dict(family="mamba2", sp=2, stage=2, lengths=(2, 2, 21, 1, 3, 3)),
        "xlstm_zero3_packed": dict(family="xlstm", sp=2, stage=3, borders=(SEQ_LEN // 2, SEQ_LEN // 2 + 3)),
        # RWKV's token shifts take the token before each shard from the previous rank; a document of one token at the
        # shard border
        "rwkv_zero3_packed": dict(family="rwkv", sp=2, stage=3, borders=(SEQ_LEN // 2, SEQ_LEN // 2 + 1)),
        # ZAYA's CCA convolutions (10 heads) and its delayed values, next to its attention layers; with biases, the
        # delayed values of each document's first token are the bias; key scales of about 1 (0.02 at initialisation:
        # the queries and keys, which the convolutions compute, would barely matter)
        "zaya_zero3_packed_bias": dict(
            family="zaya",
            sp=2,
            stage=3,
            borders=(SEQ_LEN // 2 - 1, SEQ_LEN // 2),
            config=dict(attention_bias=True),
            scaled={"qk_norm.temp": 50.0},
            attention_layers=2,
        ),
    },
    also={"shift_errors": "tests.test_hybrid:shift_errors"},
)
FOUR_RANKS = CaseTable(
    "four_rank_results",
    "tests.test_hybrid:fit_case",
    4,
    {
        # 70 channels over 4 ranks: 18 channel slots per rank, 2 of them inert (and 5 attention heads, 1 key/value head)
        "lfm2_zero2_packed_70_channels": dict(
            family="lfm2",
            sp=4,
            stage=2,
            borders=(SEQ_LEN // 4, SEQ_LEN // 2),
            config=dict(hidden_size=70, num_attention_heads=5, num_key_value_heads=1),
        ),
        # 2 heads over 4 ranks: two inert head slots
        "mamba2_zero3_packed_2_heads": dict(
            family="mamba2",
            sp=4,
            stage=3,
            borders=(SEQ_LEN // 4, 3 * SEQ_LEN // 4),
            config=dict(num_heads=2, head_dim=64),
        ),
        "jamba_zero3_packed": dict(family="jamba", sp=4, stage=3, borders=(SEQ_LEN // 2, SEQ_LEN // 4 + 3)),
        "qwen3_next_dp2_sp2_zero3_packed": dict(family="qwen3_next", sp=2, dp=2, stage=3, borders=(SEQ_LEN // 2,)),
        # 6 value heads reading 3 key heads over 4 ranks: 2 value heads per rank, key heads split across ranks
        "qwen3_next_zero2_packed_6_heads": dict(
            family="qwen3_next",
            sp=4,
            stage=2,
            borders=(SEQ_LEN // 4, SEQ_LEN // 2),
            config=dict(linear_num_value_heads=6, linear_num_key_heads=3),
        ),
        # Ulysses x Ring (zigzag shards, chunks of SEQ_LEN / 4): borders on a ring-chunk border and inside a chunk
        "lfm2_ring2_ulysses2_zero2_packed": dict(
            family="lfm2", sp=4, ring=2, stage=2, borders=(SEQ_LEN // 4, 3 * SEQ_LEN // 8)
        ),
        "qwen3_next_dp2_ring2_ulysses1_zero3_skewed_packing": dict(
            family="qwen3_next", sp=2, dp=2, ring=2, stage=3, lengths=(3, 3, 17, 3, 3, 3)
        ),
        "mamba2_ring2_ulysses2_zero3_packed": dict(family="mamba2", sp=4, ring=2, stage=3, borders=(SEQ_LEN // 2, 5)),
        "minimax_ring2_ulysses2_zero2": dict(family="minimax", sp=4, ring=2, stage=2, lengths=(SEQ_LEN,)),
        # 2 mLSTM heads over 4 ranks (two inert head slots), under the ring
        "xlstm_ring2_ulysses2_zero2_packed_2_heads": dict(
            family="xlstm", sp=4, ring=2, stage=2, borders=(SEQ_LEN // 4, 3 * SEQ_LEN // 8), config=dict(num_heads=2)
        ),
        # 3 RG-LRU heads (and 3 attention heads) over 4 ranks: one inert head slot
        "recurrent_gemma_ring2_ulysses2_zero2_packed_3_heads": dict(
            family="recurrent_gemma",
            sp=4,
            ring=2,
            stage=2,
            borders=(SEQ_LEN // 4, 3 * SEQ_LEN // 8),
            config=dict(num_attention_heads=3, num_key_value_heads=1, lru_width=48),
        ),
        # the token before each zigzag shard lies on another ring rank (shards hold columns 0-7, 24-31, 8-15, 16-23)
        "rwkv_ring2_ulysses2_zero2_packed": dict(
            family="rwkv", sp=4, ring=2, stage=2, borders=(SEQ_LEN // 4, 3 * SEQ_LEN // 8 + 1)
        ),
        # 10 convolution heads over 4 ranks (3 slots each, 2 inert), attention over ring 2 x Ulysses 2
        "zaya_ring2_ulysses2_zero2_packed": dict(
            family="zaya",
            sp=4,
            ring=2,
            stage=2,
            borders=(SEQ_LEN // 2, 7),
            scaled={"qk_norm.temp": 50.0},
            attention_layers=2,
        ),
    },
    also={"shift_errors": "tests.test_hybrid:shift_errors"},
)


class HybridModule(ZooModule):
    """Also records the attention layers that the FLOP count of :class:`~lightning_ulysses.SequenceParallelMonitor`
    sees in the patched model."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.flop_attention_layers = TransformerFlops.from_model(self.model).num_layers
        return super().training_step(batch, batch_idx)


def attention_layers(recipe: TinyRecipe) -> int:
    """Softmax-attention layers of the config's layer pattern (RecurrentGemma's are sliding-window ones, ``"attention"``
    in transformers 5.17's ``layers_block_type``, which has no ``layer_types`` there; none without a pattern: xLSTM)."""
    config = recipe.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or []
    return sum(kind in ("full_attention", "sliding_attention", "attention") for kind in layer_types)


def recipe_of(case: dict[str, Any]) -> TinyRecipe:
    recipe = tiny_recipe(case["family"])
    config = copy.deepcopy(recipe.config)
    for key, value in case.get("config", {}).items():
        setattr(config, key, value)
    return dataclasses.replace(recipe, config=config)


def packed_samples(case: dict[str, Any], recipe: TinyRecipe) -> list[dict[str, Tensor]]:
    """``ROWS * STEPS * dp`` rows of 3-5 packed documents (the layout of :func:`tests.tiny.make_packed_samples`), or of
    documents of the case's ``lengths`` (rotated by one document per row), drawn from the family's ordinary token
    ids."""
    rows = ROWS * STEPS * case.get("dp", 1)
    if "lengths" in case:
        lengths = case["lengths"]
        samples = make_packed_samples(rows, SEQ_LEN)  # the token ids
        for i, sample in enumerate(samples):
            rotated = lengths[i % len(lengths) :] + lengths[: i % len(lengths)]
            sample["position_ids"] = torch.cat([torch.arange(n) for n in rotated])
    else:
        samples = make_packed_samples(rows, SEQ_LEN, borders=case["borders"])
    token_ids = torch.tensor(recipe.token_ids)
    return [{**s, "input_ids": token_ids[s["input_ids"] % len(token_ids)]} for s in samples]


def reference(case: dict[str, Any], initial: dict[str, Tensor]) -> tuple[list[list[float]], dict[str, Tensor]]:
    """Plain transformers, one process: every document on its own, token-mean next-token loss of each DP group's batch
    (its rows as Lightning's distributed sampler deals them, :func:`tests.tiny.epoch_order`), averaged over the DP
    groups, SGD. Returns each DP group's step losses and the final weights."""
    model, _ = build_model(recipe_of(case))
    model.load_state_dict(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dp = case.get("dp", 1)
    samples = packed_samples(case, recipe_of(case))
    losses: list[list[float]] = [[] for _ in range(dp)]
    for step in range(STEPS):
        total = 0.0
        for dp_rank in range(dp):
            rows = epoch_order(samples, dp, dp_rank, epoch=0)[step * ROWS : (step + 1) * ROWS]
            loss = reference_loss(model, collate(rows))  # each packed document run alone
            total = total + loss / dp
            losses[dp_rank].append(loss.item())
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def initial_weights(case: dict[str, Any]) -> dict[str, Tensor]:
    """The zoo's initial weights, those whose names end with a key of the case's ``scaled`` multiplied by its value."""
    model, _ = build_model(recipe_of(case))
    scaled = case.get("scaled", {})
    return {
        name: value.detach() * next((factor for key, factor in scaled.items() if name.endswith(key)), 1.0)
        for name, value in model.state_dict().items()
    }


def _fused_layer_kernel(model: torch.nn.Module) -> Callable[..., None]:
    """A stand-in for mamba_ssm's fused layer kernel: it must not run on a rank's shard under sequence parallelism;
    elsewhere (the set-up check's training-mode probe, sequence parallelism disabled) it is the torch fallback, which
    returns ``None``."""

    def kernel(*args: Any, **kwargs: Any) -> None:
        state = getattr(model, "_ulysses_state", None)
        if state is not None and state.sp_size > 1:
            raise AssertionError("a fused whole-layer Mamba kernel ran on this rank's shard under sequence parallelism")

    return kernel


class KernelTokens:
    """Counts the tokens (rows x sequence, per head slot) that the sequential kernels of a modeling module receive,
    per training call of the token mixer that calls them, next to the whole rows' token count of that call (the set-up
    check's calls, in eval mode or with sequence parallelism disabled, are not counted)."""

    def __init__(self, modeling: Any) -> None:
        self.modeling = modeling
        self.originals = {name: getattr(modeling, name) for name in KERNELS if hasattr(modeling, name)}
        self.calls: list[dict[str, Any] | None] = []  # per mixer call: whole-row tokens, kernel -> [tokens per call]
        for name, kernel in self.originals.items():
            setattr(modeling, name, self._counted(name, kernel))

    def _counted(self, name: str, kernel: Any) -> Any:
        spec, signature = KERNELS[name], inspect.signature(kernel)
        key = spec.head_count[0]
        sequence_axis = spec.heads[key].index("N")

        @functools.wraps(kernel)
        def counted(*args: Any, **kwargs: Any) -> Any:
            stream = signature.bind(*args, **kwargs).arguments[key]
            if self.calls and self.calls[-1] is not None:
                self.calls[-1]["kernels"].setdefault(name, []).append(stream.shape[0] * stream.shape[sequence_axis])
            return kernel(*args, **kwargs)

        return counted

    def watch(self, model: torch.nn.Module, sp_size: int) -> None:
        """Start a new count at every call of a token mixer of ``model``: ``[B, N/sp, C]`` hidden states in."""

        def new_call(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if not module.training or module._ulysses_state.sp_size == 1:  # the set-up check's calls
                self.calls.append(None)
                return
            hidden = next(t for t in (*args, *kwargs.values()) if isinstance(t, Tensor) and t.dim() == 3)
            self.calls.append({"tokens": hidden.shape[0] * hidden.shape[1] * sp_size, "kernels": {}})

        for module in model.modules():
            if kernels_called(module):
                module.register_forward_pre_hook(new_call, with_kwargs=True)

    def restore(self) -> None:
        for name, kernel in self.originals.items():
            setattr(self.modeling, name, kernel)


def fit_case(name: str, case: dict[str, Any], world_size: int, folder: str) -> dict[str, Any]:
    recipe = recipe_of(case)
    modeling = sys.modules[recipe.model_class.__module__]
    counter = KernelTokens(modeling)
    model, _ = build_model(recipe)  # the family's attention (eager where it has it), then the saved weights
    if case.get("fused"):  # mamba_ssm's fused layer kernel, which the layer calls first in training
        for kernel in FUSED_LAYER_KERNELS:
            if hasattr(modeling, kernel):
                setattr(modeling, kernel, _fused_layer_kernel(model))
    model.load_state_dict(torch.load(Path(folder) / f"{name}.pt"))
    counter.watch(model, case["sp"])
    module = HybridModule(model, loss_scale=1.0)
    strategy = UlyssesStrategy(
        sp_size=case["sp"], ring_size=case.get("ring", 1), stage=case["stage"], attn_implementation="sdpa"
    )
    trainer = cpu_trainer(world_size, strategy, max_steps=STEPS)
    loader = DataLoader(packed_samples(case, recipe), batch_size=ROWS, collate_fn=collate, shuffle=False)
    try:
        trainer.fit(module, loader)
    finally:
        counter.restore()
    return {
        "losses": module.losses,
        "params": gathered_parameters(module.model, case["stage"] == 3),
        "sharded_mixers": module.sharded_mixers,
        "flop_attention_layers": module.flop_attention_layers,
        "dp_rank": strategy.dp_rank,
        "ring_size": strategy.ring_size,
        "kernel_tokens": [call for call in counter.calls if call is not None],
    }


SHIFT_RING_SIZES = {2: (1, 2), 4: (1, 2, 4)}
"""The layouts of :func:`shift_errors` per world size: Ulysses, and Ulysses x Ring with one or two zigzag chunks per
shard."""


def shift_errors(world_size: int) -> dict[str, float]:
    """:func:`~lightning_ulysses.hf.mixers.shift.shift_sequence` on the shards of ``[2, 8 P, 3]`` rows of packed
    documents (a one-token document on the first shard border) against the shift of the whole rows: the largest
    absolute error of the output, of the input's gradient and of the fill's gradient, per ring size and shift."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    group, rank = dist.group.WORLD, dist.get_rank()
    seq_len = 8 * world_size
    starts = torch.zeros(2, seq_len, dtype=torch.bool)
    starts[:, 0] = starts[0, [seq_len // world_size, seq_len // world_size + 1, 5]] = starts[1, [3, seq_len - 2]] = True
    documents = Documents.from_position_ids(positions_within_runs(starts))
    generator = torch.Generator().manual_seed(0)
    x, weight = (torch.randn(2, seq_len, 3, generator=generator) for _ in range(2))
    errors = {}
    for ring_size in SHIFT_RING_SIZES[world_size]:
        for shift in (1, 2):
            fill = torch.randn(3, generator=generator)
            whole = x.clone().requires_grad_()
            whole_fill = fill.clone().requires_grad_()
            source = torch.arange(seq_len) - shift
            same = (source >= 0) & (documents.document_ids == documents.document_ids[:, source.clamp(min=0)])
            expected = torch.where(same[..., None], whole[:, source.clamp(min=0)], whole_fill)
            (expected * weight).sum().backward()

            columns = shard_index(seq_len, rank, world_size, ring_size)
            local = x[:, columns].clone().requires_grad_()
            local_fill = fill.clone().requires_grad_()
            topology = SequenceParallelTopology(world_size, world_size, rank, ring_size)
            groups = SequenceParallelGroups.create(topology, "cpu")
            shifted = shift_sequence(local, shift, groups, documents, local_fill)
            (shifted * weight[:, columns]).sum().backward()
            fill_grad = local_fill.grad.clone()
            dist.all_reduce(fill_grad, group=group)
            errors[f"ring {ring_size}, shift {shift}"] = max(
                (shifted - expected[:, columns]).abs().max().item(),
                (local.grad - whole.grad[:, columns]).abs().max().item(),
                (fill_grad - whole_fill.grad).abs().max().item(),
            )
    return errors


def save_initial_weights(cases: Mapping[str, dict[str, Any]], folder: Path) -> dict[str, Any]:
    """Each case's initial weights, ``folder/<name>.pt``: every rank and the reference start from them."""
    for name, case in cases.items():
        torch.save(initial_weights(case), folder / f"{name}.pt")
    return {"folder": str(folder)}


two_rank_results = TWO_RANKS.fixture(prepare=save_initial_weights)
four_rank_results = FOUR_RANKS.fixture(prepare=save_initial_weights)


def _check(results: list[dict[str, Any]], name: str, case: dict[str, Any]) -> None:
    initial = initial_weights(case)
    expected_losses, weights = reference(case, initial)
    initial = {key: initial[key] for key in weights}
    for rank, result in enumerate(results):
        got = result[name]
        assert got["sharded_mixers"] > 0, f"{name}: no token mixer ran head-sharded"
        expected_layers = case.get("attention_layers", attention_layers(recipe_of(case)))
        assert got["flop_attention_layers"] == expected_layers, "FLOPs count mixers as attention"
        assert got["ring_size"] == case.get("ring", 1)
        expected = expected_losses[got["dp_rank"]]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
        error = relative_update_error(initial, weights, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"


@pytest.mark.parametrize("ranks", ["two_rank_results", "four_rank_results"])
def test_token_shift_takes_the_tokens_before_each_shard(request: pytest.FixtureRequest, ranks: str) -> None:
    """The halo of a token shift comes from the rank holding it, zigzag shards included, and no token reads across
    a document start; gradients go back to the owners."""
    for rank, result in enumerate(request.getfixturevalue(ranks)):
        errors = result["shift_errors"]
        assert len(errors) == 2 * len(SHIFT_RING_SIZES[len(request.getfixturevalue(ranks))]), errors
        assert max(errors.values()) < 1e-6, f"rank {rank}: {errors}"


@TWO_RANKS.each_case
def test_two_ranks_equal_single_process(two_rank_results: list[dict[str, Any]], name: str) -> None:
    _check(two_rank_results, name, TWO_RANKS.cases[name])


@FOUR_RANKS.each_case
def test_four_ranks_equal_single_process(four_rank_results: list[dict[str, Any]], name: str) -> None:
    _check(four_rank_results, name, FOUR_RANKS.cases[name])


def test_an_mlstm_state_handed_in_is_refused() -> None:
    """xLSTM's backends are recognised by the kernels they hold (not its layers or blocks), and their sharded forward
    refuses an initial state (a cache, or eval-mode chunked inference) before any collective."""
    model, _ = build_model(tiny_recipe("xlstm"))
    backends = [name for name, module in model.named_modules() if is_mlstm_backend(module)]
    assert backends == [f"backbone.blocks.{i}.mlstm_layer.mlstm_backend" for i in range(model.config.num_blocks)]
    backend = model.get_submodule(backends[0])
    forward = sharded_mlstm_forward(backend, lambda: pytest.fail("reached the all-to-all"), lambda: None)
    heads, n, dim = model.config.num_heads, 8, 4
    q, k, v = (torch.zeros(1, heads, n, dim) for _ in range(3))
    gates = torch.zeros(1, heads, n)
    with pytest.raises(ValueError, match="empty state .*c_initial.*max_inference_chunksize"):
        forward(q, k, v, gates, gates, c_initial=torch.zeros(1, heads, dim, dim))


SKEWED = [name for name, case in {**TWO_RANKS.cases, **FOUR_RANKS.cases}.items() if len(case.get("lengths", ())) > 1]


@pytest.mark.parametrize("name", SKEWED)
def test_packed_documents_cost_the_kernels_at_most_twice_the_tokens(request: pytest.FixtureRequest, name: str) -> None:
    """One long document next to many short ones: inside every mixer call its kernels receive at most ``2 N`` tokens
    per head slot (``N`` the whole rows' tokens), not every document padded to the longest (3-4x here); packed rows
    run one call per length class."""
    results = request.getfixturevalue("two_rank_results" if name in TWO_RANKS.cases else "four_rank_results")
    for rank, result in enumerate(results):
        calls = result[name]["kernel_tokens"]
        assert calls and all(call["kernels"] for call in calls), f"rank {rank}: the kernels were not counted"
        for call in calls:
            for kernel, tokens in call["kernels"].items():
                assert sum(tokens) <= 2 * call["tokens"], f"rank {rank}: {kernel} got {tokens} for {call['tokens']}"
        assert max(len(tokens) for call in calls for tokens in call["kernels"].values()) > 1, "no length classes ran"


def test_the_constant_padding_shifts_are_recognised() -> None:
    from lightning_ulysses.hf.mixers.shift import sequence_shift_of

    assert sequence_shift_of(nn.ZeroPad2d((0, 0, 2, -2))) == 2
    assert sequence_shift_of(nn.ConstantPad2d((0, 0, 1, -1), 0.5)) == 1
    assert sequence_shift_of(nn.ZeroPad2d((1, 0, 1, -1))) is None  # also pads the channels
    assert sequence_shift_of(nn.ReflectionPad2d((0, 0, 1, 0))) is None
