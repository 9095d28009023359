"""The memory options prove their effect, one process: each decoder layer's feed-forward found by what it does and
tiled exactly (dense MLPs and mixture-of-experts blocks, router outputs included), what cannot be tiled named with
its reason, the tiles counted, the bytes kept for the backward measured, the layers recomputed counted, and an option
that applies to nothing (or that eval mode switches off) refused. Training under SP with every option on is in
``tests/test_memory.py``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from lightning_ulysses.memory import MemoryOptions, apply_memory_options, remove_memory_options, tiled_map
from tests.tiny import AuxiliaryLossMoE, tiny_llama
from tests.zoo_configs import tiny_recipe

MOE_FAMILIES = ["gpt_oss", "mixtral", "qwen2_moe"]


def _model(model_type: str) -> PreTrainedModel:
    recipe = tiny_recipe(model_type)
    model = recipe.build("eager", seed=0).train()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # families initialise routers, biases and sinks to zero: no path may be inert
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def _relative_error(got: Tensor, expected: Tensor) -> float:
    assert expected.norm() > 0, "the reference is zero; the comparison would prove nothing"
    return ((got - expected).norm() / expected.norm()).item()


def _tensors(output: Any) -> list[Tensor]:
    return [output] if isinstance(output, Tensor) else [t for t in output if isinstance(t, Tensor)]


@pytest.mark.parametrize("num_tiles", [3, 40], ids=["3_tiles", "more_tiles_than_tokens"])
@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_tiled_moe_block_equals_the_whole_call_with_gradients(model_type: str, num_tiles: int) -> None:
    model = _model(model_type)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 7, model.config.hidden_size, requires_grad=True)  # 7 tokens: 3 tiles do not divide them
    params = [p for p in block.parameters() if p.requires_grad]

    def loss_and_grads(output: Any) -> tuple[list[Tensor], list[Tensor]]:
        outputs = _tensors(output)
        generator = torch.Generator().manual_seed(2)
        # every output counts, gpt-oss' router scores included
        loss = sum((o * torch.randn(o.shape, generator=generator)).sum() for o in outputs if o.is_floating_point())
        return outputs, list(torch.autograd.grad(loss, [x, *params], allow_unused=True))

    expected, expected_grads = loss_and_grads(block(x))
    got, got_grads = loss_and_grads(tiled_map(block, x, num_tiles))
    assert len(got) == len(expected) == (2 if model_type == "gpt_oss" else 1)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and _relative_error(g, e) < 1e-6
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert (g is None) == (e is None)
        if e is not None and e.norm() > 0:
            assert _relative_error(g, e) < 1e-5


@pytest.mark.parametrize(
    ("model_type", "tiled"),
    [
        ("gpt_oss", {"model.layers.*.mlp": "GptOssMLP"}),
        ("mixtral", {"model.layers.*.mlp": "MixtralSparseMoeBlock"}),
        ("lfm2", {"model.layers.*.feed_forward": "Lfm2MLP"}),
        (
            "granitemoehybrid",
            {
                "model.layers.*.block_sparse_moe": "GraniteMoeHybridMoE",
                "model.layers.*.shared_mlp": "GraniteMoeHybridMLP",
            },
        ),
    ],
)
def test_feed_forwards_found_by_behaviour_are_tiled_and_train_exactly(model_type: str, tiled: dict[str, str]) -> None:
    model = _model(model_type)
    ids = torch.randint(1, 200, (2, 16))
    expected_loss, expected_grads = _loss_and_grads(model, ids)
    report = apply_memory_options(model, MemoryOptions(tiled_mlp=3))

    row = report.rows[0]
    assert row.option == "tiled_mlp=3" and row.left_out == ()
    for path, cls in tiled.items():
        assert f"{path} ({cls})" in row.applies
    # the effect: each tiled feed-forward's first linear layer runs once per tile (3 tiles of 16 tokens), and once
    # more per tile in the backward (each tile is recomputed)
    counts = _count_first_linear_calls(model, tiled)
    loss, grads = _loss_and_grads(model, ids)
    layers = model.config.num_hidden_layers
    assert counts == {path: 2 * 3 * layers for path in tiled}
    assert _relative_error(loss, expected_loss) < 1e-6
    for g, e in zip(grads, expected_grads, strict=True):
        if e.norm() > 0:
            assert _relative_error(g, e) < 1e-5
    remove_memory_options(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def _loss_and_grads(model: nn.Module, ids: Tensor) -> tuple[Tensor, list[Tensor]]:
    logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids)).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    return loss, list(torch.autograd.grad(loss, list(model.parameters())))


def _count_first_linear_calls(model: nn.Module, tiled: dict[str, str]) -> dict[str, int]:
    """Forward calls of the first ``nn.Linear`` (or expert weight holder) inside each tiled module, by pattern."""
    import re

    counts = dict.fromkeys(tiled, 0)
    for name, module in model.named_modules():
        path = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        if path in tiled:
            first = next(m for m in module.modules() if m is not module and list(m.parameters(recurse=False)))

            def count(*_: Any, path: str = path) -> None:
                counts[path] += 1

            first.register_forward_pre_hook(count)
    return counts


class TokenMixingMLP(nn.Module):
    """Looks like an MLP (hidden states in and out) but mixes tokens: each token gets the running mean of those
    before it."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        steps = torch.arange(1, x.shape[-2] + 1, dtype=x.dtype, device=x.device)[:, None]
        return self.proj(x.cumsum(-2) / steps)


