"""Ours against DeepSpeed ALST on one GPU, side by side, from a ``from_pretrained`` folder: tokens/s, MFU, peak
memory and the longest sequence that fits.

    python -m benchmarks.gpu_side_by_side --model 1b --seq-len 32768 --out-dir $OUT
    python -m benchmarks.gpu_side_by_side --model 8b --layers 2 --seq-len 65536 --sides ours+all ours alst \\
        --budget-s 200 --out-dir $OUT
    python -m benchmarks.gpu_side_by_side --accelerator cpu --model tiny --seq-len 256 --out-dir /tmp/sbs  # smoke run

**Models.** Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 heads, 8 K/V heads, intermediate 8192, vocabulary
128256, tied embeddings) and Llama-3.1-8B's (hidden 4096, 32 heads, 8 K/V heads of 128, intermediate 14336,
vocabulary 128256), the latter with ``--layers`` layers to fit the time. Random weights with the real proportions,
written by ``save_pretrained`` to ``--checkpoint-dir`` and loaded by every side with
``AutoModelForCausalLM.from_pretrained`` (bf16 on CUDA, fp32 on CPU), as users load a checkpoint.

**Sides** (:data:`SIDES`), each on one GPU with ZeRO-3, the same DeepSpeed config (the one ``UlyssesStrategy``
builds; no gradient clipping), the same AdamW, batch 1 of random tokens:

* ``alst``: DeepSpeed's ALST pieces as ArcticTraining's trainer runs them: ``UlyssesSPAttentionHF
  .register_with_transformers`` (a no-op at ``sequence_parallel_size=1``: attention is transformers' ``sdpa``),
  ``TiledMLP`` on every layer's MLP with ``ceil(tokens / hidden)`` shards, ``model.gradient_checkpointing_enable()``
  (transformers' default, non-reentrant) with DeepSpeed's ``get_checkpoint_hidden_states_offloading_ctx_manager``
  around forward + backward (the CPU offload of the checkpointed hidden states that DeepSpeed's ALST tutorial gives for
  non-reentrant checkpointing; ArcticTraining's own patch covers reentrant checkpointing only), the model body called
  unwrapped and ``TiledFusedLogitsLoss`` over shards of ~1 GiB of fp32 logits with ArcticTraining's per-shard
  ``loss * valid tokens`` and ``"sum"`` reduction, then ``engine.backward`` and ``engine.step``;
* ``ours``: ``UlyssesStrategy`` in ``L.Trainer`` with the equivalent options (``tiled_mlp``, ``tiled_loss``,
  ``activation_checkpointing``, ``offload_activations``), ``attn_implementation="sdpa"``;
* ``ours+all``: and ``head_chunks="auto"``, ``fused_norms=True``.

**Method.** The sides run one after another on the same GPU in the order of ``--sides`` (``--rounds 2`` runs them
again in reverse order), each in a fresh process (``tests.launch``) from its own ``from_pretrained`` and engine:
DeepSpeed 0.19.8 keeps every ZeRO-3 engine of a process alive (ZeRO-3 appends the engine's top module to
``deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK`` at set-up and never removes it; with that list
emptied, an engine trained through ``L.Trainer`` still stays alive, by a reference not traced), so sides sharing a
process would carry each other's weights and optimizer state. A side's steps: one warm-up step at ``--seq-len``, one
at ``--short-len`` (the second point of the memory fit), then ``--timed-steps`` at ``--seq-len``. Step time: the
device synchronized at the step's start and end (data, forward, backward, optimizer). Tokens/s: ``seq_len`` over the
median timed step. MFU: tokens/s x :class:`~lightning_ulysses.flops.TransformerFlops` per token (no recompute
counted) over the bf16 matrix-product rate measured on the same GPU in the first side's process (8192^3 random
products) and over the datasheet's dense peak (:func:`~lightning_ulysses.flops.dense_peak_flops`). Peak memory:
``torch.cuda.max_memory_allocated`` over each step (everything the process holds: weights, optimizer, activations),
reset at the step's start.

**Longest sequence**, probed, never extrapolated: the two lengths' peaks give ``peak = a + b N``; the length where
that reaches 95% of the GPU's memory (or ``--probe-first``) is probed first (one step in a fresh process after the
engine's set-up, so an out-of-memory cannot poison the others), then the next length up (``+1/8``) while it fits or
down while it does not, then bisections: at most ``--max-probes`` per side, and only while ``--budget-s`` leaves time
for the next probe's predicted duration (step time fitted as ``t = c N + d N^2`` through the two lengths, plus the
measured set-up). The result is the bracket [longest fit, shortest miss), or what was measured when the time ran out.

**Results** are written as they appear: every side and probe appends one JSON line to ``side_by_side.jsonl`` in
``--out-dir`` and ``side_by_side.md`` is rewritten from all of it (every model run into that folder), with, for a
model run with fewer layers than its full depth, what the fit implies for the full depth (resident bytes per
parameter as measured, scaled to the full model's parameters; with everything on the GPU, with the optimizer state
offloaded, with parameters and optimizer offloaded, and the host memory those need).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from benchmarks.gpu_long_context import MODEL_SIZES
from benchmarks.measure import PeakMemory
from lightning_ulysses import UlyssesLossMixin, UlyssesStrategy
from lightning_ulysses.flops import TransformerFlops, dense_peak_flops

GiB = 2**30
# Llama 3.x shapes (https://huggingface.co/meta-llama); "tiny" runs the same code on CPU in seconds
MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
    "1b": {**MODEL_SIZES["1b"], "tie_word_embeddings": True},  # Llama-3.2-1B
    "8b": {**MODEL_SIZES["8b"], "tie_word_embeddings": False},  # Llama-3.1-8B
}
_EQUIVALENT = dict(tiled_mlp=True, tiled_loss=True, activation_checkpointing=True, offload_activations=True)
# side -> UlyssesStrategy keyword arguments (None: DeepSpeed's ALST pieces)
SIDES: dict[str, dict[str, Any] | None] = {
    "alst": None,
    "ours": _EQUIVALENT,
    "ours+all": dict(_EQUIVALENT, head_chunks="auto", fused_norms=True),
}
CAPACITY_FRACTION = 0.95  # the fit's target: the allocator's peak at 95% of the GPU's memory


@dataclass(frozen=True)
class SideBySideConfig:
    model: str = "1b"
    layers: int = 0  # 0: the model's own depth
    seq_len: int = 32768
    short_len: int = 0  # 0: seq_len // 2
    timed_steps: int = 3
    sides: tuple[str, ...] = tuple(SIDES)
    rounds: int = 1
    probe_sides: tuple[str, ...] = ("alst", "ours+all")
    budget_s: float = 0.0  # seconds for the whole run, probes included; 0: no probes
    capacity_gib: float = 0.0  # 0: the GPU's memory (CPU runs must give one to probe)
    max_probes: int = 4  # per side
    probe_granule: int = 1024  # probed lengths are multiples of this
    probe_first: int = 0  # the first length probed; 0: where the memory fit reaches 95% of the capacity
    accelerator: str = "cuda"

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {list(MODELS)}, got {self.model!r}.")
        unknown = [s for s in (*self.sides, *self.probe_sides) if s not in SIDES]
        if unknown:
            raise ValueError(f"Unknown sides {unknown}; choose from {list(SIDES)}.")
        if self.timed_steps < 1 or self.rounds < 1:
            raise ValueError("--timed-steps and --rounds must be at least 1.")
        if not 0 < self.short_length < self.seq_len:
            raise ValueError(f"Need 0 < --short-len < --seq-len, got {self.short_length}, {self.seq_len}.")

    @property
    def short_length(self) -> int:
        return self.short_len or self.seq_len // 2

    @property
    def depth(self) -> int:
        return self.layers or MODELS[self.model]["num_hidden_layers"]

    @property
    def label(self) -> str:
        full = MODELS[self.model]["num_hidden_layers"]
        return self.model if self.depth == full else f"{self.model}-width, {self.depth} of {full} layers"

    @property
    def side_order(self) -> list[str]:
        """``sides``, then reversed, for ``rounds`` rounds."""
        return [s for r in range(self.rounds) for s in (self.sides if r % 2 == 0 else self.sides[::-1])]


def parse_args(argv: list[str] | None = None) -> tuple[SideBySideConfig, Path, Path]:
    defaults = SideBySideConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default=defaults.model)
    for name in (
        "layers",
        "seq_len",
        "short_len",
        "timed_steps",
        "rounds",
        "max_probes",
        "probe_granule",
        "probe_first",
    ):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(defaults.sides))
    parser.add_argument("--probe-sides", nargs="*", choices=list(SIDES), default=list(defaults.probe_sides))
    parser.add_argument("--budget-s", type=float, default=defaults.budget_s)
    parser.add_argument("--capacity-gib", type=float, default=defaults.capacity_gib)
    parser.add_argument("--accelerator", choices=["cuda", "cpu"], default=defaults.accelerator)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/gpu_side_by_side"))
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/gpu_side_by_side_checkpoints"))
    args = vars(parser.parse_args(argv))
    out_dir, checkpoint_dir = args.pop("out_dir"), args.pop("checkpoint_dir")
    args["sides"], args["probe_sides"] = tuple(args["sides"]), tuple(args["probe_sides"])
    return SideBySideConfig(**args), out_dir, checkpoint_dir / f"{args['model']}-{args['layers']}"


def llama_config(config: SideBySideConfig, seq_len: int) -> LlamaConfig:
    return LlamaConfig(
        **{**MODELS[config.model], "num_hidden_layers": config.depth},
        max_position_embeddings=seq_len,
        rope_theta=500000.0,
        attn_implementation="sdpa",
        use_cache=False,
    )


def parameter_count(config: LlamaConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


# ----------------------------------------------------------------------------------------------
# one process: the checkpoint, the matmul rate and the sides' steps
# ----------------------------------------------------------------------------------------------
def write_checkpoint(config: SideBySideConfig, folder: Path, max_len: int, device: torch.device) -> None:
    """A seeded random model with the real proportions, saved as users' checkpoints are (once per folder)."""
    if (folder / "config.json").is_file():
        return
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(llama_config(config, max_len))
    model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).save_pretrained(folder)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def matmul_rate(device: torch.device, n: int = 8192, repeats: int = 10) -> float | None:
    """bf16 FLOP/s of an ``n^3`` product on random data (median of ``repeats`` after warm-up); None on CPU."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times)


def token_batch(seq_len: int, vocab: int, device: torch.device) -> dict[str, Tensor]:
    """``input_ids [1, N]`` of random tokens (never zeros), their positions and the shifted labels."""
    generator = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(1, vocab, (1, seq_len), generator=generator)
    shift_labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    batch = {"input_ids": ids, "position_ids": torch.arange(seq_len)[None], "shift_labels": shift_labels}
    return {key: value.to(device) for key, value in batch.items()}


class StepRecorder:
    """Each step's wall time (device synchronized at both ends) and absolute peak memory."""

    def __init__(self, device: torch.device) -> None:
        self.memory = PeakMemory(device)
        self.steps: list[dict[str, float]] = []
        self._start = 0.0

    def start(self) -> None:
        self.memory.reset()
        self._start = time.perf_counter()

    def end(self, seq_len: int) -> None:
        if self.memory.device.type == "cuda":
            torch.cuda.synchronize(self.memory.device)
        seconds = time.perf_counter() - self._start
        self.steps.append({"seq_len": seq_len, "seconds": seconds, "peak": self.memory.baseline + self.memory.peak()})


