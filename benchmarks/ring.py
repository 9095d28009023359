"""Ulysses only vs Ulysses x Ring at the same ``sp``: bytes per rank per attention layer, step time, peak memory.

    python -m benchmarks.ring                                    # CPU, gloo, sp=4, 8 heads / 1 K/V head
    python -m benchmarks.ring --heads 8 --kv-heads 2 --seq 8192 --node-size 2

Every layout ``ring x ulysses`` with ``ring * ulysses = sp`` runs ``ulysses_attention`` forward + backward on one
``[1, N/sp, H, D]`` shard per rank (fp32), in ``sp`` processes, the layouts alternating inside one run. Bytes are
counted by wrapping the collectives (``all_to_all_single``: the input each rank hands in; ``batch_isend_irecv``:
the tensors each rank sends to its ring neighbour) and printed next to their formulas. Per rank and layer, with
``n = N / sp`` tokens, head dim ``D``, ``b`` bytes per element, and the head layout over the Ulysses degree ``U``
(:func:`~lightning_ulysses.heads.plan_heads`: ``Hq = U * heads_per_rank`` query slots, ``Hkv = U * kv_heads_per_rank``
K/V slots, K/V heads replicated when ``U > kv_heads``)::

    all-to-all input, forward and backward each:  n * D * b * (2 * Hq + 2 * Hkv)     (q, out; k, v)   [0 at U = 1]
        of which to other ranks:                  (U - 1) / U of it
    ring, forward:   (R - 1) hops of the K/V block:  (R - 1) * 2 * n * Hkv * D * b
    ring, backward:  (R - 1) K/V hops, R hops of the fp32 dK/dV accumulator:
                     (R - 1) * 2 * n * Hkv * D * b + R * 2 * n * Hkv * D * 4

"Across nodes" counts the bytes whose destination is on another node, for nodes of ``--node-size`` consecutive
ranks (default ``sp / 2``): Ulysses groups of at most ``node-size`` ranks keep the all-to-alls inside a node.
Time: median over ``--repeats`` rounds of the slowest rank; peak memory: the RSS high-water mark of the step above
its start (``MALLOC_MMAP_THRESHOLD_`` set, so freed buffers leave the process), largest rank.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.measure import PeakMemory
from lightning_ulysses import ulysses_attention
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.heads import plan_heads
from lightning_ulysses.topology import SequenceParallelTopology, divisors
from tests.launch import launch


class ByteCounter:
    """Wraps ``dist.all_to_all_single`` and ``dist.batch_isend_irecv``; counts what this rank sends."""

    def __init__(self, node_size: int) -> None:
        self.node_size = node_size
        self.reset()
        self._all_to_all, self._batch = dist.all_to_all_single, dist.batch_isend_irecv
        dist.all_to_all_single, dist.batch_isend_irecv = self._counted_all_to_all, self._counted_batch

    def reset(self) -> None:
        self.all_to_all = self.to_other_ranks = self.ring = self.across_nodes = 0

    def _node(self, rank: int) -> int:
        return rank // self.node_size

    def _counted_all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any
    ) -> Any:
        ranks = dist.get_process_group_ranks(group)
        chunk = input.numel() * input.element_size() // len(ranks)
        me = dist.get_rank()
        self.all_to_all += chunk * len(ranks)
        self.to_other_ranks += chunk * sum(r != me for r in ranks)
        self.across_nodes += chunk * sum(self._node(r) != self._node(me) for r in ranks)
        return self._all_to_all(output, input, *args, group=group, **kwargs)

    def _counted_batch(self, ops: list[dist.P2POp]) -> Any:
        for op in ops:
            if op.op is dist.isend:
                size = op.tensor.numel() * op.tensor.element_size()
                self.ring += size
                self.to_other_ranks += size
                self.across_nodes += size * (self._node(op.peer) != self._node(dist.get_rank()))
        return self._batch(ops)

    def close(self) -> None:
        dist.all_to_all_single, dist.batch_isend_irecv = self._all_to_all, self._batch


COUNTS = ("all_to_all", "ring", "to_other_ranks", "across_nodes", "forward_to_other_ranks")


def formulas(
    rank: int, sp: int, ring: int, heads: int, kv_heads: int, seq: int, dim: int, node_size: int, elem: int = 4
) -> dict[str, int]:
    """The byte counts of the module docstring for ``rank``, forward + backward (and the forward's share)."""
    ulysses, n = sp // ring, seq // sp
    layout = plan_heads(heads, kv_heads, ulysses)
    q_slots, kv_slots = ulysses * layout.heads_per_rank, ulysses * layout.kv_heads_per_rank
    all_to_all = 0 if ulysses == 1 else 2 * n * dim * elem * (2 * q_slots + 2 * kv_slots)
    kv_block = 2 * n * kv_slots * dim
    ring_forward = (ring - 1) * kv_block * elem
    ring_bytes = 0 if ring == 1 else 2 * ring_forward + ring * kv_block * 4
    to_others = all_to_all * (ulysses - 1) // ulysses + ring_bytes
    first = rank // ulysses * ulysses  # this rank's Ulysses group: ranks [first, first + U)
    off_node = sum(r // node_size != rank // node_size for r in range(first, first + ulysses))
    ring_next = (rank // ulysses + 1) % ring * ulysses + rank % ulysses
    across = all_to_all * off_node // ulysses + (ring_bytes if ring_next // node_size != rank // node_size else 0)
    forward = all_to_all // 2 * (ulysses - 1) // ulysses + ring_forward
    return {
        "all_to_all": all_to_all,
        "ring": ring_bytes,
        "to_other_ranks": to_others,
        "across_nodes": across,
        "forward_to_other_ranks": forward,
    }


def worker(args: dict[str, Any]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    seq, dim, heads, kv_heads = args["seq"], args["dim"], args["heads"], args["kv_heads"]
    groups = {}
    for ring in args["rings"]:  # every rank joins every group creation, in the same order
        groups[ring] = SequenceParallelGroups.create(SequenceParallelTopology(world, world, rank, ring), "cpu")
    counter = ByteCounter(args["node_size"])
    memory = PeakMemory(torch.device("cpu"))
    results: dict[int, dict[str, Any]] = {ring: {"times": [], "peaks": []} for ring in args["rings"]}
    for repeat in range(args["repeats"] + 1):  # round 0 warms up
        for ring in args["rings"]:
            g = torch.Generator().manual_seed(rank)
            q = torch.randn(1, seq // world, heads, dim, generator=g, requires_grad=True)
            k, v = (torch.randn(1, seq // world, kv_heads, dim, generator=g, requires_grad=True) for _ in range(2))
            dist.barrier()
            counter.reset()
            memory.reset()
            start = time.perf_counter()
            out = ulysses_attention(q, k, v, group=groups[ring])
            forward = counter.to_other_ranks
            out.sum().backward()
            elapsed = torch.tensor(time.perf_counter() - start)
            peak = torch.tensor(memory.peak())
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            if repeat:
                results[ring]["times"].append(elapsed.item())
                results[ring]["peaks"].append(peak.item())
            results[ring]["bytes"] = {key: getattr(counter, key) for key in COUNTS[:-1]}
            results[ring]["bytes"]["forward_to_other_ranks"] = forward
    counter.close()
    dist.destroy_process_group()
    return {
        ring: {"time": statistics.median(r["times"]), "peak": statistics.median(r["peaks"]), "bytes": r["bytes"]}
        for ring, r in results.items()
    }


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base else "n/a"  # a step too small to raise the RSS high-water mark


def main(argv: list[str] | None = None) -> dict[int, dict[str, Any]]:
    """Run, print the table; return per ring size the measured and the expected bytes of every rank."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sp", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--node-size", type=int, default=0, help="ranks per node (default sp / 2)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    node_size = args.node_size or max(args.sp // 2, 1)
    rings = divisors(args.sp)
    if args.seq % (2 * args.sp):
        parser.error(f"--seq must be a multiple of 2 * sp = {2 * args.sp}")
    results = launch(
        "benchmarks.ring:worker",
        args.sp,
        {
            "seq": args.seq,
            "dim": args.dim,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "rings": rings,
            "node_size": node_size,
            "repeats": args.repeats,
        },
        extra_env={"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    base = results[0][1]
    print(
        f"sp={args.sp}, N={args.seq}, {args.heads} heads / {args.kv_heads} K/V heads, head dim {args.dim}, fp32, "
        f"nodes of {node_size} ranks; one attention layer, bytes each rank sends (MiB, largest rank)\n"
    )
    print(
        "| layout (ring x ulysses) | K/V slots (replication) | all-to-all input | ring sends | to other ranks: "
        "forward | forward + backward | across nodes | = formulas, every rank | time / Ulysses-only "
        "| peak memory / Ulysses-only |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    table = {}
    for ring in rings:
        measured = [r[ring]["bytes"] for r in results]
        expected = [
            formulas(rank, args.sp, ring, args.heads, args.kv_heads, args.seq, args.dim, node_size)
            for rank in range(args.sp)
        ]
        table[ring] = {"measured": measured, "expected": expected}
        kv_slots = (args.sp // ring) * plan_heads(args.heads, args.kv_heads, args.sp // ring).kv_heads_per_rank
        mib = {key: f"{max(m[key] for m in measured) / 2**20:.3f}" for key in COUNTS}
        print(
            f"| {ring} x {args.sp // ring} | {kv_slots} ({kv_slots / args.kv_heads:.0f}x) | "
            f"{mib['all_to_all']} | {mib['ring']} | {mib['forward_to_other_ranks']} | {mib['to_other_ranks']} | "
            f"{mib['across_nodes']} | {'yes' if measured == expected else f'NO: {expected}'} | "
            f"{_ratio(results[0][ring]['time'], base['time'])} | {_ratio(results[0][ring]['peak'], base['peak'])} |"
        )
    print(
        f"\nUlysses-only: {base['time'] * 1e3:.1f} ms, peak {base['peak'] / 2**20:.1f} MiB (median of "
        f"{args.repeats}, slowest / largest rank)."
    )
    return table


if __name__ == "__main__":
    main()
