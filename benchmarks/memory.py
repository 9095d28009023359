"""Peak memory per rank of one training step across sequence lengths, sp sizes and the memory options.

    python -m benchmarks.memory                            # CPU; writes docs/benchmarks/memory.{md,png}
    python -m benchmarks.memory --device cuda              # CUDA max allocated
    python -m benchmarks.memory --quick --out /tmp/bench   # the shortened run of the test suite
    python -m benchmarks.memory --no-probe                 # the table at fixed lengths only (minutes, not an hour)

A fixed small Llama-style model runs forward + backward on one sequence of ``N`` tokens, sharded over
``sp`` processes (one SP group, Ulysses attention), under each configuration of
:class:`~lightning_ulysses.memory.MemoryOptions` (``all+head_chunks``: ``all`` with head-chunked attention, which
needs an all-to-all: at sp=1 it is ``all``). Every sp size runs in its own processes and measures all configurations
and lengths there. Reported per rank (the largest over the group): the step's peak above what was resident before it
(weights and gradient buffers), its ratio to the plain sp=1 peak at the same length, and (section "Peak against sp")
its ratio to the same configuration's sp=1 peak. The longest sequence whose step fits a per-rank budget is probed,
not extrapolated (fixed loss-tile buffers set the peak of short sequences, so a line through short measurements
overestimates it): each probed length trains one step in fresh processes, doubling from ``--probe-start`` while the
peak stays under the budget, then bisecting ``--refine`` times; the table gives the bracket [longest fit, shortest
miss).

CPU: the RSS high-water mark (``VmHWM`` after a reset through ``/proc/self/clear_refs``) in processes
started with ``MALLOC_MMAP_THRESHOLD_=65536``, so freed tensors go back to the OS and RSS follows the live
tensors; the reset hands the heap's free pages back too (``malloc_trim``), else a step would reuse what earlier steps
left there and read low (by 3-15% here). CUDA: ``torch.cuda.max_memory_allocated``. Offloading moves activations from
the GPU to the host, so it is only measured on CUDA; on CPU ``all`` offloads nothing.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from datetime import date
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.measure import PeakMemory, ProbeSchedule
from lightning_ulysses import UlyssesLossMixin
from lightning_ulysses.attention.head_chunks import HeadChunks
from lightning_ulysses.hf import apply_ulysses_attention, remove_ulysses_attention
from lightning_ulysses.memory import MemoryOptions, apply_memory_options, remove_memory_options
from lightning_ulysses.sharding import prepare_batch, shard_batch
from tests.launch import launch
from tests.tiny import tiny_llama

MODEL: dict[str, Any] = dict(
    vocab_size=16000,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1 << 20,
)
ALL_OPTIONS = MemoryOptions(tiled_mlp=True, tiled_loss=True, activation_checkpointing=True, offload_activations=True)
CONFIGS: dict[str, MemoryOptions] = {
    "plain": MemoryOptions(),
    "tiled_mlp": MemoryOptions(tiled_mlp=True),
    "tiled_loss": MemoryOptions(tiled_loss=True),
    "checkpointing": MemoryOptions(activation_checkpointing=True),
    "checkpointing+offload": MemoryOptions(activation_checkpointing=True, offload_activations=True),
    "tiled_loss+checkpointing": MemoryOptions(tiled_loss=True, activation_checkpointing=True),
    "all": ALL_OPTIONS,
    "all+head_chunks": ALL_OPTIONS,
}
HEAD_CHUNKS: dict[str, HeadChunks] = {"all+head_chunks": "auto"}
"""The configurations whose attention runs in head chunks (:mod:`lightning_ulysses.attention.head_chunks`; they need
an all-to-all, so at sp=1 the attention runs whole)."""
MiB = 2**20
WARM_UP_LEN = 256


def worker(args: dict[str, Any]) -> dict[tuple[str, int], int]:
    """One rank of an SP group of ``WORLD_SIZE`` processes: ``{(config, seq_len): peak bytes}``."""
    device = torch.device(args["device"], int(os.environ["LOCAL_RANK"]) if args["device"] == "cuda" else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    sp_size, sp_rank = dist.get_world_size(), dist.get_rank()
    model = tiny_llama(**MODEL).to(device).train()
    mesh = init_device_mesh(device.type, (sp_size,)) if sp_size > 1 else None
    peaks = {}
    for name in args["configs"]:
        options = CONFIGS[name]
        apply_ulysses_attention(model, mesh, "sdpa", head_chunks=HEAD_CHUNKS.get(name))
        apply_memory_options(model, options)
        for seq_len in [WARM_UP_LEN, *args["seq_lens"]]:  # the first step warms up
            generator = torch.Generator().manual_seed(seq_len)
            batch = {"input_ids": torch.randint(1, MODEL["vocab_size"], (1, seq_len), generator=generator)}
            shard = {k: v.to(device) for k, v in shard_batch(prepare_batch(batch, sp_size), sp_rank, sp_size).items()}
            peaks[name, seq_len] = _peak_bytes(device, functools.partial(_train_step, model, shard, options))
        remove_memory_options(model)
        remove_ulysses_attention(model)
    dist.destroy_process_group()
    return peaks


def _train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], options: MemoryOptions) -> None:
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    loss = UlyssesLossMixin()  # outside a Trainer: the plain token mean of this rank, same memory as under SP
    if options.tiled_loss:
        # dropped before the backward, which the tiled loss does not need it for: a training_step returns its loss
        # and drops it (as ArcticTraining's loss does); kept here, it would add one [B, N/sp, hidden] to the peak
        hidden_states = model.model(**inputs).last_hidden_state
        tiled = loss.tiled_causal_lm_loss(hidden_states, model.lm_head, batch["shift_labels"], options.tiled_loss)
        del hidden_states
        tiled.backward()
    else:
        loss.causal_lm_loss(model(**inputs).logits, batch["shift_labels"]).backward()
    model.zero_grad(set_to_none=False)  # keep the gradient buffers resident: they are not activations


def _peak_bytes(device: torch.device, step: Any) -> int:
    memory = PeakMemory(device)
    memory.reset()
    step()
    return memory.peak()


def probe_longest(
    config: str, sp: int, device: str, budget: float, schedule: ProbeSchedule
) -> tuple[int | None, int | None]:
    """``(longest length that fits, shortest that does not)`` under ``budget`` per rank, each probe one step in
    fresh processes; None where the schedule found no such length."""
    fits: list[int] = []
    misses: list[int] = []
    while (seq_len := schedule.next(fits, misses)) is not None:
        peak = max(measure([config], sp, device, [seq_len]).values())
        (fits if peak <= budget else misses).append(seq_len)
    return max(fits, default=None), min(misses, default=None)


def measure(configs: list[str], sp: int, device: str, seq_lens: list[int]) -> dict[tuple[str, int], int]:
    """``{(config, seq_len): peak bytes}``, the largest over the ``sp`` ranks of one launch."""
    per_rank = launch(
        "benchmarks.memory:worker",
        sp,
        {"device": device, "seq_lens": seq_lens, "configs": configs},
        extra_env={"MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    return {key: max(rank[key] for rank in per_rank) for key in per_rank[0]}


def markdown_table(
    results: dict[tuple[str, int, int], float],
    configs: list[str],
    sp_sizes: list[int],
    seq_lens: list[int],
    budget: float,
    longest: dict[tuple[str, int], tuple[int | None, int | None]],
) -> str:
    """The peaks in MiB, each with its ratio to the plain sp=1 peak at its length where that was measured."""
    base = {n: results.get(("plain", 1, n)) for n in seq_lens}
    header = "| config | sp | " + " | ".join(f"N={n}: MiB" + " (x plain sp=1)" * bool(base[n]) for n in seq_lens)
    header += f" | longest N under {budget / MiB:.0f} MiB: fits, does not (probed) |" if longest else " |"
    lines = [header, "|" + "---|" * (len(seq_lens) + 2 + bool(longest))]
    for config in configs:
        for sp in sp_sizes:
            cells = []
            for n in seq_lens:
                peak, plain = results[config, sp, n], base[n]
                cells.append(f"{peak / MiB:.1f}" + (f" ({peak / plain:.3f})" if plain else ""))
            row = f"| {config} | {sp} | " + " | ".join(cells) + " |"
            if longest:
                fit, miss = longest[config, sp]
                row += f" {'-' if fit is None else fit}, {'-' if miss is None else miss} |"
            lines.append(row)
    return "\n".join(lines)


def sp_ratio_table(
    results: dict[tuple[str, int, int], float], configs: list[str], sp_sizes: list[int], seq_lens: list[int]
) -> str:
    """Each configuration's peak at sp > 1 against its own sp=1 peak at the same length (ideal: ``1 / sp``)."""
    larger = [sp for sp in sp_sizes if sp > 1]
    header = "| config | " + " | ".join(f"N={n}: sp={sp} / sp=1" for n in seq_lens for sp in larger) + " |"
    lines = [header, "|" + "---|" * (1 + len(seq_lens) * len(larger))]
    for config in configs:
        cells = [f"{results[config, sp, n] / results[config, 1, n]:.3f}" for n in seq_lens for sp in larger]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores, gloo)"


