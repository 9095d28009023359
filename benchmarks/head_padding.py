"""Overhead of head counts that do not divide by sp_size (inert heads, replicated K/V heads).

    python -m benchmarks.head_padding                       # CPU, gloo, sp=4
    python -m benchmarks.head_padding --sp 2 --seq 2048

Every model runs ``ulysses_attention`` forward + backward on one ``[1, N/sp, H, D]`` shard per rank, in
``sp`` processes, against a *baseline* with the same number of head slots and no padding (8 heads when
6 are laid out on 8 slots). Models and baselines alternate inside one run; the time is the median of
``--repeats`` rounds of the slowest rank. Bytes are counted by wrapping ``all_to_all_single``.

Reported per model: its query / key-value slots per rank, and, relative to an unpadded model with the
same number of *real* heads (the baseline scaled by ``heads / baseline_heads``):

* ``bytes/real``: all-to-all bytes (exact, counted);
* ``time/real``: attention wall time (measured, slowest rank);
* ``cpu/real``: attention CPU time summed over ranks (measured; steadier than wall time on a shared CPU).

Both come out near ``slots / heads``: a padded head costs what a real one does, and only the attention
core and its all-to-alls pay; projections, MLP and loss run on the real heads.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightning_ulysses import ulysses_attention
from lightning_ulysses.heads import plan_heads
from tests.launch import launch

# (heads, kv_heads) -> the baseline with the same slots and no padding, for sp=4
MODELS: dict[tuple[int, int], tuple[int, int]] = {
    (6, 6): (8, 8),  # MHA, 2 inert query and K/V heads
    (6, 2): (8, 2),  # GQA, one inert query head per K/V group
    (6, 1): (8, 1),  # MQA, 2 inert query heads
    (5, 5): (8, 8),
}


def worker(args: dict[str, Any]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    sp, seq, dim = dist.get_world_size(), args["seq"], args["dim"]
    world = init_device_mesh("cpu", (sp,))
    sent = [0]
    all_to_all_single = dist.all_to_all_single

    def counting(output: torch.Tensor, input: torch.Tensor, *a: Any, **kw: Any) -> Any:
        sent[0] += input.numel() * input.element_size()
        return all_to_all_single(output, input, *a, **kw)

    dist.all_to_all_single = counting
    shapes = sorted({shape for pair in MODELS.items() for shape in pair})
    times: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    cpu_times: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    sent_bytes: dict[tuple[int, int], int] = {}
    for repeat in range(args["repeats"] + 1):  # round 0 warms up
        for heads, kv_heads in shapes:
            q = torch.randn(1, seq // sp, heads, dim, requires_grad=True)
            k, v = (torch.randn(1, seq // sp, kv_heads, dim, requires_grad=True) for _ in range(2))
            dist.barrier()
            sent[0], start, cpu_start = 0, time.perf_counter(), time.process_time()
            ulysses_attention(q, k, v, group=world).sum().backward()
            elapsed = torch.tensor(time.perf_counter() - start)
            cpu = torch.tensor(time.process_time() - cpu_start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
            if repeat:
                times[heads, kv_heads].append(elapsed.item())
                cpu_times[heads, kv_heads].append(cpu.item())
            sent_bytes[heads, kv_heads] = sent[0]
    dist.all_to_all_single = all_to_all_single
    dist.destroy_process_group()
    return {
        "times": {s: statistics.median(t) for s, t in times.items()},
        "cpu_times": {s: statistics.median(t) for s, t in cpu_times.items()},
        "bytes": sent_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sp", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    result = launch("benchmarks.head_padding:worker", args.sp, vars(args), timeout=3600)[0]
    times, cpu_times, sent = result["times"], result["cpu_times"], result["bytes"]
    print(f"sp={args.sp}, seq={args.seq}, head_dim={args.dim}, fp32, CPU gloo; median of {args.repeats} rounds")
    print(
        f"{'heads/kv':>9} {'slots/rank':>10} {'baseline':>9} {'slots/heads':>11} {'bytes/real':>10} "
        f"{'time/real':>9} {'cpu/real':>9}"
    )
    for (heads, kv_heads), (base_heads, base_kv) in MODELS.items():
        layout = plan_heads(heads, kv_heads, args.sp)
        scale = heads / base_heads  # an unpadded model with `heads` real heads, extrapolated from the baseline
        print(
            f"{heads:>4}/{kv_heads:<4} {layout.heads_per_rank:>5}/{layout.kv_heads_per_rank:<4} "
            f"{base_heads:>4}/{base_kv:<4} {layout.overhead:>11.2f} "
            f"{sent[heads, kv_heads] / (scale * sent[base_heads, base_kv]):>10.2f} "
            f"{times[heads, kv_heads] / (scale * times[base_heads, base_kv]):>9.2f} "
            f"{cpu_times[heads, kv_heads] / (scale * cpu_times[base_heads, base_kv]):>9.2f}"
        )


if __name__ == "__main__":
    main()
