"""The benchmarks: a shortened compare_alst run (CPU, 2 processes), a short mixer_cost run, and the CPU-free parts of
gpu_long_context."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from benchmarks import (
    compare_alst,
    gpu_long_context,
    head_chunks,
    kernels,
    longest,
    mixer_cost,
    projection_chunks,
    ring,
)
from benchmarks.compare_alst import BenchmarkConfig
from benchmarks.gpu_long_context import LongContextConfig, flops_per_token, llama_config, parameter_counts
from benchmarks.measure import LiveTensors, PeakMemory
from benchmarks.memory import _train_step
from lightning_ulysses.memory import MemoryOptions
from lightning_ulysses.sharding import prepare_batch
from tests.launch import one_rank_world
from tests.tiny import VOCAB, tiny_llama

SHORT = [
    "--seq-len",
    "62",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--intermediate",
    "48",
    "--vocab",
    "61",
    "--steps",
    "2",
    "--timed-steps",
    "4",
]


def test_compare_alst_short_run(tmp_path: Path) -> None:
    """Both sides move exactly the theoretical all-to-all bytes and train exactly like one process (ZeRO-3); ours in
    half the calls (q, k and v in one all-to-all)."""
    summaries = compare_alst.main([*SHORT, "--output", str(tmp_path / "report.md")])
    config = BenchmarkConfig(seq_len=62, hidden=32, heads=2, intermediate=48, vocab=61, steps=2, timed_steps=4)
    assert config.theoretical_bytes_per_layer == 4 * 2 * 31 * 2 * 16 * 4 / 2
    for side, summary in summaries.items():
        # ALST: q, k, v and out, forward and backward; ours: q, k, v together and out
        assert summary.all_to_all_calls_per_step == {"alst": 8, "ours": 4}[side] * config.layers, side
        assert summary.all_to_all_bytes_per_layer == config.theoretical_bytes_per_layer, side
        assert summary.max_loss_error < 1e-5, side
        assert abs(summary.grad_norm_ratio - 1) < 1e-4, side
        assert summary.weight_update_error < 1e-4, side
        assert summary.median_step_time > 0 and summary.median_cpu_time > 0 and summary.peak_memory > 0, side
        assert summary.saved_for_backward > 0, side
    report = (tmp_path / "report.md").read_text()
    assert (
        "python -m benchmarks.compare_alst --seq-len 62" in report and "| median step time, wall clock (s) |" in report
    )


def test_ring_benchmark_counts_the_formulas() -> None:
    """Ulysses x Ring at sp=4 (8 heads, 1 K/V head): every rank's counted bytes equal the formulas in every layout,
    and the ring without K/V replication (4 x 1) sends fewer bytes than Ulysses-only, which replicates it 4x."""
    table = ring.main(["--sp", "4", "--seq", "64", "--heads", "8", "--kv-heads", "1", "--dim", "8", "--repeats", "1"])
    assert sorted(table) == [1, 2, 4]
    for layout in table.values():
        assert layout["measured"] == layout["expected"]
    sent = {r: max(m["to_other_ranks"] for m in layout["measured"]) for r, layout in table.items()}
    assert sent[4] < sent[1] and sent[2] <= sent[1]


def test_mixer_cost_counts_the_formula(tmp_path: Path) -> None:
    """Every head-sharded mixer layer sends exactly the formula's all-to-all (and token-shift halo) bytes and keeps half
    its activations per rank at sp=2 (as documented in docs/hybrid-models.md)."""
    rows = mixer_cost.main(["--sp", "2", "--tokens", "32", "--output", str(tmp_path / "cost.md")])
    assert len(rows) == len(mixer_cost.MIXERS)
    for row in rows:
        assert row["measured"] == row["formula"] > 0, row
        assert row["halo"] == pytest.approx(row["halo_formula"]), row
        assert 0.45 < row["saved_ratio"] < 0.6, row
    assert sum(row["halo"] > 0 for row in rows) == 2  # RWKV's token shift, ZAYA's delayed values
    assert "| `Qwen3NextGatedDeltaNet` |" in (tmp_path / "cost.md").read_text()


def test_head_chunks_benchmark_counts_the_collectives() -> None:
    """One layer: one all-to-all a direction for q, k and v and one for the output unchunked; chunked, 2 per chunk
    forward and 4 backward (a kept kernel graph's backward gathers q, k and v, the output and the output gradient
    apart, then sends the gradients back). A training step: 2 a layer per pass (forward, recomputation, backward) over
    2 layers unchunked; with ``"auto"`` (4 chunks, projections inside) 2 per chunk and pass, each chunk's
    recomputation a fourth pass."""
    report = head_chunks.main(["--layer-seq", "64", "--seq-lens", "128", "--repeats", "1"])
    layer, step = report.split("One training step")
    assert "| None | 2 | 2 |" in layer and "| 1 | 2 | 4 |" in layer and "| 4 | 8 | 16 |" in layer, report
    calls = {line.split(" | ")[0]: line.split(" | ")[2] for line in step.splitlines() if line.startswith("| ")}
    assert (calls["| None"], calls["| auto"]) == ("12", "64"), report


def test_projection_chunks_survey_tells_the_families_apart(tmp_path: Path) -> None:
    """The package's narrowed projections per head chunk reproduce Llama's attention (whole K/V groups), GLM's (one
    K/V head, query heads split) and gpt-oss's (its sinks narrowed too); OLMo 2's norm over all heads' queries makes
    the chunked call fail; DiffLlama's mixing weights are parameters of its own that are not one per head; GPT-2's
    fused projection is another layout."""
    families = ["llama", "glm", "gpt_oss", "olmo2", "diffllama", "gpt2"]
    rows = projection_chunks.main([*families, "--output", str(tmp_path / "s.md")])
    verdicts = {row["family"]: row["verdict"] for row in rows}
    assert verdicts == {
        "llama": "equal",
        "glm": "equal",
        "gpt_oss": "equal",
        "olmo2": "fails",
        "diffllama": "not narrowable",
        "gpt2": "other layout",
    }, rows
    assert "K/V heads 1" in next(row["detail"] for row in rows if row["family"] == "glm")
    assert "| diffllama | not narrowable |" in (tmp_path / "s.md").read_text()


def test_compare_alst_refuses_steps_the_adapter_would_hang_on() -> None:
    with pytest.raises(ValueError, match="multiple of --sp"):
        compare_alst.parse_args(["--steps", "3", "--sp", "2"])


def test_long_context_arguments() -> None:
    config, output = gpu_long_context.parse_args(["--model", "1b", "--options", "zero3", "--steps", "3"])
    assert config == LongContextConfig(model="1b", options=("zero3",), steps=3)
    assert output.name == "gpu_long_context.md"
    config, _ = gpu_long_context.parse_args(["--sdpa-backend", "flash", "--probe-timeout", "120"])
    assert config.sdpa_backend == "flash" and config.probe_timeout == 120
    with pytest.raises(ValueError, match="sdpa-backend"):
        LongContextConfig(sdpa_backend="math")
    with pytest.raises(SystemExit):
        gpu_long_context.parse_args(["--options", "zero4"])
    with pytest.raises(ValueError, match="at least 2"):
        LongContextConfig(steps=1)


def test_llama_sizes_match_the_published_parameter_counts() -> None:
    assert parameter_counts(llama_config("8b", 8192))[0] == pytest.approx(8.03e9, rel=2e-3)  # Llama-3.1-8B
    total, non_embedding = parameter_counts(llama_config("1b", 8192))
    assert total == pytest.approx(1.50e9, rel=5e-3)  # Llama-3.2-1B, untied here (1.24 B tied)
    assert total - non_embedding == 128256 * 2048


def test_long_context_mfu_uses_the_dense_peak() -> None:
    assert gpu_long_context.peak_flops("NVIDIA H200") == pytest.approx(989.5e12)
    assert gpu_long_context.peak_flops("NVIDIA L4", peak_tflops=121) == pytest.approx(121e12)
    with pytest.raises(ValueError, match="--peak-tflops"):
        gpu_long_context.peak_flops("NVIDIA L4")


def test_flops_per_token_counts_matmuls_and_causal_attention() -> None:
    config = llama_config("tiny", 1024)
    _, non_embedding = parameter_counts(config)
    assert flops_per_token(config, 1024) == 6 * non_embedding + 6 * 2 * 256 * 1024
    assert flops_per_token(config, 2048) - flops_per_token(config, 1024) == 6 * 2 * 256 * 1024


def test_probe_schedule_doubles_then_bisects() -> None:
    schedule = LongContextConfig(start_seq_len=16384, max_seq_len=1 << 20, refine=2).probe_schedule
    fits: list[int] = []
    misses: list[int] = []
    longest_fit = 100_000
    while (length := schedule.next(fits, misses)) is not None:
        (fits if length <= longest_fit else misses).append(length)
    assert fits == [16384, 32768, 65536, 98304] and misses == [131072, 114688]
    assert schedule.next([], [16384]) is None  # nothing fits: stop and report it
    assert schedule.next([1 << 20], []) is None  # capped by max_seq_len


def test_probe_reads_out_of_memory_as_a_miss_and_raises_anything_else(monkeypatch: pytest.MonkeyPatch) -> None:
    import tests.launch

    def launch_failing_with(message: str) -> Callable[..., list[Any]]:
        def launch(*args: Any, **kwargs: Any) -> list[Any]:
            raise AssertionError(f"benchmarks.gpu_long_context:probe_worker failed: {message}")

        return launch

    config = LongContextConfig(model="tiny")
    monkeypatch.setattr(tests.launch, "launch", launch_failing_with("torch.OutOfMemoryError: CUDA out of memory."))
    assert gpu_long_context.run_probe(config, "zero3", 1024, sp=8) is None
    monkeypatch.setattr(tests.launch, "launch", launch_failing_with("NCCL error: unhandled system error"))
    with pytest.raises(AssertionError, match="NCCL error"):
        gpu_long_context.run_probe(config, "zero3", 1024, sp=8)


@pytest.mark.cuda
def test_long_context_probe_on_gpu(tmp_path: Path) -> None:
    rows = gpu_long_context.main(
        [
            "--model",
            "tiny",
            "--options",
            "zero3",
            "zero3+alst",
            "--start-seq-len",
            "4096",
            "--max-seq-len",
            "4096",
            "--refine",
            "0",
            "--sp",
            "1",
            "--output",
            str(tmp_path / "report.md"),
        ]
    )
    for row in rows:
        assert row["seq_len"] == 4096 and row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1, row


def test_longest_renders_the_probe_from_its_log(tmp_path: Path) -> None:
    log = tmp_path / "longest.log"
    log.write_text(
        "alst, sp=2, N=32768: 124.4 MiB, fits (393 s)\n"
        "ours, head_chunks=auto, sp=2, N=32768: 122.2 MiB, fits (480 s)\n"
        "alst, sp=2, N=65536: 260.0 MiB, does not fit (900 s)\n"
        "ours, head_chunks=auto, sp=2, N=65536: 250.0 MiB, fits (990 s)\n"
    )
    out = tmp_path / "longest.md"
    args = ["--render", "--sides", "ours, head_chunks=auto", "alst", "--probe-start", "32768", "--probe-max", "65536"]
    report = longest.main([*args, "--log", str(log), "--out", str(out)])
    assert out.read_text() == report
    assert "| ours, head_chunks=auto | 32768 (122.2), 65536 (250.0) | 65536 | - | - | done |" in report
    assert "| alst | 32768 (124.4), 65536 (260.0) | 32768 | 65536 | - | stopped before 49152 |" in report
    log.write_text(log.read_text() + "alst, sp=2, N=49152: 190.0 MiB, fits (600 s)\n")
    report = longest.main([*args, "--refine", "1", "--log", str(log), "--out", str(out)])
    assert "| ours, head_chunks=auto | 32768 (122.2), 65536 (250.0) | 65536 | - | 1.33 | done |" in report


def test_longest_keeps_each_rulers_lengths_apart(tmp_path: Path) -> None:
    """A log holding both rulers' lengths: each table shows its own ruler's, and says which it is."""
    log = tmp_path / "longest.log"
    log.write_text(
        "alst, sp=2, N=65536: 240.0 MiB, fits (900 s)\n"
        "alst, sp=2, N=65536: 230.0 MiB of tensors, fits (950 s)\n"
        "alst, sp=2, N=131072: 480.0 MiB, does not fit (1900 s)\n"
        "alst, sp=2, N=131072: 250.0 MiB of tensors, fits (1950 s)\n"
    )
    out = tmp_path / "longest.md"
    args = ["--render", "--sides", "alst", "--probe-start", "65536", "--probe-max", "131072", "--refine", "0"]
    rss = longest.main([*args, "--log", str(log), "--out", str(out)])
    assert "by the RSS high-water mark (`--ruler rss`)" in rss
    assert "| alst | 65536 (240.0), 131072 (480.0) | 65536 | 131072 | 1.00 | done |" in rss
    tensors = longest.main([*args, "--ruler", "tensors", "--log", str(log), "--out", str(out)])
    assert "by the peak of live tensor storages (`--ruler tensors`)" in tensors
    assert "| alst | 65536 (230.0), 131072 (250.0) | 131072 | - | 1.00 | done |" in tensors


def test_live_tensors_split_the_peak_by_what_made_it() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    x = torch.randn(1024, 64, requires_grad=True)
    with LiveTensors(model) as live:
        model(x).sum().backward()
    parts = live.report()["parts"]
    assert parts["forward 1"][0] == 1024 * 256 * 4  # the ReLU's output, kept for its backward and the last layer's
    assert "forward 0" not in parts  # its weight's transpose is a view: nothing new
    assert any(label.startswith("backward ") for label in parts)
    assert live.peak >= sum(nbytes for nbytes, _, _ in parts.values())


def _final_norm_output_alive_in_the_layers_backward(model: Any, step: Callable[[dict[str, Any]], None]) -> bool:
    """Whether the final norm's output is still alive when the backward reaches the first decoder layer's output."""
    final: dict[str, StorageWeakRef] = {}
    alive: list[bool] = []

    def on_final_norm(module: Any, args: Any, out: torch.Tensor) -> None:
        final["output"] = StorageWeakRef(out.untyped_storage())

    def on_first_layer(module: Any, args: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: alive.append(not final["output"].expired()))

    model.model.norm.register_forward_hook(on_final_norm)
    model.model.layers[0].register_forward_hook(on_first_layer)
    step(prepare_batch({"input_ids": torch.randint(1, VOCAB, (1, 64))}, 1))
    assert len(alive) == 1
    return alive[0]


def test_the_steps_free_the_decoder_output_before_the_layers_backward() -> None:
    """The tiled losses need the decoder's output in their forward only (each makes its gradient there), and a
    training_step returns its loss and drops it: the benchmarks' steps must not keep it through the decoder's backward
    either (they did, one ``[B, N/sp, hidden]`` in the peak of both sides of benchmarks.longest). Ours: the package's
    fused tiled loss keeps none of it; ALST: DeepSpeed's TiledFusedLogitsLoss neither."""
    model = tiny_llama().train()
    ours = functools.partial(_train_step, model, options=MemoryOptions(tiled_loss=True))
    assert not _final_norm_output_alive_in_the_layers_backward(model, ours)
    with one_rank_world():
        model = tiny_llama().train()
        assert not _final_norm_output_alive_in_the_layers_backward(model, longest._alst(model, 1))


