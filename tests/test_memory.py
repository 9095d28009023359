"""Long-context memory options change memory, never results.

Each option (tiled MLP, tiled logits + loss, activation checkpointing, CPU offload), alone and all
together, trains a tiny Llama under ``UlyssesStrategy(sp_size=2)`` on two CPU processes and must equal
one process of plain transformers on whole sequences: every micro-batch loss (rtol 1e-5) and the final
weights (``|update - reference update| / |reference update| < 1e-4``; a factor of 2 in any gradient
gives an error near 1). Tile counts that do not divide the tokens, more tiles than tokens and a shard
without a valid token are among the cases. The building blocks are checked on their own, in one
process, against their untiled computation. Six families whose feed-forwards and norms are found by behaviour
(mixture-of-experts blocks, feed-forwards under other names, gated norms, LayerNorms) train one step with every
option on under ZeRO-3, each against one process of its plain model.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_ulysses import UlyssesStrategy
from lightning_ulysses.logits import tiled_cross_entropy_sum
from lightning_ulysses.memory import (
    MemoryOptions,
    apply_memory_options,
    remove_memory_options,
    resolve_num_tiles,
    tiled_map,
)
from tests.cases import CaseTable
from tests.launch import launch
from tests.test_equivalence import BATCH, LR, SEQ, STEPS, _fit
from tests.test_offload import offloaded_off_a_device
from tests.tiny import (
    VOCAB,
    TinyCausalLM,
    cpu_trainer,
    make_samples,
    reference_training,
    relative_update_error,
    tiny_llama,
)

pytestmark = pytest.mark.distributed

ALL = dict(tiled_mlp=3, tiled_loss=5, activation_checkpointing=True, offload_activations=True)
# 2 rows x SEQ / 2 = 24 tokens per rank; 5 and 7 tiles do not divide them, 30 tiles leave some empty
CASES: dict[str, dict[str, Any]] = {
    "tiled_mlp_5": dict(sp=2, stage=2, memory=dict(tiled_mlp=5)),
    "tiled_mlp_30_some_empty": dict(sp=2, stage=2, memory=dict(tiled_mlp=30)),
    "tiled_loss_7": dict(sp=2, stage=2, memory=dict(tiled_loss=7)),
    "activation_checkpointing": dict(sp=2, stage=2, memory=dict(activation_checkpointing=True)),
    "checkpointing_offload": dict(sp=2, stage=2, memory=dict(activation_checkpointing=True, offload_activations=True)),
    "all_zero3": dict(sp=2, stage=3, memory=ALL),
    # head-chunked attention (chunks of one head) inside checkpointed layers: three attention forwards per layer
    "all_zero3_head_chunks2": dict(sp=2, stage=3, memory=dict(ALL, head_chunks=2)),
    "all_rank_without_valid_tokens": dict(sp=2, stage=2, memory=ALL, data=dict(masked_spans=[(SEQ // 2 - 1, SEQ)])),
    "fused_norms_zero1": dict(sp=2, stage=1, memory=dict(fused_norms=True)),
    "fused_norms_checkpointing_zero2": dict(
        sp=2, stage=2, memory=dict(fused_norms=True, activation_checkpointing=True)
    ),
    "all_fused_norms_zero3_head_chunks2": dict(sp=2, stage=3, memory=dict(ALL, fused_norms=True, head_chunks=2)),
    # offloaded as off a device (CPU tensors playing CUDA ones): the layers' recomputation takes the chunks' kept output
    "all_zero3_head_chunks2_offloaded": dict(sp=2, stage=3, memory=dict(ALL, head_chunks=2), offloaded=True),
    # 47 tokens -> 24 per rank, 48 per rank and batch: auto makes 2 MLP tiles of hidden_size=32 tokens and 5 loss
    # tiles of 10 tokens (vocabulary 61, fp32: 10 * 61 * 12 bytes <= 61 * 32 * 4; under ZeRO-3 the vocabulary is
    # read from the partitioned lm_head's ds_shape)
    "all_auto_length_not_divisible": dict(
        sp=2,
        stage=3,
        data=dict(seq_len=2 * SEQ - 1),
        memory=dict(tiled_mlp=True, tiled_loss=True, activation_checkpointing=True, offload_activations=True),
    ),
}


class MemoryTinyCausalLM(TinyCausalLM):
    """TinyCausalLM through the one-call HF path, which takes the tiled loss when the strategy asks for it; counts
    ``lm_head``'s calls in training (``lm_head_calls``, recomputations included)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lm_head_calls = 0
        self.model.lm_head.register_forward_hook(lambda *_: self._count_lm_head())

    def _count_lm_head(self) -> None:
        self.lm_head_calls += 1

    def on_train_start(self) -> None:  # the set-up checks ran the model before
        self.lm_head_calls = 0

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.forward_causal_lm_loss(self.model, batch)
        self.losses.append(loss.item())
        return loss