def load(folder: Path, device: torch.device) -> PreTrainedModel:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").train()


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The same AdamW on both sides (created before the engine moves the model: torch's default implementation)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-5)


def deepspeed_config(device: torch.device) -> dict[str, Any]:
    """The ZeRO-3 config ``UlyssesStrategy`` runs with, as a plain DeepSpeed loop needs it (Lightning writes
    ``gradient_clip_val=None`` as 0; DeepSpeed's own default would clip ALST alone)."""
    config = copy.deepcopy(UlyssesStrategy(stage=3).config)
    assert config is not None
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, gradient_clipping=0.0)
    if device.type == "cuda":
        config["bf16"] = {"enabled": True}
    return config


def alst_steps(folder: Path, lengths: list[int], device: torch.device, recorder: StepRecorder) -> dict[str, Any]:
    """ALST as ArcticTraining runs it on one GPU (the module docstring): one step per entry of ``lengths``."""
    import deepspeed
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF

    model = load(folder, device)
    UlyssesSPAttentionHF.register_with_transformers(  # ArcticTraining calls it whatever the size; a no-op at 1
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=1,
        micro_batch_size=1,
        seq_length_is_variable=True,
    )
    hidden_size, vocab = model.config.hidden_size, model.config.vocab_size

    def mlp_forward(mlp: Any, x: Tensor) -> Tensor:
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def tiled_mlp_forward(mlp: Any, x: Tensor) -> Tensor:  # ArcticTraining's tiled_mlp_forward_common, one rank
        params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
        return TiledMLP.apply(mlp_forward, mlp, x, math.ceil(x.shape[-2] / hidden_size), params)

    for layer in model.model.layers:
        layer.mlp.forward = tiled_mlp_forward.__get__(layer.mlp)
    model.gradient_checkpointing_enable()
    flops = TransformerFlops.from_model(model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer_for(model), config=deepspeed_config(device))
    on_gpu = device.type == "cuda"
    offload = get_checkpoint_hidden_states_offloading_ctx_manager(use_pin_memory=on_gpu, use_streams=on_gpu)

    def loss_sum(lm: Any, hidden: Tensor, shift_labels: Tensor) -> Tensor:  # ArcticTraining's fused_logits_loss_fn
        logits = lm.lm_head(hidden)
        loss = lm.loss_function(logits=logits, labels=None, vocab_size=vocab, shift_labels=shift_labels)
        return loss * (shift_labels != -100).sum()

    resident = _allocated(device)
    for seq_len in lengths:
        batch = token_batch(seq_len, vocab, device)
        shift_labels = batch.pop("shift_labels")
        shards = math.ceil(seq_len * vocab * 4 / GiB)  # ArcticTraining's "auto": ~1 GiB of fp32 logits a shard
        recorder.start()
        with offload:
            hidden = engine.module.model(**batch, use_cache=False).last_hidden_state
            total = TiledFusedLogitsLoss.apply(
                loss_sum, engine.module, hidden, shift_labels, None, shards, [engine.module.lm_head.weight], "sum"
            )
            del hidden  # as ArcticTraining's loss returns it (and ours' training_step): not kept through the backward
            engine.backward(total / (shift_labels != -100).sum())
        engine.step()
        recorder.end(seq_len)
    engine.destroy()
    return {"flops": flops, "resident": resident}


