"""UlyssesStrategy through ``L.Trainer`` against DeepSpeed ALST in a plain DeepSpeed loop, side by side.

Both sides train the same Llama-style model (``tests.tiny.tiny_llama``, MHA so that the all-to-all
formula below is exact) from the same seed, on the same batches in the same order, with the same
``sp_size``, ZeRO stage, DeepSpeed config (the one ``UlyssesStrategy`` builds) and SGD:

* **ours**: ``UlyssesStrategy`` + :class:`tests.tiny.TinyCausalLM` (token-weighted loss) in ``L.Trainer``;
* **ALST**: ``UlyssesSPAttentionHF.register_with_transformers`` + ``UlyssesSPDataLoaderAdapter`` +
  ``deepspeed.initialize(mpu=...)`` and the loss of DeepSpeed's ALST tutorial, line for line (the model's
  ``loss_function`` on pre-shifted labels, a differentiable ``all_gather`` of per-rank means weighted by
  valid tokens). As in ArcticTraining's trainer, the model outputs are freed before backward, and the
  DeepSpeed config is ours to the letter: DeepSpeed's default ``gradient_clipping`` (1.0) would clip ALST
  alone, since Lightning writes ``Trainer(gradient_clip_val=None)`` into ours as 0.

One run reports, per side: the median step time, with the two sides' steps interleaved one by one in
the same processes (after each of ours' steps, one ALST step) so that the load of the machine moves
both alike, timed the same way (wall clock from the end of the other side's step to the end of its
own: data, forward, backward, optimizer, loop overhead), plus the CPU time per step; the peak memory
of the steps (each side on its own); the bytes every all-to-all sends to other ranks (counted by
wrapping the collective each side calls) against the theory
``4 x B x (N/sp) x H x D x (sp-1)/sp x dtype_size`` per layer and direction; and the agreement of the
loss, first-step gradient norm and final weights with one process training on whole sequences.

CPU (gloo, the default here) or CUDA (NCCL). Writes a markdown report::

    python -m benchmarks.compare_alst                                     # CPU, sp=2
    python -m benchmarks.compare_alst --accelerator cuda --sp 8 --seq-len 65536 --hidden 2048 --heads 16 \\
        --layers 8 --precision bf16 --output docs/benchmarks/compare_alst_cuda.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader

from benchmarks.measure import PeakMemory, SavedForBackward, publish

REPO_ROOT = Path(__file__).resolve().parent.parent
SIDES = ("ours", "alst")
MEMORY_ORDER = ("alst", "ours", "ours", "alst")  # each side measured first once and last once


@dataclass(frozen=True)
class BenchmarkConfig:
    accelerator: str = "cpu"
    sp: int = 2
    stage: int = 3
    batch_size: int = 2
    seq_len: int = 1024
    hidden: int = 128
    heads: int = 4
    layers: int = 2
    intermediate: int = 256
    vocab: int = 512
    precision: str = "32"
    steps: int = 4
    timed_steps: int = 40
    lr: float = 0.5

    def __post_init__(self) -> None:
        if self.steps % self.sp:
            raise ValueError(
                f"--steps ({self.steps}) must be a multiple of --sp ({self.sp}): ALST's dataloader adapter feeds "
                "the SP group one batch per rank in turn, and a rank that runs out first would hang."
            )
        if self.timed_steps < 4:
            raise ValueError(f"--timed-steps must be at least 4 (quartiles of the step pairs), got {self.timed_steps}.")
        if self.heads % self.sp or self.hidden % self.heads:
            raise ValueError(f"--heads ({self.heads}) must divide by --sp and divide --hidden ({self.hidden}).")
        if self.precision not in ("32", "bf16"):
            raise ValueError(f"--precision must be '32' or 'bf16', got {self.precision!r}.")

    @property
    def model_overrides(self) -> dict[str, Any]:
        return dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=self.seq_len,
        )

    @property
    def dtype_size(self) -> int:
        return 2 if self.precision == "bf16" else 4

    @property
    def theoretical_bytes_per_layer(self) -> float:
        """Bytes one rank sends to the others per attention layer and direction: q, k, v in, output back."""
        head_dim = self.hidden // self.heads
        local = self.batch_size * (self.seq_len // self.sp) * self.heads * head_dim
        return 4 * local * (self.sp - 1) / self.sp * self.dtype_size


def parse_args(argv: list[str] | None = None) -> tuple[BenchmarkConfig, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field in dataclasses.fields(BenchmarkConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "docs" / "benchmarks" / "compare_alst.md")
    args = vars(parser.parse_args(argv))
    output = args.pop("output")
    return BenchmarkConfig(**args), output


def make_batches(config: BenchmarkConfig) -> list[dict[str, Tensor]]:
    """``config.steps`` batches of random tokens: ``input_ids``, ``labels``, ``position_ids``, all ``[B, N]``."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(config.steps):
        ids = torch.randint(1, config.vocab, (config.batch_size, config.seq_len), generator=generator)
        positions = torch.arange(config.seq_len).expand_as(ids).clone()
        batches.append({"input_ids": ids, "labels": ids.clone(), "position_ids": positions})
    return batches