def test_peak_memory_counts_heap_pages_an_earlier_step_freed() -> None:
    """Small buffers live in the C heap, whose freed pages stay in the RSS below a live one: a step that reuses them
    must still count them (without the reset's malloc_trim it read 0.3 of these 16 MiB). Not all of them: in a test
    worker that ran other tests the heap holds partly used pages, resident already, where some of the buffers land
    (the suite read 0.89)."""

    def step() -> list[torch.Tensor]:
        return [torch.ones(1024) for _ in range(4096)]  # 4 KiB each, under any mmap threshold: 16 MiB in the heap

    parts = step()
    pinned = torch.ones(1024)  # above the freed pages: the heap's top cannot shrink past it
    del parts
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    parts = step()
    assert memory.peak() >= 0.6 * 4096 * 1024 * 4
    assert pinned.sum() == 1024 and len(parts) == 4096


def test_kernels_benchmark_smoke_run_on_cpu(tmp_path: Path) -> None:
    """Tiny sizes on CPU: every table is written, SDPA's row with its kernel and a bf16-sized error against float64,
    the GPU-only kernels each with why they did not run, the compiled layer equal to the eager one."""
    output = tmp_path / "kernels.md"
    kernels.main(["--output", str(output), "--device", "cpu", "--quick", "--compile-backend", "aot_eager"])
    rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:] for line in output.read_text().splitlines()}
    assert (
        rows["sdpa"][2] == "scaled_dot_product_flash_attention_for_cpu" and float(rows["sdpa"][3].rstrip(" |")) < 2e-2
    )
    assert rows["sdpa_cudnn"][2] == "CUDA only" and rows["flex_attention"][2] == "torch has no CPU flex backward"
    assert float(rows["tiled_loss (4 tiles)"][2].rstrip(" |")) < 2e-2
    assert float(rows["RMSNorm: lightning_ulysses.norms.rms_norm"][1].rstrip(" |")) < 2e-2
    assert rows["compiled (aot_eager)"][2] == "0.00e+00 |"