class PretrainedLM(UlyssesLossMixin, L.LightningModule):
    """A ``from_pretrained`` model trained with the loss mixin (tiled when the strategy's ``tiled_loss`` is on)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.forward_causal_lm_loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_for(self)


class _LightningSteps(L.Callback):
    def __init__(self, recorder: StepRecorder, device: torch.device, lengths: list[int]) -> None:
        self.recorder, self.device, self.lengths = recorder, device, lengths
        self.resident = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.resident = _allocated(self.device)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        self.recorder.start()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.recorder.end(self.lengths[batch_idx])


def ours_steps(
    options: dict[str, Any], folder: Path, lengths: list[int], device: torch.device, recorder: StepRecorder
) -> dict[str, Any]:
    """``UlyssesStrategy`` in ``L.Trainer``, as the README runs it: one step per entry of ``lengths``."""
    module = PretrainedLM(load(folder, device))
    flops = TransformerFlops.from_model(module.model)
    callback = _LightningSteps(recorder, device, lengths)
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        max_steps=len(lengths),
        callbacks=[callback],
        precision="bf16-mixed" if device.type == "cuda" else "32-true",
        strategy=UlyssesStrategy(sp_size=1, stage=3, attn_implementation="sdpa", **options),
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    vocab = module.model.config.vocab_size
    rows = [{"input_ids": token_batch(n, vocab, torch.device("cpu"))["input_ids"][0]} for n in lengths]
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=1))
    return {"flops": flops, "resident": callback.resident}


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def run_side(side: str, folder: Path, lengths: list[int], device: torch.device) -> dict[str, Any]:
    """One side's steps at ``lengths``: ``{"steps": [...], "flops_per_token": ..., "resident": ..., "setup_s": ...}``,
    or ``{"error": ...}`` where it ran out of memory (other failures raise)."""
    recorder = StepRecorder(device)
    start = time.perf_counter()
    options = SIDES[side]
    try:
        if options is None:
            result = alst_steps(folder, lengths, device, recorder)
        else:
            result = ours_steps(options, folder, lengths, device, recorder)
    except torch.OutOfMemoryError as error:
        return {"error": f"out of memory: {str(error).splitlines()[0]}", "steps": recorder.steps}
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    flops: TransformerFlops = result["flops"]
    return {
        "steps": recorder.steps,
        "flops_per_token": {n: flops.flops_per_token(n) for n in sorted(set(lengths))},
        "resident": result["resident"],
        "setup_s": time.perf_counter() - start - sum(s["seconds"] for s in recorder.steps),
    }


def append_record(log: Path, record: dict[str, Any]) -> None:
    """One JSON line, written at once (a run stopped later keeps it)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(json.dumps(record) + "\n")