# ----------------------------------------------------------------------------------------------
# measurement helpers
# ----------------------------------------------------------------------------------------------
@dataclass
class AllToAllCounter:
    """Counts calls of a wrapped all-to-all and the bytes each call sends to the other ranks."""

    calls: int = 0
    bytes_to_peers: int = 0

    def count(self, send: Tensor, group: dist.ProcessGroup | None) -> None:
        world = dist.get_world_size(group)
        self.calls += 1
        self.bytes_to_peers += send.numel() * send.element_size() * (world - 1) // world  # even split


def install_counters() -> dict[str, AllToAllCounter]:
    """Wrap the collective each side calls: ours ``lightning_ulysses.attention.collectives.all_to_all``; ALST's exchange
    operator calls ``deepspeed.comm.all_to_all_single``."""
    import deepspeed.comm

    import lightning_ulysses.attention.collectives as ours

    counters = {side: AllToAllCounter() for side in SIDES}
    ours_all_to_all, ds_all_to_all_single = ours.all_to_all, deepspeed.comm.all_to_all_single

    def counted_all_to_all(x: Tensor, group: dist.ProcessGroup, *args: Any) -> Tensor:
        counters["ours"].count(x, group)
        return ours_all_to_all(x, group, *args)

    def counted_all_to_all_single(output: Tensor, input: Tensor, *args: Any, **kwargs: Any) -> Any:
        counters["alst"].count(input, kwargs.get("group"))
        return ds_all_to_all_single(output, input, *args, **kwargs)

    ours.all_to_all = counted_all_to_all
    deepspeed.comm.all_to_all_single = counted_all_to_all_single
    return counters


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def full_grad_norm(parameters: list[torch.nn.Parameter]) -> float:
    """Norm of the reduced gradient, assembled from DeepSpeed's partitions (a collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_grad

    return torch.cat([safe_get_full_grad(p).float().flatten() for p in parameters]).norm().item()


def gathered_parameters(model: torch.nn.Module, stage: int) -> dict[str, Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
        return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


@dataclass
class Block:
    """What one side measured over ``config.steps`` steps run on their own (not interleaved)."""

    peak_memory: int
    all_to_all_calls: int
    all_to_all_bytes: int
    losses: list[float]
    grad_norm: float | None = None
    params: dict[str, Tensor] | None = None
    saved_for_backward: int | None = None  # first step, agreement blocks only


@dataclass
class Timing:
    """Step times of the interleaved phase on one rank: wall clock and this process's CPU time (seconds)."""

    wall: dict[str, list[float]] = dataclasses.field(default_factory=lambda: {side: [] for side in SIDES})
    cpu: dict[str, list[float]] = dataclasses.field(default_factory=lambda: {side: [] for side in SIDES})

    def add(self, side: str, start: tuple[float, float], end: tuple[float, float]) -> None:
        self.wall[side].append(end[0] - start[0])
        self.cpu[side].append(end[1] - start[1])