def fit_case(name: str, case: dict[str, Any], world_size: int) -> dict[str, Any]:
    modules: list[MemoryTinyCausalLM] = []

    class Kept(MemoryTinyCausalLM):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            modules.append(self)

    with offloaded_off_a_device(case.get("offloaded", False)):
        result = _fit(case, world_size, module_class=Kept, strategy_kwargs=case["memory"])
    return {**result, "lm_head_calls": modules[0].lm_head_calls}


TABLE = CaseTable("results", "tests.test_memory:fit_case", 2, CASES)
results = TABLE.fixture()


@TABLE.each_case
def test_option_equals_single_process(results: list[dict[str, Any]], name: str) -> None:
    case = CASES[name]
    data = {"num": 16, "seq_len": SEQ, **case.get("data", {})}
    expected_losses, expected = reference_training(make_samples(**data), steps=STEPS, batch_size=BATCH, lr=LR)
    initial = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    for rank, result in enumerate(results):
        got = result[name]
        assert got["steps"] == STEPS
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"


@pytest.mark.parametrize(
    ("name", "calls_per_tile"),
    [("tiled_loss_7", 1), ("all_rank_without_valid_tokens", 1), ("all_zero3", 2), ("all_zero3_head_chunks2", 2)],
)
def test_tiled_loss_runs_lm_head_once_per_tile_where_its_weight_is_whole(
    results: list[dict[str, Any]], name: str, calls_per_tile: int
) -> None:
    """ZeRO-2 keeps lm_head's weight whole on the rank: each tile's backward runs in the forward (the fused loss), so
    lm_head runs once per tile and step; ZeRO-3 partitions it: each tile runs again in the backward."""
    tiles = CASES[name]["memory"]["tiled_loss"]
    for result in results:
        assert result[name]["lm_head_calls"] == calls_per_tile * tiles * STEPS


# ----------------------------------------------------------------------------------------------
# the building blocks, one process
# ----------------------------------------------------------------------------------------------
def relative_error(got: Tensor, expected: Tensor) -> float:
    assert expected.norm() > 0, "the reference is zero; the comparison would prove nothing"
    return ((got - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("num_tiles", [1, 3, 5, 40])
def test_tiled_map_equals_untiled(num_tiles: int) -> None:
    mlp = tiny_llama().model.layers[0].mlp
    x = torch.randn(2, 7, 32, requires_grad=True)  # 14 tokens: 3 and 5 tiles do not divide them, 40 leave empty tiles
    upstream = torch.randn(2, 7, 32)

    expected = mlp(x)
    expected_grads = torch.autograd.grad(expected, [x, *mlp.parameters()], upstream)
    got = tiled_map(mlp, x, num_tiles)
    got_grads = torch.autograd.grad(got, [x, *mlp.parameters()], upstream)

    assert got.shape == expected.shape
    assert relative_error(got, expected) < 1e-6
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert relative_error(g, e) < 1e-5


@pytest.mark.parametrize("num_tiles", [1, 4, 40])
def test_tiled_cross_entropy_sum_equals_untiled(num_tiles: int) -> None:
    lm_head = torch.nn.Linear(32, VOCAB, bias=False)
    hidden = torch.randn(2, 7, 32, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 7))
    labels[0, 2:5] = -100

    expected = F.cross_entropy(lm_head(hidden).flatten(0, 1), labels.flatten(), reduction="sum")
    expected_grads = torch.autograd.grad(expected * 3.0, [hidden, lm_head.weight])  # a later scale reaches lm_head too
    got = tiled_cross_entropy_sum(hidden, lm_head, labels, num_tiles)
    got_grads = torch.autograd.grad(got * 3.0, [hidden, lm_head.weight])

    assert relative_error(got, expected) < 1e-6
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert relative_error(g, e) < 1e-5


def test_tiled_cross_entropy_sum_without_valid_labels_is_zero() -> None:
    lm_head = torch.nn.Linear(32, VOCAB, bias=False)
    hidden = torch.randn(1, 5, 32, requires_grad=True)
    loss = tiled_cross_entropy_sum(hidden, lm_head, torch.full((1, 5), -100), num_tiles=2)
    loss.backward()
    assert loss.item() == 0.0
    assert hidden.grad.abs().max() == 0 and lm_head.weight.grad.abs().max() == 0


def test_options_on_hf_model_equal_plain_and_are_removable() -> None:
    ids = torch.randint(1, VOCAB, (2, 23))
    positions = torch.arange(23).expand(2, -1)

    def loss_and_grads(model: torch.nn.Module) -> tuple[Tensor, list[Tensor]]:
        logits = model(input_ids=ids, position_ids=positions).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        return loss, list(torch.autograd.grad(loss, list(model.parameters())))

    expected_loss, expected_grads = loss_and_grads(tiny_llama().train())
    model = tiny_llama().train()
    apply_memory_options(model, MemoryOptions(**ALL))
    layer = model.model.layers[0]
    assert layer.gradient_checkpointing and "forward" in layer.mlp.__dict__
    loss, grads = loss_and_grads(model)
    assert relative_error(loss, expected_loss) < 1e-6
    for g, e in zip(grads, expected_grads, strict=True):
        assert relative_error(g, e) < 1e-5

    remove_memory_options(model)
    assert not layer.gradient_checkpointing and "forward" not in layer.mlp.__dict__


def test_auto_tiles_follow_the_tokens() -> None:
    assert resolve_num_tiles(True, num_tokens=100, tile_tokens=32, device=torch.device("cpu")) == 4
    assert resolve_num_tiles(True, num_tokens=0, tile_tokens=32, device=torch.device("cpu")) == 1
    assert resolve_num_tiles(7, num_tokens=3, tile_tokens=32, device=torch.device("cpu")) == 7
    assert resolve_num_tiles(False, num_tokens=10**6, tile_tokens=32, device=torch.device("cpu")) == 1


def agree_worker(args: dict[str, Any]) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        tokens = args["tokens"][dist.get_rank()]
        return resolve_num_tiles(True, num_tokens=tokens, tile_tokens=32, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_auto_tiles_agree_across_ranks() -> None:
    # ranks with different token counts (e.g. DP groups with different lengths) must still run the same number
    # of tiled calls: under ZeRO-3 each call gathers parameters collectively
    assert launch("tests.test_memory:agree_worker", 2, {"tokens": [40, 300]}) == [10, 10]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tiled_mlp=0), "tiled_mlp must be"),
        (dict(tiled_loss=-2), "tiled_loss must be"),
        (dict(tiled_mlp="4"), "tiled_mlp must be"),
        (dict(offload_activations=True), "set activation_checkpointing=True"),
    ],
)
def test_bad_options_are_refused_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        UlyssesStrategy(sp_size=2, **kwargs)