def host_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemTotal not in /proc/meminfo")


def worker(args: dict[str, Any]) -> None:
    """One fresh process: the checkpoint (the first time), the run's record (``args["run_record"]``: device, measured
    matmul rate, parameters), then ``args["side"]``'s steps at ``args["lengths"]``, appended to ``args["log"]`` as a
    ``"side"`` record or, for a probe (one length), as a ``"probe"`` record judged against the capacity."""
    import deepspeed

    config, folder, log = SideBySideConfig(**args["config"]), Path(args["folder"]), Path(args["log"])
    on_gpu = config.accelerator == "cuda"
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    write_checkpoint(config, folder, 1 << 23, device)
    capacity = config.capacity_gib * GiB or (torch.cuda.mem_get_info(device)[1] if on_gpu else None)
    if args["run_record"]:
        name = torch.cuda.get_device_name(device) if on_gpu else f"CPU ({os.cpu_count()} cores)"
        full = dataclasses.replace(config, layers=0)
        append_record(
            log,
            {
                "kind": "run",
                "label": config.label,
                "config": dataclasses.asdict(config),
                "device": name,
                "capacity": capacity,
                "host_memory": host_memory(),
                "matmul_flops": matmul_rate(device),
                "datasheet_flops": dense_peak_flops(name, torch.bfloat16),
                "parameters": parameter_count(llama_config(config, 1)),
                "parameters_full": parameter_count(llama_config(full, 1)),
                "versions": _versions(),
            },
        )
    side, lengths = args["side"], args["lengths"]
    result = run_side(side, folder, lengths, device)
    if args["kind"] == "side":
        append_record(log, {"kind": "side", "label": config.label, "side": side, **result})
        return
    step = result["steps"][0] if result["steps"] else {}
    fits = "error" not in result and (capacity is None or step["peak"] <= capacity)
    append_record(
        log,
        {"kind": "probe", "label": config.label, "side": side, "seq_len": lengths[0], "fits": fits,
         "peak": step.get("peak"), "seconds": step.get("seconds")},
    )  # fmt: skip


