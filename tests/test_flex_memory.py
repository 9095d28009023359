"""Flex attention's forward memory grows linearly in the sequence length (compiled), where eager flex grew
quadratically (a dense ``[B, 1, N, N]`` mask and the ``[B, H, N, N]`` scores).

The peak is read from the allocations torch's profiler records (every CPU tensor allocation and free), so it is
the memory of the call alone. CPU, forward only: torch 2.13 has no flex backward on CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import lightning_ulysses.attention.flex as flex_module
from lightning_ulysses.attention import Documents, flex_attention

LENGTHS = (1024, 2048, 4096)


def peak_allocated(fn: Callable[[], object]) -> int:
    """The largest number of bytes that ``fn`` held in CPU tensors at once."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations = sorted((e for e in prof.events() if e.cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for event in allocations:
        live += event.cpu_memory_usage
        peak = max(peak, live)
    return peak


def forward_peaks() -> dict[int, int]:
    """Peak bytes of one packed-row forward (documents of 64 tokens, 4 heads of 64), block mask included.

    Compiled from a fresh dynamo cache: the shapes that earlier tests compiled count towards dynamo's recompile limit,
    past which it runs the function eagerly (quadratic), and this measures the compiled kernel."""
    torch._dynamo.reset()
    peaks = {}
    for n in LENGTHS:
        positions = (torch.arange(n) % 64)[None]
        q = torch.randn(1, n, 4, 64)
        with torch.no_grad():
            flex_attention(q, q, q, Documents.from_position_ids(positions))  # compiles on the first lengths
            # B023: peak_allocated calls the lambda at once, in this iteration
            peaks[n] = peak_allocated(
                lambda: flex_attention(q, q, q, Documents.from_position_ids(positions))  # noqa: B023
            )
    return peaks


def test_compiled_flex_forward_memory_is_linear() -> None:
    peaks = forward_peaks()
    assert peaks[4096] / peaks[1024] < 4.5, peaks  # linear: 4; quadratic: 16
    assert peaks[4096] < 32 * 2**20, peaks  # q, k, v, out are 4 MiB each


def test_eager_flex_forward_memory_was_quadratic(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same measurement sees the quadratic growth of eager flex (what the backend ran before)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as eager

    monkeypatch.setattr(flex_module, "compiled_flex", lambda: (create_block_mask, eager))
    peaks = forward_peaks()
    assert peaks[4096] / peaks[1024] > 12, peaks


def test_new_shapes_stop_compiling() -> None:
    """The first shape compiles; a new length, then a new batch size, each compile once more with that dimension
    dynamic (block mask and kernel: two graphs each time); later lengths and batch sizes compile nothing."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs = []
    with torch.no_grad():
        for batch, n in [(1, 96), (1, 160), (2, 224), (1, 352), (2, 480), (3, 608)]:
            q = torch.randn(batch, n, 6, 8)
            positions = (torch.arange(n) % 50)[None].repeat(batch, 1)
            flex_attention(q, q[:, :, :3], q[:, :, :3], Documents.from_position_ids(positions))
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [2, 4, 6, 6, 6, 6], graphs
