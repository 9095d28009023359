"""SDPA on packed documents: length classes (batched causal calls) against one call per document.

    python -m benchmarks.packed_sdpa                   # CPU
    python -m benchmarks.packed_sdpa --device cuda

One row of ``--seq`` tokens packed with documents runs forward + backward three ways: ``sdpa_attention``'s
length classes (one batched causal call per class, :mod:`lightning_ulysses.attention.sdpa`), one causal call per
document, and one call with a whole-row block-diagonal mask. The three alternate inside one run; printed: the
number of SDPA calls and the median time of each relative to one call per document. Rows of equal documents and
rows of lengths drawn uniformly from ``[1, 2 * length]`` (the ``~`` rows).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from lightning_ulysses.attention import Documents, plan_packed, sdpa_attention


def per_document(q: torch.Tensor, documents: Documents) -> torch.Tensor:
    spans = zip(documents.offsets[:-1], documents.offsets[1:])
    pieces = [F.scaled_dot_product_attention(*(q[:, s:e].transpose(1, 2),) * 3, is_causal=True) for s, e in spans]
    return torch.cat(pieces, dim=2).transpose(1, 2)


def whole_row_mask(q: torch.Tensor, documents: Documents) -> torch.Tensor:
    ids = documents.document_ids[0]
    mask = (ids[:, None] == ids[None, :]).tril()
    return F.scaled_dot_product_attention(*(q.transpose(1, 2),) * 3, attn_mask=mask).transpose(1, 2)


def step_time(run: Callable[[], torch.Tensor], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    run().sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def lengths(seq: int, doc_len: int, varied: bool) -> list[int]:
    generator = torch.Generator().manual_seed(doc_len)
    out: list[int] = []
    while sum(out) < seq:
        out.append(int(torch.randint(1, 2 * doc_len + 1, (1,), generator=generator)) if varied else doc_len)
    out[-1] -= sum(out) - seq
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    print(
        f"seq={args.seq}, heads={args.heads}, head_dim={args.dim}, {dtype}, {args.device}; SDPA calls and time "
        f"relative to one call per document, median of {args.repeats}"
    )
    print(f"{'doc length':>10} {'documents':>9} {'classes: calls':>15} {'time':>6} {'whole-row mask':>15}")
    for doc_len, varied in [(16, False), (64, False), (512, False), (16, True), (64, True), (512, True)]:
        positions = torch.cat([torch.arange(n) for n in lengths(args.seq, doc_len, varied)]).to(args.device)
        documents = Documents.from_position_ids(positions[None])
        q = torch.randn(1, args.seq, args.heads, args.dim, device=args.device, dtype=dtype, requires_grad=True)
        runs = {
            "classes": partial(sdpa_attention, q, q, q, documents),
            "per document": partial(per_document, q, documents),
            "mask": partial(whole_row_mask, q, documents),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for repeat in range(args.repeats + 1):  # round 0 warms up
            for name, run in runs.items():
                elapsed = step_time(run, args.device)
                if repeat:
                    times[name].append(elapsed)
        base = statistics.median(times["per document"])
        calls = len(plan_packed(documents).classes)
        label = f"~{doc_len}" if varied else str(doc_len)
        print(
            f"{label:>10} {len(documents.offsets) - 1:>9} {calls:>15} "
            f"{statistics.median(times['classes']) / base:>6.2f} {statistics.median(times['mask']) / base:>15.2f}"
        )


if __name__ == "__main__":
    main()
