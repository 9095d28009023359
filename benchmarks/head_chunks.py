"""Head-chunked Ulysses (``head_chunks``) against plain Ulysses, side by side in one run.

    python -m benchmarks.head_chunks                       # CPU, gloo, sp=2; prints a markdown report
    python -m benchmarks.head_chunks --probe               # also the longest sequence under the budget (slow)

The model, the memory options and the budget are those of :mod:`benchmarks.memory` (its ``MODEL``: 8 heads, 4 K/V
heads of 16, hidden 128, 2 layers, vocabulary 16000, fp32; ``all`` options; 256 MiB per rank). Reported:

* **one attention layer** (``ulysses_attention`` forward + backward on a ``[1, N/sp, 8, 16]`` shard per rank, the
  model's head shapes): the all-to-all calls of the forward and of the backward (``dist.all_to_all_single``
  wrapped and counted), its peak memory above its inputs (RSS high-water mark, ``MALLOC_MMAP_THRESHOLD_`` set),
  next to the formula of one chunk's whole-sequence tensors, and its median time over alternating rounds;
* **one training step of the model** with all memory options, a model patched per ``head_chunks`` (so with ``"auto"``
  its layers run their projections inside the chunks, :mod:`lightning_ulysses.hf.projections`): its peak per rank
  (as :mod:`benchmarks.memory` measures it), its all-to-all calls (forward, recomputation and backward of both
  layers) and its median time over alternating rounds;
* with ``--probe``: the longest sequence whose step fits the budget, probed (each length one step in fresh
  processes, doubling then bisecting; :class:`~benchmarks.measure.ProbeSchedule`), never extrapolated.

A chunk's whole-sequence tensors per rank (``h`` query and ``kv`` K/V slots of head size ``D``, ``b`` bytes)::

    one chunk:  N * h_j * (D + D) + N * kv_j * (D + D)  elements  (q, output; k, v), times b

(``h_j``, ``kv_j``: the largest chunk's slots, :func:`~lightning_ulysses.attention.head_chunks.plan_chunks`; a chunk
of part of a K/V group carries its K/V slot, so 4 chunks of 4 query and 2 K/V slots hold 1 and 1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.measure import PeakMemory, ProbeSchedule
from benchmarks.memory import CONFIGS, MODEL, WARM_UP_LEN, _train_step
from lightning_ulysses import ulysses_attention
from lightning_ulysses.attention.head_chunks import plan_chunks
from lightning_ulysses.heads import plan_heads
from lightning_ulysses.hf import apply_ulysses_attention
from lightning_ulysses.memory import apply_memory_options
from lightning_ulysses.sharding import prepare_batch, shard_batch
from tests.launch import launch
from tests.tiny import tiny_llama

MiB = 2**20
CHUNKINGS: tuple[Any, ...] = (None, 1, 2, 4)
HEAD_DIM = MODEL["hidden_size"] // MODEL["num_attention_heads"]


def whole_sequence_bytes(seq_len: int, sp: int, chunks: int | None) -> int:
    """The formula above: one chunk's whole-sequence q, k, v and output on a rank (``None``: all heads, one chunk)."""
    layout = plan_heads(MODEL["num_attention_heads"], MODEL["num_key_value_heads"], sp)
    largest = max(len(c.query) + len(c.kv) for c in plan_chunks(layout, chunks or 1))
    return seq_len * largest * 2 * HEAD_DIM * 4


def _counting() -> tuple[Counter[str], Any]:
    calls: Counter[str] = Counter()
    original = dist.all_to_all_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[_phase[0]] += 1
        return original(*args, **kwargs)

    dist.all_to_all_single = counted
    return calls, original


_phase = ["forward"]


