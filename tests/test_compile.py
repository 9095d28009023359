"""Regional ``torch.compile`` (``compile_layers``): the decoder layers run compiled, and results do not change.

One process: a recording dynamo backend sees each layer's projections, attention and feed-forward, every layer call
runs compiled code, and the outputs and gradients equal the eager model's; the undo brings eager calls back. Two
processes: ``UlyssesStrategy(sp_size=2, compile_layers=True)`` with inductor (CPU, C++ code) equals one process of
the plain model under ZeRO-2, and under ZeRO-1 with activation checkpointing and fused norms (each child of a layer
compiled, recomputed in the backward); the profiler sees the compiled code run in every step, forward, backward and
recomputation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_ulysses import UlyssesStrategy
from lightning_ulysses.compile import compile_decoder_layers, remove_compiled_layers
from tests.cases import CaseTable
from tests.test_equivalence import BATCH, LR, SEQ, STEPS, _fit
from tests.tiny import make_samples, reference_training, relative_update_error, tiny_llama


def _logits_and_grads(model: torch.nn.Module, ids: Tensor) -> list[Tensor]:
    logits = model(input_ids=ids).logits
    return [logits, *torch.autograd.grad(logits.logsumexp(-1).mean(), list(model.parameters()))]


def test_each_decoder_layer_runs_compiled_and_equals_eager() -> None:
    model = tiny_llama().train()
    ids = torch.randint(1, 60, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = _logits_and_grads(model, ids)
    graphs: list[torch.fx.GraphModule] = []
    runs: list[int] = []

    def recording_backend(graph: torch.fx.GraphModule, inputs: list[Tensor]) -> Any:
        graphs.append(graph)

        def run(*args: Any) -> Any:
            runs.append(1)
            return graph.forward(*args)

        return run

    report = compile_decoder_layers(model, backend=recording_backend)
    assert report.applies.startswith("model.layers.* (LlamaDecoderLayer) x2 compiled")
    got = _logits_and_grads(model, ids)
    assert len(runs) == model.config.num_hidden_layers  # each layer's call ran one compiled graph
    traced = [node.target.__name__ for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert traced.count("linear") == 7 and "scaled_dot_product_attention" in traced and "silu" in traced
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    remove_compiled_layers(model)
    _logits_and_grads(model, ids)
    assert len(runs) == model.config.num_hidden_layers  # eager again: no compiled graph ran


def test_a_model_without_decoder_layers_and_zero3_are_refused() -> None:
    with pytest.raises(ValueError, match="compile_layers compiles the decoder layers of transformers models"):
        compile_decoder_layers(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="compile_layers runs under ZeRO stages 1 and 2"):
        UlyssesStrategy(sp_size=2, stage=3, compile_layers=True)


LAYERS = 2  # tiny_llama's
CASES: dict[str, dict[str, Any]] = {
    "sp2_zero2": dict(sp=2, stage=2, memory=dict(compile_layers=True)),
    "sp2_zero1_checkpointing": dict(
        sp=2, stage=1, memory=dict(compile_layers=True, activation_checkpointing=True, fused_norms=True)
    ),
}


def fit_case(name: str, case: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The fit, and the names of the compiled regions that ran in it, with how many times each ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = _fit(case, world_size, strategy_kwargs=case["memory"])
    regions: dict[str, int] = {}
    for event in profile.events():
        if event.name.startswith(("Torch-Compiled Region", "CompiledFunction")):
            regions[event.name] = regions.get(event.name, 0) + 1
    return {**result, "compiled_regions": regions}


TABLE = CaseTable("results", "tests.test_compile:fit_case", 2, CASES)
results = TABLE.fixture()


@pytest.mark.distributed
@TABLE.each_case
def test_compiled_layers_under_sp_equal_one_process(results: list[dict[str, Any]], name: str) -> None:
    expected_losses, expected = reference_training(make_samples(16, SEQ), steps=STEPS, batch_size=BATCH, lr=LR)
    initial = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    for rank, result in enumerate(results):
        got = result[name]
        regions = got["compiled_regions"]
        # every layer ran compiled code in every step, forward and backward; checkpointed, in the recomputation too
        assert regions.get("CompiledFunctionBackward", 0) >= STEPS * LAYERS, regions
        recomputed = CASES[name]["memory"].get("activation_checkpointing", False)
        assert regions["CompiledFunction"] == (2 if recomputed else 1) * regions["CompiledFunctionBackward"], regions
        assert got["steps"] == STEPS
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"
