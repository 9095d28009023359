"""The longest sequence a Llama-style model trains at on one GPU machine, per memory option; tokens/s and MFU.

For every memory option, sequence lengths are probed by doubling from ``--start-seq-len`` until a
probe runs out of memory, then bisected ``--refine`` times between the last fit and the first miss.
Every probe is a fresh set of ``--sp`` processes (one per GPU; an out-of-memory rank cannot leave a
clean allocator or process group behind) that trains ``--steps`` steps of random tokens with
``UlyssesStrategy`` in ``L.Trainer`` (bf16, batch 1, SP over all GPUs). Throughput is the median step
time after the first step; MFU counts ``6 x non-embedding parameters + 6 x layers x hidden x seq``
FLOPs per token (forward + backward; the attention term for causal attention, half of the dense
``12 x layers x hidden x seq``), against the GPU's dense bf16 peak::

    python -m benchmarks.gpu_long_context --model 8b --options zero3+checkpointing zero3+alst \\
        --output docs/benchmarks/gpu_long_context.md

Needs CUDA GPUs (``--accelerator cpu --model tiny`` runs the same path as a functional smoke test, fp32,
without MFU); argument parsing, model configs, FLOP counting and the probe schedule are pure and run
anywhere (``tests/test_benchmarks.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.measure import ProbeSchedule, publish
from lightning_ulysses import UlyssesLossMixin, UlyssesStrategy
from lightning_ulysses.flops import dense_peak_flops

REPO_ROOT = Path(__file__).resolve().parent.parent

# Llama 3.x shapes (https://huggingface.co/meta-llama); "tiny" checks the script end to end in seconds.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}

# memory option -> UlyssesStrategy keyword arguments ("alst": ALST's tiled MLP, tiled logits + loss and
# activation checkpointing with CPU offload; "offload": ZeRO-3's optimizer state and parameters in CPU memory)
_ALST = dict(tiled_mlp=True, tiled_loss=True, activation_checkpointing=True, offload_activations=True)
MEMORY_OPTIONS: dict[str, dict[str, Any]] = {
    "zero3": dict(stage=3),
    "zero3+checkpointing": dict(stage=3, activation_checkpointing=True),
    "zero3+alst": dict(stage=3, **_ALST),
    "zero3+alst+offload": dict(stage=3, offload_optimizer=True, offload_parameters=True, **_ALST),
    "zero3+alst+fused_norms": dict(stage=3, fused_norms=True, **_ALST),
}


# torch SDPA kernels a probe may use ("flash": a run that needs another kernel fails instead of falling back)
SDPA_BACKENDS: dict[str, list[SDPBackend]] = {
    "any": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH],
    "flash": [SDPBackend.FLASH_ATTENTION],
}


@dataclass(frozen=True)
class LongContextConfig:
    model: str = "8b"
    options: tuple[str, ...] = tuple(MEMORY_OPTIONS)
    sp: int = 0  # 0: every visible GPU
    start_seq_len: int = 16384
    max_seq_len: int = 4_194_304
    refine: int = 2
    steps: int = 4
    attn_implementation: str = "auto"
    sdpa_backend: str = "any"  # "flash": torch's SDPA may use its flash kernel only (raises where it cannot)
    probe_timeout: int = 3600  # seconds per probe, then its processes are stopped
    peak_tflops: float = 0.0  # 0: looked up from the GPU name
    accelerator: str = "cuda"  # "cpu": a functional smoke run (fp32, gloo, no MFU)

    @property
    def probe_schedule(self) -> ProbeSchedule:
        return ProbeSchedule(self.start_seq_len, self.max_seq_len, self.refine)

    def __post_init__(self) -> None:
        if self.model not in MODEL_SIZES:
            raise ValueError(f"--model must be one of {list(MODEL_SIZES)}, got {self.model!r}.")
        unknown = [o for o in self.options if o not in MEMORY_OPTIONS]
        if unknown:
            raise ValueError(f"Unknown memory options {unknown}; choose from {list(MEMORY_OPTIONS)}.")
        if self.steps < 2:
            raise ValueError("--steps must be at least 2: the first step is warm-up and is not timed.")
        if self.sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"--sdpa-backend must be one of {list(SDPA_BACKENDS)}, got {self.sdpa_backend!r}.")
        if not 0 < self.start_seq_len <= self.max_seq_len:
            raise ValueError(
                f"Need 0 < --start-seq-len <= --max-seq-len, got {self.start_seq_len}, {self.max_seq_len}."
            )


def parse_args(argv: list[str] | None = None) -> tuple[LongContextConfig, Path]:
    defaults = LongContextConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODEL_SIZES), default=defaults.model)
    parser.add_argument("--options", nargs="+", choices=list(MEMORY_OPTIONS), default=list(defaults.options))
    for name in ("sp", "start_seq_len", "max_seq_len", "refine", "steps", "probe_timeout"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--attn-implementation", default=defaults.attn_implementation)
    parser.add_argument("--sdpa-backend", choices=list(SDPA_BACKENDS), default=defaults.sdpa_backend)
    parser.add_argument("--peak-tflops", type=float, default=defaults.peak_tflops)
    parser.add_argument("--accelerator", choices=["cuda", "cpu"], default=defaults.accelerator)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "docs" / "benchmarks" / "gpu_long_context.md")
    args = vars(parser.parse_args(argv))
    output = args.pop("output")
    args["options"] = tuple(args["options"])
    return LongContextConfig(**args), output


def llama_config(model: str, seq_len: int) -> LlamaConfig:
    return LlamaConfig(
        **MODEL_SIZES[model],
        max_position_embeddings=seq_len,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )


def parameter_counts(config: LlamaConfig) -> tuple[int, int]:
    """``(total, without the input embedding)``, counted on the meta device (no memory)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.get_input_embeddings().weight.numel()


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 x non-embedding params`` (matmuls, forward + backward, the LM head
    included) plus causal attention scores and values, ``6 x layers x hidden x seq``."""
    _, non_embedding = parameter_counts(config)
    return 6 * non_embedding + 6 * config.num_hidden_layers * config.hidden_size * seq_len


def peak_flops(device_name: str, peak_tflops: float = 0.0) -> float:
    """Dense bf16 peak FLOP/s: ``--peak-tflops``, else :func:`~lightning_ulysses.flops.dense_peak_flops` of the GPU."""
    flops = peak_tflops * 1e12 or dense_peak_flops(device_name, torch.bfloat16)
    if flops is None:
        raise ValueError(f"No dense bf16 peak known for {device_name!r}; pass --peak-tflops.")
    return flops


# ----------------------------------------------------------------------------------------------
# the GPU part
# ----------------------------------------------------------------------------------------------
class LongContextLM(UlyssesLossMixin, L.LightningModule):
    """The model's loss through :meth:`forward_causal_lm_loss`: tiled when the strategy's ``tiled_loss`` is on."""

    def __init__(self, config: LlamaConfig, cpu_optimizer: bool) -> None:
        super().__init__()
        self.config, self.cpu_optimizer = config, cpu_optimizer
        self.model: LlamaForCausalLM | None = None

    def configure_model(self) -> None:
        # under ZeRO-3 Lightning runs this inside deepspeed.zero.Init: each rank allocates only its partition
        if self.model is None:
            self.model = LlamaForCausalLM(self.config)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.forward_causal_lm_loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.cpu_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(self.parameters(), lr=1e-5)
        return torch.optim.AdamW(self.parameters(), lr=1e-5, fused=self.device.type == "cuda")


class _StepTimer(L.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


def probe_worker(args: dict[str, Any]) -> dict[str, float]:
    """One rank of one probe: train ``steps`` steps at ``seq_len``; median step time and peak memory."""
    config, seq_len, option = LongContextConfig(**args["config"]), args["seq_len"], args["option"]
    strategy_kwargs = MEMORY_OPTIONS[option]
    module = LongContextLM(llama_config(config.model, seq_len), "offload_optimizer" in strategy_kwargs)
    timer = _StepTimer()
    trainer = L.Trainer(
        accelerator=config.accelerator,
        devices=args["sp"],
        max_steps=config.steps,
        callbacks=[timer],
        precision="bf16-mixed" if config.accelerator == "cuda" else "32-true",
        strategy=UlyssesStrategy(sp_size=args["sp"], attn_implementation=config.attn_implementation, **strategy_kwargs),
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    vocab = module.config.vocab_size
    rows = [{"input_ids": torch.randint(0, vocab, (seq_len,))} for _ in range(config.steps)]
    with sdpa_kernel(SDPA_BACKENDS[config.sdpa_backend]):
        trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=1))
    periods = [b - a for a, b in zip(timer.ends[:-1], timer.ends[1:])]
    if config.accelerator == "cuda":
        peak_memory = torch.cuda.max_memory_allocated()
    else:
        peak_memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_time": statistics.median(periods), "peak_memory": peak_memory}


def run_probe(config: LongContextConfig, option: str, seq_len: int, sp: int) -> dict[str, float] | None:
    """Result of rank 0, or None when the probe ran out of GPU memory (any other failure raises)."""
    from tests.launch import launch

    args = {"config": dataclasses.asdict(config), "option": option, "seq_len": seq_len, "sp": sp}
    try:
        return launch(
            "benchmarks.gpu_long_context:probe_worker",
            sp,
            args,
            timeout=config.probe_timeout,
            extra_env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        )[0]
    except AssertionError as error:
        if "OutOfMemoryError" in str(error) or "out of memory" in str(error):
            return None
        raise


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    config, output = parse_args(argv)
    if config.accelerator == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_long_context needs CUDA GPUs (--accelerator cpu runs a functional smoke test).")
    on_gpu = config.accelerator == "cuda"
    sp = config.sp or (torch.cuda.device_count() if on_gpu else 2)
    device_name = torch.cuda.get_device_name() if on_gpu else "CPU"
    rows = []
    for option in config.options:
        fits: list[int] = []
        misses: list[int] = []
        best: dict[str, float] | None = None
        while (seq_len := config.probe_schedule.next(fits, misses)) is not None:
            result = run_probe(config, option, seq_len, sp)
            print(f"{option} seq_len={seq_len}: {'out of memory' if result is None else result}", flush=True)
            if result is None:
                misses.append(seq_len)
            else:
                fits.append(seq_len)
                best = result if seq_len == max(fits) else best
        if best is None:
            rows.append({"option": option, "seq_len": None})
            continue
        longest = max(fits)
        tokens_per_s = longest / best["step_time"]  # one sequence per SP group, one group
        achieved = tokens_per_s * flops_per_token(llama_config(config.model, longest), longest) / sp
        rows.append(
            {
                "option": option,
                "seq_len": longest,
                "tokens_per_s": tokens_per_s,
                "mfu": achieved / peak_flops(device_name, config.peak_tflops) if on_gpu else None,
                "peak_memory_gib": best["peak_memory"] / 2**30,
            }
        )
    report = render_report(config, rows, sp, device_name)
    publish(report, output)
    return rows


def render_report(config: LongContextConfig, rows: list[dict[str, Any]], sp: int, device_name: str) -> str:
    total, _ = parameter_counts(llama_config(config.model, config.start_seq_len))
    lines = [
        f"# Longest trainable sequence: Llama {config.model} ({total / 1e9:.2f} B parameters), sp={sp} x {device_name}",
        "",
        f"attn_implementation={config.attn_implementation}, SDPA kernels: {config.sdpa_backend}, {config.steps} steps "
        "per probe (bf16 on CUDA)",
        "",
        "| memory option | longest sequence (tokens) | tokens/s | MFU | peak memory (GiB, rank 0) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if row["seq_len"] is None:
            lines.append(f"| {row['option']} | < {config.start_seq_len} | | | |")
        else:
            mfu = "" if row["mfu"] is None else f"{row['mfu']:.1%}"
            lines.append(
                f"| {row['option']} | {row['seq_len']:,} | {row['tokens_per_s']:,.0f} | {mfu} "
                f"| {row['peak_memory_gib']:.1f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