def _now(device: torch.device) -> tuple[float, float]:
    synchronize(device)
    return time.perf_counter(), time.process_time()


# ----------------------------------------------------------------------------------------------
# the two sides
# ----------------------------------------------------------------------------------------------
def ours_fit(config: BenchmarkConfig, batches: list[dict[str, Tensor]], callback: L.Callback) -> L.LightningModule:
    """Train ours on ``batches`` in order (every rank reads every batch; the strategy keeps its shard)."""
    from lightning_ulysses import UlyssesStrategy
    from tests.tiny import TinyCausalLM, collate

    module = TinyCausalLM(lr=config.lr, **config.model_overrides)
    trainer = L.Trainer(
        accelerator=config.accelerator,
        devices=config.sp,
        max_steps=len(batches),
        callbacks=[callback],
        strategy=UlyssesStrategy(sp_size=config.sp, stage=config.stage, attn_implementation="sdpa"),
        precision="bf16-mixed" if config.precision == "bf16" else "32-true",
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    rows = [{key: value[i] for key, value in batch.items()} for batch in batches for i in range(config.batch_size)]
    trainer.fit(module, DataLoader(rows, batch_size=config.batch_size, collate_fn=collate))
    return module


class _OursBlock(L.Callback):
    def __init__(self, device: torch.device, check_agreement: bool) -> None:
        self.memory = PeakMemory(device)
        self.check_agreement = check_agreement
        self.grad_norm: float | None = None
        self.peak = 0
        self.saved: SavedForBackward | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.memory.reset()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.check_agreement and self.saved is None:
            self.saved = SavedForBackward().__enter__()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        if self.saved is not None and trainer.global_step == 0:
            self.saved.__exit__()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.check_agreement and self.grad_norm is None:
            self.grad_norm = full_grad_norm(list(pl_module.parameters()))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peak = self.memory.peak()


def run_ours(
    config: BenchmarkConfig, batches: list[dict[str, Tensor]], counter: AllToAllCounter, check_agreement: bool
) -> Block:
    recorder = _OursBlock(_device(config), check_agreement)
    calls, sent = counter.calls, counter.bytes_to_peers
    module = ours_fit(config, batches, recorder)
    return Block(
        peak_memory=recorder.peak,
        all_to_all_calls=counter.calls - calls,
        all_to_all_bytes=counter.bytes_to_peers - sent,
        losses=module.losses,
        grad_norm=recorder.grad_norm,
        params=gathered_parameters(module.model, config.stage) if check_agreement else None,
        saved_for_backward=recorder.saved.bytes if recorder.saved else None,
    )


def register_alst(config: BenchmarkConfig) -> Any:
    """Install ALST's attention (it replaces transformers' ``"sdpa"`` entry in this process) and its SP groups."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from tests.tiny import tiny_llama

    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=tiny_llama(**config.model_overrides),
        core_attn_implementation="sdpa",
        sequence_parallel_size=config.sp,
        micro_batch_size=config.batch_size,
        seq_length_is_variable=True,
    )


def alst_loss(model: torch.nn.Module, logits: Tensor, shift_labels: Tensor, sp_group: dist.ProcessGroup) -> Tensor:
    """The loss of DeepSpeed's ALST tutorial, line for line: the model's own ``loss_function`` on this rank's
    pre-shifted labels, then the per-rank means all-gathered with autograd and weighted by valid tokens."""
    from torch.distributed.nn.functional import all_gather

    loss = model.loss_function(
        logits=logits, labels=None, shift_labels=shift_labels, vocab_size=model.config.vocab_size
    )
    good_tokens = (shift_labels != -100).view(-1).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather is deprecated in favour of functional collectives
        losses_per_rank = all_gather(loss, group=sp_group)
        good_tokens_per_rank = all_gather(good_tokens, group=sp_group)
    total_loss = sum(losses_per_rank[rank] * good_tokens_per_rank[rank] for rank in range(len(losses_per_rank)))
    return total_loss / max(sum(good_tokens_per_rank), 1)


class AlstLoop:
    """ALST in a plain DeepSpeed loop: ``deepspeed.initialize(mpu=...)``, the dataloader adapter, the ALST loss."""

    def __init__(self, config: BenchmarkConfig, batches: list[dict[str, Tensor]], mpu: Any) -> None:
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        from lightning_ulysses import UlyssesStrategy
        from tests.tiny import tiny_llama

        self.device = _device(config)
        model = tiny_llama(**config.model_overrides)
        ds_config = copy.deepcopy(UlyssesStrategy(stage=config.stage).config)  # the ZeRO settings ours runs with
        # Lightning writes Trainer(gradient_clip_val=None) into ours as 0.0; DeepSpeed's own default is 1.0, which
        # clipped ALST's updates whenever the gradient norm passed 1 (the "ALST differs from one process" of larger
        # models)
        ds_config.update(
            train_micro_batch_size_per_gpu=config.batch_size, gradient_accumulation_steps=1, gradient_clipping=0.0
        )
        if config.precision == "bf16":
            ds_config["bf16"] = {"enabled": True}
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=config.lr), config=ds_config, mpu=mpu
        )
        self.sp_group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
        # the adapter feeds the group rank r's next batch at every r-th step: deal the batches so the order is the same
        self.batches: Iterator[dict[str, Tensor]] = iter(
            UlyssesSPDataLoaderAdapter(
                DataLoader(batches[sp_rank :: config.sp], batch_size=None),
                sp_rank=sp_rank,
                sp_group=self.sp_group,
                sp_world_size=config.sp,
                device=self.device,
            )
        )
        self.losses: list[float] = []
        self.grad_norm: float | None = None
        self.saved_for_backward: int | None = None

    def step(self, check_agreement: bool = False) -> None:
        batch = {key: value.to(self.device) for key, value in next(self.batches).items()}
        shift_labels = batch.pop(
            "shift_labels"
        ).contiguous()  # the adapter's slice of [B > 1, N]; loss_function views it
        record = check_agreement and self.saved_for_backward is None
        with SavedForBackward() if record else contextlib.nullcontext() as saved:
            outputs = self.engine(**batch)
            loss = alst_loss(self.engine.module, outputs.logits, shift_labels, self.sp_group)
        if record:
            self.saved_for_backward = saved.bytes
        # ArcticTraining's trainer frees the outputs before backward (the tutorial's loop keeps them, and with them
        # the [B, N/sp, V] logits, alive through backward: that would charge ALST memory ours does not spend)
        del outputs
        self.engine.backward(loss)
        if check_agreement and self.grad_norm is None:
            self.grad_norm = full_grad_norm(list(self.engine.module.parameters()))
        self.engine.step()
        self.losses.append(loss.item())


def run_alst(
    config: BenchmarkConfig, batches: list[dict[str, Tensor]], mpu: Any, counter: AllToAllCounter, check_agreement: bool
) -> Block:
    loop = AlstLoop(config, batches, mpu)
    memory = PeakMemory(loop.device)
    memory.reset()
    calls, sent = counter.calls, counter.bytes_to_peers
    for _ in batches:
        loop.step(check_agreement)
    block = Block(
        peak_memory=memory.peak(),
        all_to_all_calls=counter.calls - calls,
        all_to_all_bytes=counter.bytes_to_peers - sent,
        losses=loop.losses,
        grad_norm=loop.grad_norm,
        params=gathered_parameters(loop.engine.module, config.stage) if check_agreement else None,
        saved_for_backward=loop.saved_for_backward,
    )
    loop.engine.destroy()
    return block


class _Interleave(L.Callback):
    """After each of ours' steps, one ALST step: ours' step time runs from the end of the previous ALST step to
    the end of ours' step (data, forward, backward, optimizer, Lightning's loop), ALST's over its whole step."""

    def __init__(self, alst: AlstLoop) -> None:
        self.alst = alst
        self.timing = Timing()
        self.alst_end: tuple[float, float] | None = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        ours_end = _now(self.alst.device)
        self.alst.step()
        alst_end = _now(self.alst.device)
        if self.alst_end is not None:  # the first pair is warm-up (iterators, first allocations)
            self.timing.add("ours", self.alst_end, ours_end)
            self.timing.add("alst", ours_end, alst_end)
        self.alst_end = alst_end