class CapacityMoE(nn.Module):
    """Top-1 routing with a capacity of ``tokens / experts`` per expert: a token past its expert's capacity is
    dropped (output 0), so what a token gets depends on how many tokens came before it to the same expert."""

    def __init__(self, hidden: int, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        choice = self.router(flat).argmax(-1)
        capacity = max(1, math.ceil(flat.shape[0] / len(self.experts)))
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().flatten()[:capacity]
            out[rows] = expert(flat[rows])
        return out.view_as(x)


@pytest.mark.parametrize(
    ("make", "problem"),
    [(TokenMixingMLP, "depends on other tokens"), (CapacityMoE, "depends on other tokens")],
    ids=["mixes_tokens", "capacity_limited_routing"],
)
def test_a_feed_forward_that_is_not_token_wise_is_not_tiled_and_named(make: type[nn.Module], problem: str) -> None:
    model = tiny_llama().train()
    model.model.layers[1].mlp = make(model.config.hidden_size)
    report = apply_memory_options(model, MemoryOptions(tiled_mlp=2))
    (row,) = report.rows
    assert row.applies == "model.layers.0.mlp (LlamaMLP) tiled"  # layer 1's is left whole
    (left,) = row.left_out
    assert left.startswith(f"model.layers.1.mlp ({make.__name__})") and problem in left
    assert "forward" in model.model.layers[0].mlp.__dict__ and "forward" not in model.model.layers[1].mlp.__dict__

    for layer in model.model.layers:
        layer.mlp = make(model.config.hidden_size)
    with pytest.raises(ValueError, match=r"tiled_mlp found no decoder-layer feed-forward.*Set tiled_mlp=False"):
        apply_memory_options(model, MemoryOptions(tiled_mlp=2))


def test_a_feed_forward_that_adds_a_gradient_of_its_own_is_not_tiled_and_named(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).train()
    model.model.layers[1].mlp = AuxiliaryLossMoE(model.config.hidden_size)
    ids = torch.randint(1, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(3)
    expected_loss, expected_grads = _loss_and_grads(model, ids)
    rng = torch.random.get_rng_state()

    report = apply_memory_options(model, MemoryOptions(tiled_mlp=3))

    (row,) = report.rows
    assert row.applies == "model.layers.0.mlp (LlamaMLP) tiled"
    (left,) = row.left_out
    assert left.startswith("model.layers.1.mlp (AuxiliaryLossMoE): it adds a gradient of its own")
    # the probe (training mode, autograd on) leaves no trace: modes, random state and .grad as they were
    assert all(m.training for m in model.modules()) and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)
    # the effect: the router's gradient is the plain model's (tiled: each tile's load-balancing loss, error 2.8)
    torch.manual_seed(3)
    loss, grads = _loss_and_grads(model, ids)
    assert _relative_error(loss, expected_loss) < 1e-6
    for g, e in zip(grads, expected_grads, strict=True):
        if e.norm() > 0:
            assert _relative_error(g, e) < 1e-5


def test_tiled_feed_forward_keeps_only_its_input_for_the_backward() -> None:
    model = _model("mixtral")
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 256, model.config.hidden_size, requires_grad=True)
    plain, tiled = _saved_bytes(lambda: mlp(x)), _saved_bytes(lambda: tiled_map(mlp, x, 8))
    assert tiled == x.nbytes  # each tile's checkpoint keeps a view of x, nothing else
    assert plain > 4 * x.nbytes  # the router's and experts' intermediates