def test_options_on_a_module_without_transformers_model_are_refused() -> None:
    with pytest.raises(ValueError, match="tiled_map"):
        apply_memory_options(torch.nn.Sequential(torch.nn.Linear(4, 4)), MemoryOptions(tiled_mlp=2))


@pytest.mark.cuda  # offloading to CPU saves memory on a GPU only
def test_offload_moves_checkpointed_inputs_off_the_gpu() -> None:
    ids = torch.randint(1, VOCAB, (1, 4096), device="cuda")
    positions = torch.arange(4096, device="cuda")[None]
    stored, grads = {}, {}
    for offload in (False, True):
        model = tiny_llama(num_hidden_layers=4).cuda().train()
        apply_memory_options(model, MemoryOptions(activation_checkpointing=True, offload_activations=offload))
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, position_ids=positions).logits.float().logsumexp(-1).mean()
        stored[offload] = torch.cuda.memory_allocated() - before
        grads[offload] = torch.autograd.grad(loss, list(model.parameters()))
    layer_inputs = 4 * 4096 * 32 * 4  # layers x tokens x hidden x fp32 bytes
    assert stored[False] - stored[True] >= 0.9 * layer_inputs
    for g, e in zip(grads[True], grads[False], strict=True):
        assert relative_error(g, e) < 1e-5


def test_benchmark_runs_in_quick_mode(tmp_path: Path) -> None:
    from benchmarks.memory import main
    from benchmarks.memory_model import BENCHMARK, peak_bytes_per_token

    peaks, longest = main(["--quick", "--out", str(tmp_path)])
    # large margins: the measured ratios are ~0.5 and ~0.3; a broken measurement or option gives ~1
    assert peaks["plain", 2, 512] < 0.75 * peaks["plain", 1, 512]
    assert peaks["all", 1, 512] < 0.75 * peaks["plain", 1, 512]
    # the analytic model of docs/memory.md: peak bytes per token of the plain step (fp32), measured as the slope;
    # RSS slopes measured 1.09 to 1.107 of it here on 2026-12-04 (the same before and after that day's changes)
    slope = (peaks["plain", 1, 512] - peaks["plain", 1, 256]) / 256
    assert 0.85 < slope / peak_bytes_per_token(BENCHMARK, element_bytes=4) < 1.15
    # the probe brackets the budget (64 MiB) between lengths it ran: plain sp=1 needs ~54 MiB at 256, ~107 at 512
    budget = 64 * 2**20
    fit, miss = longest["plain", 1]
    assert peaks["plain", 1, 256] <= budget < peaks["plain", 1, 512] and 256 <= fit < miss <= 512
    assert longest["all", 2] == (512, None)  # fits up to the probe's maximum
    table = (tmp_path / "memory.md").read_text()
    assert "| plain | 1 |" in table and "| all | 2 |" in table and f"| {fit}, {miss} |" in table
    ratios = " | ".join(f"{peaks['all', 2, n] / peaks['all', 1, n]:.3f}" for n in (256, 512))
    assert "## Peak against sp\n\n| config | N=256: sp=2 / sp=1 | N=512: sp=2 / sp=1 |" in table
    assert f"| all | {ratios} |" in table
    assert (tmp_path / "memory.png").stat().st_size > 0