def run_interleaved(config: BenchmarkConfig, batches: list[dict[str, Tensor]], mpu: Any) -> Timing:
    # + the warm-up pair, rounded up to whole refills of ALST's adapter (a rank left without a batch would hang)
    count = -(-(config.timed_steps + 1) // config.sp) * config.sp
    timed = (batches * count)[:count]
    interleave = _Interleave(AlstLoop(config, timed, mpu))
    ours_fit(config, timed, interleave)
    interleave.alst.engine.destroy()
    return interleave.timing


def _device(config: BenchmarkConfig) -> torch.device:
    if config.accelerator == "cuda":
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")


def worker(args: dict[str, Any]) -> dict[str, Any]:
    """One rank: an agreement block per side (ours, ALST), memory blocks in ``MEMORY_ORDER``, then the timed phase
    with the two sides' steps interleaved one by one."""
    config = BenchmarkConfig(**args["config"])
    if config.accelerator == "cuda":
        torch.cuda.set_device(_device(config))
    batches = make_batches(config)
    counters = install_counters()
    agreement = {"ours": run_ours(config, batches, counters["ours"], check_agreement=True)}
    mpu = register_alst(config)  # after ours' first fit: the default process group exists
    agreement["alst"] = run_alst(config, batches, mpu, counters["alst"], check_agreement=True)
    memory: dict[str, list[Block]] = {side: [] for side in SIDES}
    for side in MEMORY_ORDER:
        if side == "alst":
            memory[side].append(run_alst(config, batches, mpu, counters["alst"], check_agreement=False))
        else:
            memory[side].append(run_ours(config, batches, counters["ours"], check_agreement=False))
    return {"agreement": agreement, "memory": memory, "timing": run_interleaved(config, batches, mpu)}


# ----------------------------------------------------------------------------------------------
# reference and report
# ----------------------------------------------------------------------------------------------
@dataclass
class Reference:
    losses: list[float]
    grad_norm: float
    initial: dict[str, Tensor]
    final: dict[str, Tensor]


def single_process_reference(config: BenchmarkConfig, batches: list[dict[str, Tensor]]) -> Reference:
    """Plain transformers on whole sequences, one process (one GPU under ``--accelerator cuda``), same SGD, fp32."""
    from tests.tiny import reference_loss, tiny_llama

    device = torch.device(config.accelerator)
    model = tiny_llama(**config.model_overrides).to(device)
    initial = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    losses, grad_norm = [], None
    for batch in batches:
        loss = reference_loss(model, {key: batch[key].to(device) for key in ("input_ids", "labels")})
        loss.backward()
        if grad_norm is None:
            grad_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return Reference(losses, grad_norm, initial, {n: p.detach().cpu().clone() for n, p in model.named_parameters()})


@dataclass(frozen=True)
class SideSummary:
    median_step_time: float  # wall clock, interleaved phase, all ranks
    median_cpu_time: float  # process CPU time per step, same steps
    peak_memory: float  # of the steps, mean of the side's blocks, max over ranks
    saved_for_backward: int  # first step, rank 0
    all_to_all_calls_per_step: float
    all_to_all_bytes_per_layer: float  # per direction (forward or backward)
    max_loss_error: float  # relative, over all steps, rank 0
    grad_norm_ratio: float  # first step, this side / one process
    weight_update_error: float  # |w - w_ref| / |w_ref - w_0|, worst rank


def summarize(config: BenchmarkConfig, side: str, results: list[dict[str, Any]], reference: Reference) -> SideSummary:
    from tests.tiny import relative_update_error

    agreement = [r["agreement"][side] for r in results]
    losses, expected = torch.tensor(agreement[0].losses), torch.tensor(reference.losses)
    return SideSummary(
        median_step_time=statistics.median(t for r in results for t in r["timing"].wall[side]),
        median_cpu_time=statistics.median(t for r in results for t in r["timing"].cpu[side]),
        peak_memory=max(statistics.mean(block.peak_memory for block in r["memory"][side]) for r in results),
        saved_for_backward=agreement[0].saved_for_backward,
        all_to_all_calls_per_step=agreement[0].all_to_all_calls / config.steps,
        all_to_all_bytes_per_layer=agreement[0].all_to_all_bytes / config.steps / (2 * config.layers),
        max_loss_error=((losses - expected).abs() / expected.abs()).max().item(),
        grad_norm_ratio=agreement[0].grad_norm / reference.grad_norm,
        weight_update_error=max(relative_update_error(reference.initial, reference.final, a.params) for a in agreement),
    )


def paired_ratios(results: list[dict[str, Any]]) -> list[float]:
    """ours / ALST wall time of each interleaved step pair (rank 0): their quartiles show the noise."""
    timing = results[0]["timing"]
    return [o / a for o, a in zip(timing.wall["ours"], timing.wall["alst"])]


def render_report(
    config: BenchmarkConfig, summaries: dict[str, SideSummary], ratios: list[float], command: str, device: str
) -> str:
    ours, alst = summaries["ours"], summaries["alst"]
    theory = config.theoretical_bytes_per_layer
    quartiles = statistics.quantiles(ratios, n=4)

    def row(name: str, fmt: Callable[[SideSummary], str], ratio: str = "") -> str:
        return f"| {name} | {fmt(ours)} | {fmt(alst)} | {ratio} |"

    lines = [
        "# UlyssesStrategy vs DeepSpeed ALST",
        "",
        f"Made by `{command}` on {device}.",
        "",
        f"Model: Llama, hidden {config.hidden}, {config.heads} heads (MHA), {config.layers} layers, vocab "
        f"{config.vocab}; batch {config.batch_size} x {config.seq_len} tokens; sp={config.sp}, ZeRO-{config.stage}, "
        f"precision {config.precision}, SGD lr {config.lr}. Agreement and memory: {config.steps} steps per side on "
        f"their own; step times: {config.timed_steps} steps per side, interleaved one by one.",
        "",
        "| | ours (UlyssesStrategy, L.Trainer) | ALST (DeepSpeed loop) | ours / ALST |",
        "|---|---|---|---|",
        row(
            "median step time, wall clock (s)",
            lambda s: f"{s.median_step_time:.4f}",
            f"**{ours.median_step_time / alst.median_step_time:.3f}**",
        ),
        row("step pair ratio, quartiles (rank 0)", lambda s: "", " / ".join(f"{q:.3f}" for q in quartiles)),
        row(
            "median CPU time per step and process (s)",
            lambda s: f"{s.median_cpu_time:.4f}",
            f"{ours.median_cpu_time / alst.median_cpu_time:.3f}",
        ),
        row(
            "peak memory of the steps (MiB, rank max)",
            lambda s: f"{s.peak_memory / 2**20:.1f}",
            f"**{ours.peak_memory / alst.peak_memory:.3f}**",
        ),
        row(
            "activations saved for backward, first step (MiB, rank 0)",
            lambda s: f"{s.saved_for_backward / 2**20:.1f}",
            f"{ours.saved_for_backward / alst.saved_for_backward:.3f}",
        ),
        row("all-to-all calls per step", lambda s: f"{s.all_to_all_calls_per_step:g}"),
        row(
            "all-to-all bytes per layer and direction",
            lambda s: f"{s.all_to_all_bytes_per_layer:.0f}",
            f"theory {theory:.0f}",
        ),
        row("bytes / theory", lambda s: f"{s.all_to_all_bytes_per_layer / theory:.4f}"),
        row("max relative loss error vs one process", lambda s: f"{s.max_loss_error:.1e}"),
        row("first-step gradient norm / one process", lambda s: f"{s.grad_norm_ratio:.4f}"),
        row("relative weight-update error after all steps", lambda s: f"{s.weight_update_error:.1e}"),
        "",
        "How the numbers are made:",
        "",
        "- Step time: after each of ours' steps one ALST step runs in the same processes; each side's step is",
        "  timed from the end of the other side's step to the end of its own optimizer step (data loading and",
        "  sharding, forward, backward, optimizer, loop overhead), the first pair skipped. CPU time is the",
        "  process CPU time over the same interval (less sensitive to other load on a shared machine).",
        "- Peak memory: each side alone, from after engine set-up to the end of its steps, in the block order",
        f"  {', '.join(MEMORY_ORDER)} (each side first once and last once), averaged per side; CUDA allocator peak,",
        "  or on CPU the RSS high-water mark with `MALLOC_MMAP_THRESHOLD_=65536` (freed buffers leave the process).",
        "- Saved for backward: the distinct storages autograd saves during the first step's forward and loss",
        "  (`torch.autograd.graph.saved_tensors_hooks`, agreement blocks): what the step keeps alive, where the peak",
        "  also counts transient buffers.",
        "- All-to-all bytes: ours wraps `lightning_ulysses.attention.collectives.all_to_all`, ALST's exchange "
        "operator calls",  # one line of the report, as before (two literals: within the code's line length)
        "  `deepspeed.comm.all_to_all_single`, which is wrapped; bytes sent to other ranks, per attention layer",
        "  and direction (forward and backward move the same amount).",
        "- Agreement: the same batches in the same order through plain transformers in one process on whole",
        "  sequences, same SGD. Loss error: rank 0's loss of every step. Gradient norm: DeepSpeed's reduced",
        "  gradient of the first step (`safe_get_full_grad`). Weight-update error: `|w - w_ref| / |w_ref - w_0|`.",
        "- ALST's loss recipe (per-rank means, all-gathered with autograd, token-weighted) makes every SP rank",
        "  return the whole group's loss, so the gradient reaching the parameters is `sp` times the group's; with",
        "  `mpu`, DeepSpeed ZeRO-3 divides it back out (it averages over all ranks), ZeRO-1/2 do not (they",
        f"  average over the data-parallel ranks only). Here, ZeRO-{config.stage}: ALST's gradient is "
        f"{alst.grad_norm_ratio:.4f} x one process's, ours {ours.grad_norm_ratio:.4f} x (ours is exact under",
        "  ZeRO-1/2/3 alike: it gives DeepSpeed no `mpu` and scales its loss for that, see "
        "`tests/test_equivalence.py`).",  # one line of the report, as above
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, SideSummary]:
    from tests.launch import launch

    config, output = parse_args(argv)
    results = launch(
        "benchmarks.compare_alst:worker",
        config.sp,
        {"config": dataclasses.asdict(config)},
        timeout=3600,
        extra_env={"MALLOC_MMAP_THRESHOLD_": "65536"},  # freed buffers leave the process: RSS peaks are exact
    )
    reference = single_process_reference(config, make_batches(config))
    summaries = {side: summarize(config, side, results, reference) for side in SIDES}
    ratios = paired_ratios(results)
    device = torch.cuda.get_device_name() if config.accelerator == "cuda" else f"CPU ({os.cpu_count()} cores, gloo)"
    command = "python -m benchmarks.compare_alst " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = render_report(config, summaries, ratios, command.strip(), device)
    publish(report, output)
    return summaries


if __name__ == "__main__":
    main()