def _saved_bytes(fn: Any) -> int:
    """Bytes of the distinct storages autograd keeps for ``fn()``'s backward (parameters excluded)."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        if not isinstance(t, nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_checkpointing_recomputes_each_layer_once_in_the_backward() -> None:
    model = tiny_llama().train()
    ids = torch.randint(1, 61, (2, 12))
    calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    _loss_and_grads(model, ids)
    assert len(calls) == 1
    report = apply_memory_options(model, MemoryOptions(activation_checkpointing=True))
    assert report.rows[0].applies == "model.layers.* (LlamaDecoderLayer) x2 checkpointed"
    calls.clear()
    _loss_and_grads(model, ids)
    assert len(calls) == 2


def test_checkpointing_a_model_in_eval_mode_is_refused() -> None:
    model = tiny_llama().eval()  # what from_pretrained returns; transformers then checkpoints nothing
    with pytest.raises(ValueError, match=r"switched off by eval mode.*model.layers.\* x2.*call model.train\(\)"):
        apply_memory_options(model, MemoryOptions(activation_checkpointing=True))
    assert not model.model.layers[0].gradient_checkpointing  # refused before any change
    apply_memory_options(model, MemoryOptions(activation_checkpointing=True), fitting=False)  # validation only


def test_a_frozen_model_in_eval_mode_next_to_a_trained_one_is_accepted() -> None:
    policy, reference = tiny_llama().train(), tiny_llama().eval().requires_grad_(False)  # DPO's pair
    report = apply_memory_options(
        nn.ModuleDict({"policy": policy, "reference": reference}), MemoryOptions(activation_checkpointing=True)
    )
    assert report.rows[0].applies == "model.layers.* (LlamaDecoderLayer) x2 checkpointed"


class StopGradientRMSNorm(nn.Module):
    """Llama's RMSNorm with its statistic detached: the same forward bit for bit, a backward of its own (the reciprocal
    RMS a constant), which the fused norm's closed form would replace."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype, x = x.dtype, x.float()
        variance = x.pow(2).mean(-1, keepdim=True).detach()
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)


def test_fused_norms_leave_a_norm_whose_backward_is_its_own() -> None:
    """The final norm computes Llama's forward with another backward: fused, every parameter before it got the closed
    form's gradient instead of the model's (relative error up to 0.23, the loss unchanged). It is left as it is, the
    other norms fused, every gradient the plain model's."""
    model = tiny_llama().train()
    stop_gradient = StopGradientRMSNorm(32)
    with torch.no_grad():
        stop_gradient.weight.copy_(1 + 0.1 * torch.randn(32, generator=torch.Generator().manual_seed(2)))
    model.model.norm = stop_gradient
    ids = torch.randint(1, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    expected_loss, expected_grads = _loss_and_grads(model, ids)
    report = apply_memory_options(model, MemoryOptions(fused_norms=True))
    assert "model.norm" not in report.rows[0].applies and "model.layers.*.input_layernorm" in report.rows[0].applies
    loss, grads = _loss_and_grads(model, ids)
    assert _relative_error(loss, expected_loss) < 1e-6
    for (name, _), g, e in zip(model.named_parameters(), grads, expected_grads, strict=True):
        assert _relative_error(g, e) < 1e-5, name


def test_report_reads_the_head_chunk_plan_and_the_tiled_loss() -> None:
    from lightning_ulysses.hf.masks import MaskPattern
    from lightning_ulysses.hf.plan import LayerPlan, ModelPlan, ProjectionChunks
    from lightning_ulysses.memory import MemoryReport, head_chunks_row, tiled_loss_row

    projected = ProjectionChunks(2, "q_proj", "k_proj", "v_proj", "o_proj", (), (), 4, 2, 8, 8)
    plan = ModelPlan(
        layers=(
            ("model.layers.0.self_attn", LayerPlan(MaskPattern(), projection_chunks=projected)),
            ("model.layers.1.self_attn", LayerPlan(MaskPattern(), projection_chunks=projected)),
            ("model.layers.2.self_attn", LayerPlan(MaskPattern())),
        )
    )
    report = MemoryReport([head_chunks_row([plan], 2), tiled_loss_row(True, logits_transform="divided by 4.0")])
    assert report.table().splitlines()[3:] == [
        "| head_chunks=2 | 3 attention layers: 2 projected per chunk | model.layers.2.self_attn: chunked attention "
        "only (projections not per head) |",
        "| tiled_loss=True | lm_head + cross entropy of forward_causal_lm_loss in tiles sized by bytes, each tile's "
        "logits divided by 4.0 | - |",
    ]
