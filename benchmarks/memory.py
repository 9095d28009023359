"""Peak memory per rank of one training step across sequence lengths, sp sizes and the memory options.

    python -m benchmarks.memory                            # CPU; writes docs/benchmarks/memory.{md,png}
    python -m benchmarks.memory --device cuda              # CUDA max allocated
    python -m benchmarks.memory --quick --out /tmp/bench   # the shortened run of the test suite

A fixed small Llama-style model runs forward + backward on one sequence of ``N`` tokens, sharded over
``sp`` processes (one SP group, Ulysses attention), under each configuration of
:class:`~lightning_ulysses.MemoryOptions`. Every sp size runs in its own processes and measures all
configurations and lengths there. Reported per rank (the largest over the group): the step's peak above
what was resident before it (weights and gradient buffers), its ratio to the plain sp=1 peak at the same
length, and the longest sequence whose peak fits a per-rank budget, extrapolated along the line through
the two longest measurements (activation memory is linear in N with the O(N) attention kernels).

CPU: the RSS high-water mark (``VmHWM`` after a reset through ``/proc/self/clear_refs``) in processes
started with ``MALLOC_MMAP_THRESHOLD_=65536``, so freed tensors go back to the OS and RSS follows the live
tensors. CUDA: ``torch.cuda.max_memory_allocated``. Offloading moves activations from the GPU to the host,
so it is only measured on CUDA; on CPU ``all`` offloads nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_ulysses import MemoryOptions, UlyssesLossMixin, apply_memory_options, apply_ulysses_attention
from lightning_ulysses import prepare_batch, remove_memory_options, shard_batch
from benchmarks.measure import PeakMemory
from tests.launch import launch
from tests.tiny import tiny_llama

MODEL = dict(
    vocab_size=16000, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=1 << 20,
)
CONFIGS: dict[str, MemoryOptions] = {
    "plain": MemoryOptions(),
    "tiled_mlp": MemoryOptions(tiled_mlp=True),
    "tiled_loss": MemoryOptions(tiled_loss=True),
    "checkpointing": MemoryOptions(activation_checkpointing=True),
    "checkpointing+offload": MemoryOptions(activation_checkpointing=True, offload_activations=True),
    "tiled_loss+checkpointing": MemoryOptions(tiled_loss=True, activation_checkpointing=True),
    "all": MemoryOptions(tiled_mlp=True, tiled_loss=True, activation_checkpointing=True, offload_activations=True),
}
MiB = 2**20


def worker(args: dict[str, Any]) -> dict[tuple[str, int], int]:
    """One rank of an SP group of ``WORLD_SIZE`` processes: ``{(config, seq_len): peak bytes}``."""
    device = torch.device(args["device"], int(os.environ["LOCAL_RANK"]) if args["device"] == "cuda" else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    sp_size, sp_rank = dist.get_world_size(), dist.get_rank()
    model = tiny_llama(**MODEL).to(device).train()
    apply_ulysses_attention(model, dist.group.WORLD if sp_size > 1 else None, sp_size, "sdpa")
    peaks = {}
    for name in args["configs"]:
        options = CONFIGS[name]
        apply_memory_options(model, options)
        for seq_len in [min(args["seq_lens"]), *args["seq_lens"]]:  # the first step warms up
            generator = torch.Generator().manual_seed(seq_len)
            batch = {"input_ids": torch.randint(1, MODEL["vocab_size"], (1, seq_len), generator=generator)}
            shard = {k: v.to(device) for k, v in shard_batch(prepare_batch(batch, sp_size), sp_rank, sp_size).items()}
            peaks[name, seq_len] = _peak_bytes(device, lambda: _train_step(model, shard, options))
        remove_memory_options(model)
    dist.destroy_process_group()
    return peaks


def _train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], options: MemoryOptions) -> None:
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    loss = UlyssesLossMixin()  # outside a Trainer: the plain token mean of this rank, same memory as under SP
    if options.tiled_loss:
        hidden_states = model.model(**inputs).last_hidden_state
        loss.tiled_causal_lm_loss(hidden_states, model.lm_head, batch["shift_labels"], options.tiled_loss).backward()
    else:
        loss.causal_lm_loss(model(**inputs).logits, batch["shift_labels"]).backward()
    model.zero_grad(set_to_none=False)  # keep the gradient buffers resident: they are not activations


def _peak_bytes(device: torch.device, step: Any) -> int:
    memory = PeakMemory(device)
    memory.reset()
    step()
    return memory.peak()


def longest_fitting(peaks: dict[int, float], budget: float) -> int | None:
    """Longest ``N`` under ``budget`` on the line through the peaks at the two longest measured lengths, where
    the terms that grow with ``N`` dominate (fixed per-tile buffers flatten the short end). ``None``: no growth."""
    (short, short_peak), (long, long_peak) = sorted(peaks.items())[-2:]
    slope = (long_peak - short_peak) / (long - short)
    return max(0, int(long + (budget - long_peak) / slope)) if slope > 0 else None


def markdown_table(results: dict[tuple[str, int, int], float], configs: list[str], sp_sizes: list[int],
                   seq_lens: list[int], budget: float) -> str:
    header = "| config | sp | " + " | ".join(f"N={n}: MiB (x plain sp=1)" for n in seq_lens)
    header += f" | longest N under {budget / MiB:.0f} MiB (extrapolated) |"
    lines = [header, "|" + "---|" * (len(seq_lens) + 3)]
    for config in configs:
        for sp in sp_sizes:
            cells = [f"{results[config, sp, n] / MiB:.1f} ({results[config, sp, n] / results['plain', 1, n]:.3f})"
                     for n in seq_lens]
            longest = longest_fitting({n: results[config, sp, n] for n in seq_lens}, budget)
            lines.append(f"| {config} | {sp} | " + " | ".join(cells) + f" | {'-' if longest is None else longest} |")
    return "\n".join(lines)


def plot(results: dict[tuple[str, int, int], float], configs: list[str], sp_sizes: list[int], seq_lens: list[int],
         path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sp_sizes), figsize=(5 * len(sp_sizes), 4), sharey=True, squeeze=False)
    for ax, sp in zip(axes[0], sp_sizes):
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


def main(argv: list[str] | None = None) -> dict[tuple[str, int, int], float]:
    """Run, print and write the table and plot; return ``{(config, sp, seq_len): peak bytes}``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--budget-mib", type=float, default=256.0, help="per-rank memory budget for the step")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--quick", action="store_true", help="two lengths, sp 1 and 2, plain and all: a smoke test")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    configs = [c for c in CONFIGS if args.device == "cuda" or c != "checkpointing+offload"]
    if args.quick:
        args.seq_lens, args.sp, configs = [256, 512], [1, 2], ["plain", "all"]

    results = {}
    for sp in args.sp:
        per_rank = launch("benchmarks.memory:worker", sp, {"device": args.device, "seq_lens": args.seq_lens,
                                                             "configs": configs},
                          extra_env={"MALLOC_MMAP_THRESHOLD_": "65536"})
        for config in configs:
            for n in args.seq_lens:
                results[config, sp, n] = max(rank[config, n] for rank in per_rank)

    budget = args.budget_mib * MiB
    table = markdown_table(results, configs, args.sp, args.seq_lens, budget)
    model = ", ".join(f"{k}={v}" for k, v in MODEL.items() if k != "max_position_embeddings")
    title = f"Peak step memory per rank, {args.device}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.md").write_text(
        f"# {title}\n\nMade by `{' '.join(['python -m benchmarks.memory', *argv])}` (see its docstring for the "
        f"method). Model: Llama, {model}, fp32, batch 1, one forward + backward.\n\n{table}\n\n![plot](memory.png)\n"
    )
    plot(results, configs, args.sp, args.seq_lens, args.out / "memory.png", title)
    print(table)
    return results


if __name__ == "__main__":
    main()
