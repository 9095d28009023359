"""SDPA on packed documents: one call per document against tiles of documents with a block mask.

    python -m benchmarks.packed_sdpa                   # CPU
    python -m benchmarks.packed_sdpa --device cuda

One row of ``--seq`` tokens packed with documents of equal length runs ``sdpa_attention`` forward +
backward with ``tile_tokens`` = 1 (one causal call per document), the default
:data:`~lightning_ulysses.attention.SDPA_TILE_TOKENS` and ``seq`` (one call with a whole-row mask). The
three alternate inside one run; printed: the median time of each relative to one call per document.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_ulysses.attention import SDPA_TILE_TOKENS, Documents, sdpa_attention


def step_time(q: torch.Tensor, documents: Documents, tile_tokens: int) -> float:
    if q.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    sdpa_attention(q, q, q, documents, tile_tokens=tile_tokens).sum().backward()
    if q.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tiles = {"per document": 1, f"tiles of {SDPA_TILE_TOKENS}": SDPA_TILE_TOKENS, "whole-row mask": args.seq}
    print(f"seq={args.seq}, heads={args.heads}, head_dim={args.dim}, {dtype}, {args.device}; "
          f"time relative to one call per document, median of {args.repeats}")
    print(f"{'doc length':>10} " + " ".join(f"{name:>16}" for name in tiles))
    for doc_len in (16, 32, 64, 128, 512):
        positions = torch.arange(args.seq, device=args.device) % doc_len
        documents = Documents.from_position_ids(positions[None])
        q = torch.randn(1, args.seq, args.heads, args.dim, device=args.device, dtype=dtype, requires_grad=True)
        times: dict[str, list[float]] = {name: [] for name in tiles}
        for repeat in range(args.repeats + 1):  # round 0 warms up
            for name, tile_tokens in tiles.items():
                elapsed = step_time(q, documents, tile_tokens)
                if repeat:
                    times[name].append(elapsed)
        base = statistics.median(times["per document"])
        print(f"{doc_len:>10} " + " ".join(f"{statistics.median(t) / base:>16.2f}" for t in times.values()))


if __name__ == "__main__":
    main()