def layer_worker(args: dict[str, Any]) -> dict[str, Any]:
    """One rank: per chunking, the layer's all-to-alls, peak memory and median time."""
    dist.init_process_group("gloo")
    sp, rank, seq = dist.get_world_size(), dist.get_rank(), args["seq_len"]
    g = torch.Generator().manual_seed(0)
    heads, kv_heads = MODEL["num_attention_heads"], MODEL["num_key_value_heads"]
    q, k, v = (
        torch.randn(1, seq // sp, n, HEAD_DIM, generator=g).requires_grad_() for n in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(1, seq // sp, heads, HEAD_DIM, generator=g)
    positions = torch.arange(rank * seq // sp, (rank + 1) * seq // sp)[None]
    world = init_device_mesh("cpu", (sp,))

    def step(head_chunks: Any) -> None:
        _phase[0] = "forward"
        out = ulysses_attention(q, k, v, group=world, position_ids=positions, head_chunks=head_chunks)
        _phase[0] = "backward"
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    results: dict[str, Any] = {}
    calls, original = _counting()
    for chunks in CHUNKINGS:
        step(chunks)  # warm-up: the documents' plan
        calls.clear()
        memory = PeakMemory(torch.device("cpu"))
        memory.reset()
        step(chunks)
        results[f"peak {chunks}"] = memory.peak()
        results[f"calls {chunks}"] = dict(calls)
    dist.all_to_all_single = original
    times: dict[Any, list[float]] = {c: [] for c in CHUNKINGS}
    for _ in range(args["repeats"]):
        for chunks in CHUNKINGS:
            dist.barrier()
            start = time.perf_counter()
            step(chunks)
            times[chunks].append(time.perf_counter() - start)
    results["times"] = times
    dist.destroy_process_group()
    return results


def model_worker(args: dict[str, Any]) -> dict[str, Any]:
    """One rank: per ``head_chunks`` (a model patched with it: the set-up check plans which layers run their
    projections inside the chunks), the all-to-alls and peak of one training step with all memory options at each
    length, and (``repeats > 0``) the median step time over alternating rounds."""
    dist.init_process_group("gloo")
    sp, rank = dist.get_world_size(), dist.get_rank()
    options = CONFIGS["all"]
    models, world = {}, init_device_mesh("cpu", (sp,))
    for chunks in args["chunkings"]:
        models[chunks] = tiny_llama(**MODEL).train()
        apply_ulysses_attention(models[chunks], world, "sdpa", head_chunks=chunks)
        apply_memory_options(models[chunks], options)

    def shard(seq_len: int) -> dict[str, torch.Tensor]:
        batch = {
            "input_ids": torch.randint(
                1, MODEL["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(seq_len)
            )
        }
        return shard_batch(prepare_batch(batch, sp), rank, sp)

    results: dict[str, Any] = {}
    calls, original = _counting()
    _phase[0] = "step"
    for chunks, model in models.items():
        for seq_len in [WARM_UP_LEN, *args["seq_lens"]]:
            batch = shard(seq_len)
            calls.clear()
            memory = PeakMemory(torch.device("cpu"))
            memory.reset()
            _train_step(model, batch, options)
            results[f"peak {chunks} {seq_len}"] = memory.peak()
        results[f"calls {chunks}"] = calls["step"]
    dist.all_to_all_single = original
    if args["repeats"]:
        batch = shard(args["seq_lens"][0])
        times: dict[Any, list[float]] = {c: [] for c in args["chunkings"]}
        for _ in range(args["repeats"]):
            for chunks, model in models.items():
                dist.barrier()
                start = time.perf_counter()
                _train_step(model, batch, options)
                times[chunks].append(time.perf_counter() - start)
        results["times"] = times
    dist.destroy_process_group()
    return results


def _launch(target: str, sp: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    return launch(target, sp, args, extra_env={"MALLOC_MMAP_THRESHOLD_": "65536"})


def _median_ratios(per_rank: list[dict[str, Any]], chunkings: tuple[Any, ...]) -> dict[Any, float]:
    """Median over rounds of the slowest rank's time, per chunking, over that of ``None``."""
    slowest = {
        c: [max(r["times"][c][i] for r in per_rank) for i in range(len(per_rank[0]["times"][c]))] for c in chunkings
    }
    base = statistics.median(slowest[None])
    return {c: statistics.median(slowest[c]) / base for c in chunkings}


def probe_longest(chunks: Any, sp: int, budget: float, schedule: ProbeSchedule) -> tuple[int | None, int | None]:
    fits, misses = [], []
    while (seq_len := schedule.next(fits, misses)) is not None:
        per_rank = _launch(
            "benchmarks.head_chunks:model_worker", sp, {"chunkings": [chunks], "seq_lens": [seq_len], "repeats": 0}
        )
        peak = max(r[f"peak {chunks} {seq_len}"] for r in per_rank)
        (fits if peak <= budget else misses).append(seq_len)
    return max(fits, default=None), min(misses, default=None)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--layer-seq", type=int, default=16384, help="tokens of the one-layer measurement")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384], help="lengths of the model steps")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-mib", type=float, default=256.0)
    parser.add_argument("--probe", action="store_true", help="probe the longest sequence under the budget")
    parser.add_argument("--probe-start", type=int, default=32768)
    parser.add_argument("--probe-max", type=int, default=1 << 18)
    parser.add_argument("--refine", type=int, default=2)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    sp, n = args.sp, args.layer_seq

    layer = _launch("benchmarks.head_chunks:layer_worker", sp, {"seq_len": n, "repeats": args.repeats})
    layer_ratio = _median_ratios(layer, CHUNKINGS)
    lines = [
        f"Made by `python -m benchmarks.head_chunks {' '.join(argv)}`; sp={sp}, CPU (gloo), fp32.",
        "",
        f"One attention layer, N={n} ({MODEL['num_attention_heads']} heads, {MODEL['num_key_value_heads']} K/V "
        f"heads of {HEAD_DIM}), forward + backward, per rank:",
        "",
        "| head_chunks | all-to-alls forward | backward | peak above inputs (MiB) | x plain | one chunk's "
        "whole-sequence q, k, v, out (formula, MiB) | time x plain |",
        "|---|---|---|---|---|---|---|",
    ]
    plain_peak = max(r["peak None"] for r in layer)
    for c in CHUNKINGS:
        peak = max(r[f"peak {c}"] for r in layer)
        calls = layer[0][f"calls {c}"]
        lines.append(
            f"| {c} | {calls.get('forward', 0)} | {calls.get('backward', 0)} | {peak / MiB:.1f} | "
            f"{peak / plain_peak:.3f} | {whole_sequence_bytes(n, sp, c) / MiB:.1f} | {layer_ratio[c]:.2f} |"
        )

    chunkings = (None, "auto")
    model = _launch(
        "benchmarks.head_chunks:model_worker",
        sp,
        {"chunkings": chunkings, "seq_lens": args.seq_lens, "repeats": args.repeats},
    )
    model_ratio = _median_ratios(model, chunkings)
    lines += [
        "",
        f"One training step, all memory options, per rank (largest rank); step time at N={args.seq_lens[0]}:",
        "",
        "| head_chunks | "
        + " | ".join(f"peak N={s} (MiB)" for s in args.seq_lens)
        + " | all-to-alls per step | step time x plain |",
        "|---|" + "---|" * (len(args.seq_lens) + 2),
    ]
    for c in chunkings:
        peaks = [max(r[f"peak {c} {s}"] for r in model) / MiB for s in args.seq_lens]
        lines.append(
            f"| {c} | "
            + " | ".join(f"{p:.1f}" for p in peaks)
            + f" | {model[0][f'calls {c}']} | {model_ratio[c]:.2f} |"
        )
    if args.probe:
        schedule = ProbeSchedule(args.probe_start, args.probe_max, args.refine)
        budget = args.budget_mib * MiB
        lines += ["", f"Longest sequence under {args.budget_mib:.0f} MiB per rank (probed: fits, does not):", ""]
        for c in chunkings:
            fit, miss = probe_longest(c, sp, budget, schedule)
            lines.append(f"- head_chunks={c}: {fit}, {miss}")
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()
