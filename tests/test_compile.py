"""Regional ``torch.compile`` (``compile_layers``): the decoder layers run compiled, and results do not change.

One process: a recording dynamo backend sees each layer's projections, attention and feed-forward, every layer call
runs compiled code, and the outputs and gradients equal the eager model's; the undo brings eager calls back; a
checkpointed layer's children run compiled in the forward and in the recomputation. Two processes (one launch):
``UlyssesStrategy(sp_size=2, compile_layers=True)`` with inductor (CPU, C++ code; about 80 s cold on two shared cores)
equals one process of the plain model under ZeRO-2, and the profiler sees compiled code run in every step, forward
and backward, around the all-to-alls.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_ulysses import UlyssesStrategy
from lightning_ulysses.compile import compile_decoder_layers, remove_compiled_layers
from lightning_ulysses.memory import MemoryOptions, apply_memory_options
from tests.cases import CaseTable
from tests.test_equivalence import BATCH, LR, SEQ, STEPS, _fit
from tests.tiny import make_samples, reference_training, relative_update_error, tiny_llama

LAYERS = 2  # tiny_llama's


def _logits_and_grads(model: torch.nn.Module, ids: Tensor) -> list[Tensor]:
    logits = model(input_ids=ids).logits
    return [logits, *torch.autograd.grad(logits.logsumexp(-1).mean(), list(model.parameters()))]


class RecordingBackend:
    """A dynamo backend that keeps each graph it is given and counts the calls of the compiled code."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.runs = 0

    def __call__(self, graph: torch.fx.GraphModule, inputs: list[Tensor]) -> Any:
        self.graphs.append(graph)

        def run(*args: Any) -> Any:
            self.runs += 1
            return graph.forward(*args)

        return run

    def traced(self, graph: int) -> list[str]:
        return [node.target.__name__ for node in self.graphs[graph].graph.nodes if node.op == "call_function"]


def test_each_decoder_layer_runs_compiled_and_equals_eager() -> None:
    model = tiny_llama().train()
    ids = torch.randint(1, 60, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = _logits_and_grads(model, ids)
    backend = RecordingBackend()
    report = compile_decoder_layers(model, backend=backend)
    assert report.applies.startswith("model.layers.* (LlamaDecoderLayer) x2 compiled")
    got = _logits_and_grads(model, ids)
    assert backend.runs == LAYERS  # each layer's call ran one compiled graph
    traced = backend.traced(0)
    assert traced.count("linear") == 7 and "scaled_dot_product_attention" in traced and "silu" in traced
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    remove_compiled_layers(model)
    _logits_and_grads(model, ids)
    assert backend.runs == LAYERS  # eager again: no compiled graph ran


def test_checkpointed_layers_compile_each_child_and_recompute_it_compiled() -> None:
    """Dynamo compiles nothing of a checkpointed frame that breaks its graph (the Ulysses all-to-alls do), so a
    checkpointed layer's children are compiled one by one; each runs compiled in the forward and the recomputation."""
    model = tiny_llama().train()
    ids = torch.randint(1, 60, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = _logits_and_grads(model, ids)
    apply_memory_options(model, MemoryOptions(activation_checkpointing=True))
    backend = RecordingBackend()
    report = compile_decoder_layers(model, backend=backend)
    children = ("self_attn (LlamaAttention)", "mlp (LlamaMLP)")
    children += ("input_layernorm (LlamaRMSNorm)", "post_attention_layernorm (LlamaRMSNorm)")
    assert (
        report.applies
        == ", ".join(f"model.layers.*.{c} x2" for c in children) + " compiled (torch.compile, one region each)"
    )
    got = _logits_and_grads(model, ids)
    assert backend.runs == 2 * len(children) * LAYERS  # forward, and again in the backward's recomputation
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_a_model_without_decoder_layers_and_zero3_are_refused() -> None:
    with pytest.raises(ValueError, match="compile_layers compiles the decoder layers of transformers models"):
        compile_decoder_layers(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="compile_layers runs where the engine keeps each layer's parameters whole"):
        UlyssesStrategy(sp_size=2, stage=3, compile_layers=True)


CASES: dict[str, dict[str, Any]] = {"sp2_zero2": dict(sp=2, stage=2, memory=dict(compile_layers=True))}


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
        # every layer ran compiled code in every step, forward and backward
        assert regions.get("CompiledFunctionBackward", 0) >= STEPS * LAYERS, regions
        assert regions["CompiledFunction"] == regions["CompiledFunctionBackward"], regions
        assert got["steps"] == STEPS
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"