def launch_side(
    config: SideBySideConfig, folder: Path, log: Path, side: str, lengths: list[int], kind: str, timeout: float,
    run_record: bool = False,
) -> None:  # fmt: skip
    """:func:`worker` in a fresh process; raises ``AssertionError`` (with its output) where it failed or was stopped.
    The CUDA allocator's setting only on CUDA: on CPU the test session forks the process from its warm one."""
    from tests.launch import launch

    args = {"config": dataclasses.asdict(config), "folder": str(folder), "log": str(log), "side": side,
            "lengths": lengths, "kind": kind, "run_record": run_record}  # fmt: skip
    on_gpu = config.accelerator == "cuda"
    allocator = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if on_gpu else None
    launch("benchmarks.gpu_side_by_side:worker", 1, args, timeout=timeout, extra_env=allocator)


def _versions() -> dict[str, str]:
    import deepspeed
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "deepspeed": deepspeed.__version__}


# ----------------------------------------------------------------------------------------------
# the parent: launches, probes, the report
# ----------------------------------------------------------------------------------------------
def read_records(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


@dataclass(frozen=True)
class SideSummary:
    """What one side measured: ``timed`` the steps at ``seq_len`` after the warm-up, the fits of memory and time."""

    side: str
    seq_len: int
    short_len: int
    step_s: float
    tokens_per_s: float
    flops_per_token: float
    peak: float  # bytes, max over the timed steps
    short_peak: float
    short_s: float
    resident: float
    setup_s: float

    @property
    def memory_slope(self) -> float:
        """Bytes per token of ``peak = a + b N``."""
        return (self.peak - self.short_peak) / (self.seq_len - self.short_len)

    @property
    def memory_intercept(self) -> float:
        return self.peak - self.memory_slope * self.seq_len

    def fitted_length(self, capacity: float, granule: int) -> int | None:
        """Where the fitted peak reaches ``CAPACITY_FRACTION`` of ``capacity``, in whole granules."""
        if self.memory_slope <= 0:
            return None
        length = (CAPACITY_FRACTION * capacity - self.memory_intercept) / self.memory_slope
        return int(length // granule * granule) if length >= granule else None

    def predicted_step_s(self, seq_len: int) -> float:
        """``t = c N + d N^2`` through the two lengths (``d >= 0``)."""
        n1, t1, n2, t2 = self.short_len, self.short_s, self.seq_len, self.step_s
        d = max(0.0, (t2 / n2 - t1 / n1) / (n2 - n1))
        c = t2 / n2 - d * n2
        return max(c * seq_len + d * seq_len**2, t2 * seq_len / n2)


def summarize(record: dict[str, Any], timed_steps: int) -> SideSummary | None:
    steps = record["steps"]
    if "error" in record or len(steps) < 2 + timed_steps:
        return None
    long, short, timed = steps[0], steps[1], steps[2:]
    seq_len = long["seq_len"]
    step_s = statistics.median(s["seconds"] for s in timed)
    return SideSummary(
        side=record["side"],
        seq_len=seq_len,
        short_len=short["seq_len"],
        step_s=step_s,
        tokens_per_s=seq_len / step_s,
        flops_per_token=record["flops_per_token"][str(seq_len)],
        peak=max(s["peak"] for s in timed),
        short_peak=short["peak"],
        short_s=short["seconds"],
        resident=record["resident"],
        setup_s=record["setup_s"],
    )


def next_length(fits: list[int], misses: list[int], first: int, granule: int) -> int | None:
    """After the fitted length ``first``: an eighth of it (in whole granules) up while all fit, down while none does,
    then bisections down to a granule."""
    step = max(granule, first // 8 // granule * granule)
    if not misses:
        return max(fits) + step
    if not fits:
        lower = min(misses) - step
        return lower if lower >= granule else None
    low, high = max(fits), min(misses)
    middle = (low + high) // 2 // granule * granule
    return middle if low < middle < high else None


def probe_longest(
    config: SideBySideConfig, summary: SideSummary, capacity: float, folder: Path, log: Path, deadline: float
) -> None:
    """Probe ``summary.side`` from its fitted length while the deadline leaves time for the next probe."""
    first = config.probe_first or summary.fitted_length(capacity, config.probe_granule)
    fits: list[int] = []
    misses: list[int] = []
    seq_len = first
    while seq_len is not None and len(fits) + len(misses) < config.max_probes:
        predicted = 30 + summary.setup_s + summary.predicted_step_s(seq_len)  # 30 s: a fresh process's imports
        left = deadline - time.monotonic()
        if predicted * 1.2 > left:
            append_record(
                log,
                {"kind": "probe_skipped", "label": config.label, "side": summary.side, "seq_len": seq_len,
                 "predicted_s": predicted, "left_s": left},
            )  # fmt: skip
            return
        try:
            launch_side(config, folder, log, summary.side, [seq_len], "probe", timeout=left)
        except AssertionError as error:  # a failed or stopped process: out of memory outside the step, or other
            out_of_memory = "out of memory" in str(error) or "OutOfMemoryError" in str(error)
            append_record(
                log,
                {"kind": "probe", "label": config.label, "side": summary.side, "seq_len": seq_len, "fits": False,
                 "peak": None, "seconds": None, "error": None if out_of_memory else str(error)[-2000:]},
            )  # fmt: skip
            if not out_of_memory:
                return
        last = read_records(log)[-1]
        (fits if last["fits"] else misses).append(seq_len)
        seq_len = next_length(fits, misses, first, config.probe_granule) if first else None


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    config, out_dir, folder = parse_args(argv)
    if config.accelerator == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_side_by_side needs a CUDA GPU (--accelerator cpu runs a functional smoke test).")
    started = time.monotonic()
    deadline = started + (config.budget_s or 24 * 3600)
    log, report = out_dir / "side_by_side.jsonl", out_dir / "side_by_side.md"
    lengths = [config.seq_len, config.short_length, *[config.seq_len] * config.timed_steps]
    for side in config.side_order:
        try:
            recorded = any(r["kind"] == "run" and r["label"] == config.label for r in read_records(log))
            launch_side(config, folder, log, side, lengths, "side", deadline - time.monotonic(), not recorded)
        except AssertionError as error:
            append_record(log, {"kind": "error", "label": config.label, "side": side, "message": str(error)[-3000:]})
        publish_report(read_records(log), report)
    publish_report(read_records(log), report)
    run = next((r for r in read_records(log)[::-1] if r["kind"] == "run" and r["label"] == config.label), None)
    capacity = run and run["capacity"]
    if config.budget_s and capacity:
        sides = {r["side"]: r for r in read_records(log) if r["kind"] == "side" and r["label"] == config.label}
        for side in config.probe_sides:
            summary = summarize(sides[side], config.timed_steps) if side in sides else None
            if summary is not None:
                probe_longest(config, summary, capacity, folder, log, deadline)
                publish_report(read_records(log), report)
    return read_records(log)


# ----------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------
def publish_report(records: list[dict[str, Any]], output: Path) -> None:
    text = render_report(records)
    output.write_text(text)
    print(text, flush=True)


def _gib(value: float | None) -> str:
    return "" if value is None else f"{value / GiB:.1f}"


def render_report(records: list[dict[str, Any]]) -> str:
    lines = [
        "# Ours against DeepSpeed ALST on one GPU (benchmarks.gpu_side_by_side)",
        "",
        "Method and the ALST side's configuration: the module docstring of `benchmarks/gpu_side_by_side.py`.",
        "",
    ]
    runs = [r for r in records if r["kind"] == "run"]
    for run in runs:
        label = run["label"]
        mine = [r for r in records if r.get("label") == label and r is not run]
        lines += _model_section(run, mine)
    errors = [r for r in records if r["kind"] == "error" and not any(r["label"] == run["label"] for run in runs)]
    for error in errors:
        lines += [f"## {error['label']}: failed before any result", "", "```", error["message"], "```", ""]
    return "\n".join(lines) + "\n"


def _model_section(run: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    config = SideBySideConfig(**{**run["config"], "sides": tuple(run["config"]["sides"]),
                                 "probe_sides": tuple(run["config"]["probe_sides"])})  # fmt: skip
    matmul, datasheet, capacity = run["matmul_flops"], run["datasheet_flops"], run["capacity"]
    lines = [
        f"## {run['label']}: {run['parameters'] / 1e9:.2f} B parameters, {run['device']}",
        "",
        f"GPU memory {_gib(capacity)} GiB, host memory {_gib(run['host_memory'])} GiB; bf16 matmul measured "
        f"{'-' if matmul is None else f'{matmul / 1e12:.0f}'} TFLOP/s, datasheet dense "
        f"{'-' if datasheet is None else f'{datasheet / 1e12:.0f}'} TFLOP/s; "
        + ", ".join(f"{k} {v}" for k, v in run["versions"].items())
        + f". {config.timed_steps} timed steps per side at {config.seq_len:,} tokens after a warm-up, one step at "
        f"{config.short_length:,}; sides in the order {', '.join(config.side_order)}.",
        "",
        "| side | tokens/s | step (s) | MFU (measured matmul) | MFU (datasheet) | peak GiB | peak GiB at short "
        "| resident GiB | fit: GiB + KiB/token | fitted longest |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    summaries: dict[str, SideSummary] = {}
    for record in (r for r in records if r["kind"] == "side"):
        summary = summarize(record, config.timed_steps)
        if summary is None:
            lines.append(f"| {record['side']} | {record.get('error', 'too few steps')} | | | | | | | | |")
            continue
        summaries[record["side"]] = summary
        achieved = summary.tokens_per_s * summary.flops_per_token
        fitted = summary.fitted_length(capacity, config.probe_granule) if capacity else None
        lines.append(
            f"| {summary.side} | {summary.tokens_per_s:,.0f} | {summary.step_s:.2f} | "
            f"{'-' if matmul is None else f'{achieved / matmul:.1%}'} | "
            f"{'-' if datasheet is None else f'{achieved / datasheet:.1%}'} | {_gib(summary.peak)} | "
            f"{_gib(summary.short_peak)} | {_gib(summary.resident)} | {_gib(summary.memory_intercept)} + "
            f"{summary.memory_slope / 1024:.1f} | {'-' if fitted is None else f'{fitted:,}'} |"
        )
    lines.append("")
    if "alst" in summaries:
        alst = summaries["alst"]
        for side, summary in summaries.items():
            if side != "alst":
                lines.append(
                    f"- {side} / alst: tokens/s {summary.tokens_per_s / alst.tokens_per_s:.3f}x, peak memory "
                    f"{summary.peak / alst.peak:.3f}x at {summary.seq_len:,} tokens"
                )
        lines.append("")
    lines += _probe_lines(records)
    if run["parameters_full"] != run["parameters"] and capacity:
        lines += _full_depth_lines(run, summaries, capacity)
    errors = [r for r in records if r["kind"] == "error"]
    for error in errors:
        lines += ["The run stopped with an error:", "", "```", error["message"], "```", ""]
    return lines


def _probe_lines(records: list[dict[str, Any]]) -> list[str]:
    probes = [r for r in records if r["kind"] in ("probe", "probe_skipped")]
    if not probes:
        return []
    lines = ["Longest sequence, probed (one step in a fresh process per length, from the fitted length):", ""]
    for side in dict.fromkeys(r["side"] for r in probes):
        mine = [r for r in probes if r["side"] == side]
        measured = [r for r in mine if r["kind"] == "probe"]
        fits = [r["seq_len"] for r in measured if r["fits"]]
        misses = [r["seq_len"] for r in measured if not r["fits"]]
        tried = ", ".join(_probe_result(r) for r in measured)
        skipped = [r for r in mine if r["kind"] == "probe_skipped"]
        stop = (
            f"; stopped before {skipped[-1]['seq_len']:,} (predicted {skipped[-1]['predicted_s']:.0f} s, "
            f"{skipped[-1]['left_s']:.0f} s left)"
            if skipped
            else ""
        )
        lines.append(
            f"- {side}: longest fit **{max(fits, default=0):,}**, shortest miss "
            f"{f'{min(misses):,}' if misses else '-'}"
            f" (tried {tried or 'nothing'}{stop})"
        )
    return [*lines, ""]


def _probe_result(record: dict[str, Any]) -> str:
    if not record["fits"]:
        return f"{record['seq_len']:,} does not fit"
    return f"{record['seq_len']:,} fits ({_gib(record['peak'])} GiB, {record['seconds']:.0f} s)"


def _full_depth_lines(run: dict[str, Any], summaries: dict[str, SideSummary], capacity: float) -> list[str]:
    """What the fit on the layer-reduced model implies at full depth (estimates, not measurements)."""
    config = run["config"]
    model = MODELS[config["model"]]
    full_layers, hidden = model["num_hidden_layers"], model["hidden_size"]
    params, params_full = run["parameters"], run["parameters_full"]
    per_layer = (params_full - params) / (full_layers - (config["layers"] or full_layers))
    outer = params - per_layer * (config["layers"] or full_layers)  # embeddings, head, final norm
    checkpoint_bytes_per_token = full_layers * hidden * 2  # each layer's bf16 input, offloaded to the host
    lines = [
        f"What this implies for all {full_layers} layers ({params_full / 1e9:.2f} B parameters; estimates from the fit,"
        " not measured): the fitted activation part (intercept minus resident state) and bytes per token taken as"
        " measured (checkpointed layer inputs leave the GPU, so the per-token peak is one layer's); the resident"
        " state scaled to the full parameter count. Host memory: the offloaded checkpoints"
        f" ({checkpoint_bytes_per_token / 1024:.0f} KiB per token at full depth) plus what is offloaded.",
        "",
        "| side | everything on the GPU | optimizer state offloaded | parameters and optimizer offloaded |",
        "|---|---|---|---|",
    ]
    usable = CAPACITY_FRACTION * capacity
    for side, s in summaries.items():
        activation_fixed = s.memory_intercept - s.resident
        per_param = s.resident / params
        cells = []
        # (GPU-resident bytes, host bytes besides the checkpoints) per placement
        for gpu_state, host_state in (
            (per_param * params_full, 0.0),
            (4.0 * params_full, 12.0 * params_full),  # bf16 weights + gradients stay; fp32 master + Adam leave
            (4.0 * (outer + per_layer), 16.0 * params_full),  # one layer and the embeddings gathered at a time
        ):
            length = (usable - activation_fixed - gpu_state) / s.memory_slope if s.memory_slope > 0 else 0
            if length < 1024:
                cells.append(f"does not fit ({_gib(gpu_state)} GiB of state)")
                continue
            host_limit = (run["host_memory"] - host_state) / checkpoint_bytes_per_token
            bound = "GPU" if length <= host_limit else "host memory"
            cells.append(f"~{min(length, max(host_limit, 0)):,.0f} tokens ({bound}-bound)")
        lines.append(f"| {side} | " + " | ".join(cells) + " |")
    return [*lines, ""]


if __name__ == "__main__":
    main(sys.argv[1:])