# ----------------------------------------------------------------------------------------------
# families with every memory option on, sp=2 under ZeRO-3, against one process of the plain model
# ----------------------------------------------------------------------------------------------
FAMILY_OPTIONS = dict(tiled_mlp=3, activation_checkpointing=True, offload_activations=True, fused_norms=True)
# what each option must be found acting on in the family (an MoE block, a feed-forward under another name, a gated
# norm, LayerNorms), read from the strategy's report
FAMILIES: dict[str, list[str]] = {
    "gpt_oss": ["model.layers.*.mlp (GptOssMLP) x2 tiled"],
    "mixtral": ["model.layers.*.mlp (MixtralSparseMoeBlock) x2 tiled"],
    "lfm2": ["model.layers.*.feed_forward (Lfm2MLP) x2 tiled"],
    "granitemoehybrid": [
        "model.layers.*.block_sparse_moe (GraniteMoeHybridMoE) x2",
        "(GraniteMoeHybridRMSNormGated) x2",
    ],
    "falcon_h1": ["model.layers.*.feed_forward (FalconH1MLP) x2 tiled"],
    "cohere": ["model.layers.*.input_layernorm (CohereLayerNorm) x2", "fused"],
}


def families_worker(args: dict[str, Any]) -> dict[str, tuple[float, float, str]]:
    """Each family trained one step under UlyssesStrategy(sp_size=2, stage=3, every memory option), with tests.zoo's
    data and plain one-process reference: the loss's and the update's relative errors, and the strategy's report."""
    from torch.utils.data import DataLoader

    from tests.tiny import collate, gathered_parameters
    from tests.zoo import (
        COLLECTIVE_TIMEOUT,
        ROWS,
        ZooEntry,
        ZooModule,
        _free_process_groups,
        _quiet,
        make_samples,
        prepare,
    )

    _quiet()
    outcomes = {}
    for family in args["families"]:
        with tempfile.TemporaryDirectory() as folder:  # the reference's save_pretrained folder (the zoo's harness)
            prepared = prepare(ZooEntry(family, family), Path(folder))
        assert prepared.recipe is not None and not prepared.not_built and not prepared.reference_failed, family
        assert prepared.reference_loss is not None
        model = prepared.recipe.build(prepared.attn_implementation, 0)
        model.load_state_dict(prepared.initial)
        module = ZooModule(model, 1.0)
        strategy = UlyssesStrategy(
            sp_size=2, stage=3, attn_implementation="sdpa", timeout=COLLECTIVE_TIMEOUT, **FAMILY_OPTIONS
        )
        trainer = cpu_trainer(2, strategy, max_steps=1)
        try:
            loader = DataLoader(make_samples(prepared.recipe.token_ids), batch_size=ROWS, collate_fn=collate)
            trainer.fit(module, loader)
            got = gathered_parameters(module.model, zero_stage_3=True)
        finally:
            _free_process_groups(strategy)
        initial = {name: prepared.initial[name] for name in prepared.reference_params}
        loss_error = abs(module.losses[-1] - prepared.reference_loss) / abs(prepared.reference_loss)
        update_error = relative_update_error(initial, prepared.reference_params, got)
        outcomes[family] = (loss_error, update_error, strategy.memory_report.table())
    return outcomes


def test_families_with_every_memory_option_train_exactly() -> None:
    results = launch("tests.test_memory:families_worker", 2, {"families": list(FAMILIES)}, timeout=900)
    for rank, outcomes in enumerate(results):
        for family, (loss_error, update_error, table) in outcomes.items():
            assert loss_error < 1e-5 and update_error < 1e-4, f"{family} rank {rank}: {loss_error=}, {update_error=}"
            for effect in FAMILIES[family]:
                assert effect in table, f"{family}: {effect!r} not in the report\n{table}"
