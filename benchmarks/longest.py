"""The longest sequence under a per-rank budget: UlyssesStrategy's memory options against DeepSpeed ALST's, probed.

    nice -n 10 python -m benchmarks.longest                      # CPU, gloo, sp=2; writes docs/benchmarks/longest.md
    nice -n 10 python -m benchmarks.longest --no-probe --breakdown 32768   # only where one step's peak goes
    nice -n 10 python -m benchmarks.longest --ruler tensors --out docs/benchmarks/longest_tensors.md   # tensors only

Model, budget and method are :mod:`benchmarks.memory`'s (its ``MODEL``: 8 heads, 4 K/V heads of 16, hidden 128,
2 layers, vocabulary 16000, fp32; 256 MiB per rank; batch 1, one forward + backward, no optimizer; the step's peak
above the resident weights and gradients, largest rank). Three sides, each in its own processes:

* ``ours``: :func:`~lightning_ulysses.hf.apply_ulysses_attention` (sdpa) with all memory options (tiled MLP, tiled loss,
  activation checkpointing, offload), as :mod:`benchmarks.memory` runs ``all``;
* ``ours, head_chunks=auto``: the same with head-chunked attention (:mod:`lightning_ulysses.attention.head_chunks`);
* ``ours, head_chunks=auto, fused_norms``: and with every RMSNorm fused (:mod:`lightning_ulysses.norms`; DeepSpeed's
  pieces have no equivalent, so the ALST side keeps transformers' RMSNorm);
* ``alst``: DeepSpeed's own pieces with the equivalent options: ``UlyssesSPAttentionHF.register_with_transformers``
  (sdpa core), ``TiledMLP`` on every layer's MLP and ``TiledFusedLogitsLoss`` for the loss (both with DeepSpeed's
  documented ``ceil(tokens / hidden)`` tiles, agreed over the ranks, the count ours picks), transformers' own
  non-reentrant activation checkpointing, and the loss of ArcticTraining's tiled-loss path (the tile losses summed,
  divided by the rank's valid tokens).

**Offload on CPU.** Offloading moves the checkpointed layer inputs from the GPU to host memory; on CPU they are host
memory already, so neither side moves anything (ours keeps CPU tensors where they are; ALST's offload is
ArcticTraining's, not DeepSpeed's, and is not run): both sides' peaks count those inputs in full. The breakdown shows
them on their own line (``kept from the forward``), which is what a GPU would move out.

**Longest N** is probed, never extrapolated: each length one step in fresh processes (after a 256-token warm-up step),
doubling from ``--probe-start`` while the peak stays under the budget, then ``--refine`` bisections
(:class:`~benchmarks.measure.ProbeSchedule`); the result is the bracket [longest fit, shortest miss). The sides'
probes run at the same time (each its own processes; only memory is measured, and a process's peak does not depend
on the others). Each length's peak is appended to ``--log`` as it is measured.

**Rulers** (``--ruler``). ``rss`` (the default): the process's RSS high-water mark above its level at the step's start
(:class:`~benchmarks.measure.PeakMemory`), everything the process holds. That includes host-side bookkeeping a GPU
keeps in host memory, not in its own: autograd's graph and Python state of every tile's checkpoint region, and the
heap pages of the small buffers freed between them (ours: 38.5 MiB above the tensors at 102400 tokens; ALST's
``TiledMLP`` runs its tiles without a graph: 2.6 MiB at 73728). ``tensors``: the peak of the tensor storages the step
makes (:class:`~benchmarks.measure.LiveTensors`), what a GPU's allocator would hold; it misses buffers a kernel
allocates below the dispatcher, and, being a dispatch mode, makes autograd add gradients out of place (one buffer
more where a gradient is summed from parts). The ruler is recorded with each logged length; the table shows one
ruler's lengths.

**Breakdown** (``--breakdown N``): one step at ``N`` per side under :class:`~benchmarks.measure.LiveTensors`, which
tracks every tensor storage an operator makes during the step and, at the step's peak of live bytes, splits them by
what made them: ``forward`` (made by the forward and still alive: what the step keeps for its backward),
``recompute`` (made while the backward re-runs a module: checkpointed layers, MLP and loss tiles) and ``backward``
(made by an autograd node: gradients and their buffers), each by module or node.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.measure import LiveTensors, PeakMemory, ProbeSchedule, publish
from benchmarks.memory import CONFIGS, MODEL, WARM_UP_LEN, _train_step
from lightning_ulysses.attention.head_chunks import HeadChunks
from lightning_ulysses.hf import apply_ulysses_attention
from lightning_ulysses.memory import apply_memory_options
from lightning_ulysses.sharding import prepare_batch, shard_batch
from tests.launch import launch
from tests.tiny import tiny_llama

MiB = 2**20
SIDES: dict[str, tuple[HeadChunks | None, bool]] = {  # ours: (head_chunks, fused_norms)
    "ours": (None, False),
    "ours, head_chunks=auto": ("auto", False),
    "ours, head_chunks=auto, fused_norms": ("auto", True),
    "alst": (None, False),
}
STEP_TIMEOUT = 3 * 3600  # a CPU step at 100k+ tokens runs for many minutes on a shared machine


def worker(args: dict[str, Any]) -> dict[str, Any]:
    """One rank of ``args["side"]``: the step's peak at each of ``args["seq_lens"]`` (after a warm-up step) and, with
    ``args["breakdown"]``, the live tensors at the peak of each step."""
    dist.init_process_group("gloo")
    sp, rank = dist.get_world_size(), dist.get_rank()
    side = args["side"]
    model = tiny_llama(**MODEL).train()
    if side == "alst":
        step = _alst(model, sp)
    else:
        head_chunks, fused_norms = SIDES[side]
        options = dataclasses.replace(CONFIGS["all"], fused_norms=fused_norms)
        apply_ulysses_attention(model, init_device_mesh("cpu", (sp,)), "sdpa", head_chunks=head_chunks)
        apply_memory_options(model, options)

        def step(batch: dict[str, torch.Tensor]) -> None:
            _train_step(model, batch, options)

    results: dict[str, Any] = {}
    for seq_len in [WARM_UP_LEN, *args["seq_lens"]]:
        generator = torch.Generator().manual_seed(seq_len)
        batch = {"input_ids": torch.randint(1, MODEL["vocab_size"], (1, seq_len), generator=generator)}
        shard = shard_batch(prepare_batch(batch, sp), rank, sp)
        memory = PeakMemory(torch.device("cpu"))
        memory.reset()
        start, cpu_start = time.perf_counter(), time.process_time()
        if args["breakdown"]:
            with LiveTensors(model) as live:
                step(shard)
            results[f"live {seq_len}"] = live.report()
        else:
            step(shard)
        results[f"peak {seq_len}"] = memory.peak()
        results[f"time {seq_len}"] = time.perf_counter() - start
        results[f"cpu {seq_len}"] = time.process_time() - cpu_start
    dist.destroy_process_group()
    return results


def _alst(model: Any, sp: int) -> Any:
    """ALST's equivalent of ``all`` on ``model``, from DeepSpeed's pieces; returns its training step."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend="gloo")
    UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=sp,
        micro_batch_size=1,
        seq_length_is_variable=True,
    )
    hidden_size = model.config.hidden_size

    def agreed_shards(tokens: int) -> int:
        """TiledMLP's documented count: ``ceil(tokens / hidden)``, the largest of the ranks."""
        shards = torch.tensor(math.ceil(tokens / hidden_size))
        dist.all_reduce(shards, op=dist.ReduceOp.MAX)
        return int(shards.item())

    def mlp_forward(mlp: Any, x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def tiled_mlp_forward(mlp: Any, x: torch.Tensor) -> torch.Tensor:
        params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
        return TiledMLP.apply(mlp_forward, mlp, x, agreed_shards(x.shape[-2]), params)

    for layer in model.model.layers:
        layer.mlp.forward = tiled_mlp_forward.__get__(layer.mlp)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def loss_fn(lm: Any, hidden: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        """ArcticTraining's tiled-loss function: one tile's mean loss times its valid tokens."""
        logits = lm.lm_head(hidden)
        loss = lm.loss_function(logits=logits, labels=None, shift_labels=shift_labels, vocab_size=lm.config.vocab_size)
        return loss * (shift_labels != -100).sum()

    def step(batch: dict[str, torch.Tensor]) -> None:
        hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
        labels = batch["shift_labels"]
        shards = agreed_shards(labels.shape[-1])
        loss_sum = TiledFusedLogitsLoss.apply(
            loss_fn, model, hidden, labels, None, shards, [model.lm_head.weight], "sum"
        )
        del hidden  # as ArcticTraining's loss returns it: not kept through the backward (ours: _train_step)
        (loss_sum / (labels != -100).sum().clamp(min=1)).backward()
        model.zero_grad(set_to_none=False)

    return step


def measure(side: str, sp: int, seq_lens: list[int], breakdown: bool = False) -> list[dict[str, Any]]:
    """Each rank's results of one launch of ``side``."""
    return launch(
        "benchmarks.longest:worker",
        sp,
        {"side": side, "seq_lens": seq_lens, "breakdown": breakdown},
        timeout=STEP_TIMEOUT,
        extra_env={"MALLOC_MMAP_THRESHOLD_": "65536"},
    )


Ruler = Literal["rss", "tensors"]
RULER_UNITS: dict[str, str] = {"rss": "MiB", "tensors": "MiB of tensors"}  # as each ruler's lengths are logged


def peak_of(result: dict[str, Any], seq_len: int, ruler: Ruler) -> int:
    """One rank's peak at ``seq_len`` by ``ruler`` (see the module docstring)."""
    return result[f"peak {seq_len}"] if ruler == "rss" else result[f"live {seq_len}"]["peak"]


def probe_longest(
    side: str, sp: int, budget: float, schedule: ProbeSchedule, log: Path, ruler: Ruler = "rss"
) -> tuple[int | None, int | None]:
    """``(longest length that fits, shortest that does not)`` under ``budget`` per rank by ``ruler``, one fresh
    launch per length; each measured length is appended to ``log``."""
    fits: list[int] = []
    misses: list[int] = []
    while (seq_len := schedule.next(fits, misses)) is not None:
        per_rank = measure(side, sp, [seq_len], breakdown=ruler == "tensors")
        peak = max(peak_of(r, seq_len, ruler) for r in per_rank)
        seconds = max(r[f"time {seq_len}"] for r in per_rank)
        fit = peak <= budget
        (fits if fit else misses).append(seq_len)
        with log.open("a") as f:
            f.write(
                f"{side}, sp={sp}, N={seq_len}: {peak / MiB:.1f} {RULER_UNITS[ruler]}, "
                f"{'fits' if fit else 'does not fit'} ({seconds:.0f} s)\n"
            )
    return max(fits, default=None), min(misses, default=None)


LOG_LINE = re.compile(
    r"^(?P<side>.+), sp=(?P<sp>\d+), N=(?P<n>\d+): (?P<mib>[\d.]+) (?P<units>MiB|MiB of tensors), "
    r"(?P<fit>fits|does not fit)"
)


def probe_table(
    log: Path, sides: list[str], sp: int, budget_mib: float, schedule: ProbeSchedule, ruler: Ruler = "rss"
) -> list[str]:
    """Markdown: per side, the lengths ``log`` holds for ``ruler`` (the probe's measurements, in order), the bracket
    they give and whether the probe's schedule had finished or was stopped (then: the length it would have tried
    next)."""
    measured: dict[str, list[tuple[int, float, bool]]] = {side: [] for side in sides}
    for line in log.read_text().splitlines():
        match = LOG_LINE.match(line)
        if match and match["side"] in measured and int(match["sp"]) == sp and match["units"] == RULER_UNITS[ruler]:
            measured[match["side"]].append((int(match["n"]), float(match["mib"]), match["fit"] == "fits"))
    measure_name = "the RSS high-water mark" if ruler == "rss" else "the peak of live tensor storages"
    lines = [
        f"Longest N under {budget_mib:.0f} MiB per rank by {measure_name} (`--ruler {ruler}`), probed (from "
        f"{schedule.start}, doubling, then {schedule.refine} bisections; each length one step in fresh processes):",
        "",
        "| side | measured: N (peak MiB) | fits | does not fit | x alst (fits; finished probes) | probe |",
        "|---|---|---|---|---|---|",
    ]

    def done(runs: list[tuple[int, float, bool]]) -> bool:
        return schedule.next([n for n, _, fit in runs if fit], [n for n, _, fit in runs if not fit]) is None

    alst_runs = measured.get("alst", [])
    # a ratio of longest fits only between finished probes: a stopped probe's longest fit is no bracket's end
    alst = max((n for n, _, fit in alst_runs if fit), default=None) if done(alst_runs) else None
    for side, runs in measured.items():
        fits = [n for n, _, fit in runs if fit]
        misses = [n for n, _, fit in runs if not fit]
        longest = max(fits, default=None)
        following = schedule.next(fits, misses)
        lines.append(
            f"| {side} | {', '.join(f'{n} ({mib:.1f})' for n, mib, _ in runs)} | {longest or '-'} | "
            f"{min(misses, default='-')} | {f'{longest / alst:.2f}' if longest and alst and done(runs) else '-'} | "
            f"{'done' if following is None else f'stopped before {following}'} |"
        )
    return lines


def breakdown_table(reports: dict[str, dict[str, Any]], seq_len: int, top: int) -> list[str]:
    """Markdown: per side, the step's RSS peak, the tracked live bytes at their peak and the largest parts."""
    lines = [
        f"Where one step's peak goes at N={seq_len} (largest rank by RSS peak; `LiveTensors`: tensor storages alive at "
        "the step's peak of live bytes, by what made them; parts under 0.5 MiB summed in `other`):",
        "",
    ]
    for side, report in reports.items():
        lines += [
            f"**{side}**: RSS peak {report['rss'] / MiB:.1f} MiB; live tensors at their peak {report['peak'] / MiB:.1f}"
            f" MiB, reached in `{report['at']}`",
            "",
            "| made by | MiB | tensors | largest |",
            "|---|---|---|---|",
        ]
        parts = sorted(report["parts"].items(), key=lambda item: -item[1][0])
        other = sum(b for _, (b, _, _) in parts[top:]) + sum(b for _, (b, _, _) in parts[:top] if b < MiB / 2)
        for label, (nbytes, count, shape) in parts[:top]:
            if nbytes >= MiB / 2:
                lines.append(f"| {label} | {nbytes / MiB:.1f} | {count} | {list(shape)} |")
        lines += [f"| other | {other / MiB:.1f} | | |", ""]
    return lines


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES))
    parser.add_argument("--budget-mib", type=float, default=256.0)
    parser.add_argument("--probe-start", type=int, default=16384)
    parser.add_argument("--probe-max", type=int, default=1 << 20)
    parser.add_argument("--refine", type=int, default=2)
    parser.add_argument("--ruler", choices=list(RULER_UNITS), default="rss", help="what the budget limits (docstring)")
    parser.add_argument("--no-probe", action="store_true")
    parser.add_argument("--breakdown", type=int, default=0, help="split one step's peak at this length (0: none)")
    parser.add_argument("--top", type=int, default=14, help="largest parts per side in the breakdown")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/longest.md"))
    parser.add_argument("--log", type=Path, default=Path("longest.log"), help="each probed length, as measured")
    parser.add_argument("--render", action="store_true", help="only write the probe's table from --log")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    budget = args.budget_mib * MiB
    model = ", ".join(f"{k}={v}" for k, v in MODEL.items() if k != "max_position_embeddings")
    lines = [
        "# Longest sequence under a per-rank budget: ours against DeepSpeed ALST",
        "",
        f"Made by `python -m benchmarks.longest {' '.join(argv)}`"
        f"{' from the lengths the probe logged' if args.render else ''} (method: the script's docstring) on CPU "
        f"({os.cpu_count()} cores, gloo), sp={args.sp}. Model: Llama, {model}, fp32, batch 1, one forward + "
        f"backward; every side with tiled MLP, tiled loss and activation checkpointing (offload moves nothing on "
        "CPU: checkpointed inputs are counted in full on both sides).",
        "",
    ]
    if args.breakdown:
        reports = {}
        for side in args.sides:
            per_rank = measure(side, args.sp, [args.breakdown], breakdown=True)
            worst = max(per_rank, key=lambda r: r[f"peak {args.breakdown}"])
            reports[side] = {**worst[f"live {args.breakdown}"], "rss": worst[f"peak {args.breakdown}"]}
        lines += breakdown_table(reports, args.breakdown, args.top)
    if not args.no_probe:
        schedule = ProbeSchedule(args.probe_start, args.probe_max, args.refine)
        if not args.render:
            with ThreadPoolExecutor(len(args.sides)) as pool:  # the sides at once: only memory is measured
                probes = [
                    pool.submit(probe_longest, s, args.sp, budget, schedule, args.log, args.ruler) for s in args.sides
                ]
                for future in probes:
                    future.result()
        lines += probe_table(args.log, args.sides, args.sp, args.budget_mib, schedule, args.ruler)
    report = "\n".join(lines) + "\n"
    publish(report, args.out)
    return report


if __name__ == "__main__":
    main()