def plot(
    results: dict[tuple[str, int, int], float],
    configs: list[str],
    sp_sizes: list[int],
    seq_lens: list[int],
    path: Path,
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sp_sizes), figsize=(5 * len(sp_sizes), 4), sharey=True, squeeze=False)
    for ax, sp in zip(axes[0], sp_sizes, strict=True):
        for config in configs:
            ax.plot(seq_lens, [results[config, sp, n] / MiB for n in seq_lens], marker="o", label=config)
        ax.set(xscale="log", yscale="log", xlabel="sequence length N", title=f"sp={sp}")
        ax.minorticks_off()
        ax.set_xticks(seq_lens, [str(n) for n in seq_lens])
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("peak step memory per rank (MiB)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> tuple[dict[tuple[str, int, int], float], dict]:
    """Run, print and write the table and plot; return ``{(config, sp, seq_len): peak bytes}`` and the probed
    ``{(config, sp): (longest fit, shortest miss)}``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="the configurations (default: all)")
    parser.add_argument("--budget-mib", type=float, default=256.0, help="per-rank memory budget for the step")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--probe-start", type=int, default=1024, help="first length of the longest-N probe")
    parser.add_argument("--probe-max", type=int, default=1 << 20, help="the probe stops doubling here")
    parser.add_argument("--refine", type=int, default=3, help="bisections of the longest-N probe")
    parser.add_argument("--no-probe", action="store_true", help="skip the longest-N probe")
    parser.add_argument("--quick", action="store_true", help="two lengths, sp 1 and 2, plain and all, a short probe")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    configs = args.configs or [c for c in CONFIGS if args.device == "cuda" or c != "checkpointing+offload"]
    if args.quick:
        args.seq_lens, args.sp, configs = [256, 512], [1, 2], ["plain", "all"]
        args.budget_mib, args.probe_start, args.probe_max, args.refine = 64.0, 256, 512, 1

    results = {}
    for sp in args.sp:
        for (config, n), peak in measure(configs, sp, args.device, args.seq_lens).items():
            results[config, sp, n] = peak
    budget = args.budget_mib * MiB
    schedule = ProbeSchedule(args.probe_start, args.probe_max, args.refine)
    longest = (
        {}
        if args.no_probe
        else {
            (config, sp): probe_longest(config, sp, args.device, budget, schedule)
            for config in configs
            for sp in args.sp
        }
    )

    table = markdown_table(results, configs, args.sp, args.seq_lens, budget, longest)
    if 1 in args.sp and len(args.sp) > 1:
        table += "\n\n## Peak against sp\n\n" + sp_ratio_table(results, configs, args.sp, args.seq_lens)
    model = ", ".join(f"{k}={v}" for k, v in MODEL.items() if k != "max_position_embeddings")
    title = f"Peak step memory per rank, {args.device}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.md").write_text(
        f"# {title}\n\nMade by `{' '.join(['python -m benchmarks.memory', *argv])}` on {date.today()}, "
        f"{_machine(args.device)} (see its docstring for the method). Model: Llama, {model}, fp32, batch 1, one "
        f"forward + backward.\n\n{table}\n\n![plot](memory.png)\n"
    )
    plot(results, configs, args.sp, args.seq_lens, args.out / "memory.png", title)
    print(table)
    return results, longest


if __name__ == "__main__":
    main()
