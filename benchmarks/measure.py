"""Measurement shared by the benchmark scripts."""

from __future__ import annotations

import gc
from pathlib import Path

import torch


class PeakMemory:
    """Peak memory above the level at :meth:`reset`: CUDA allocator peak, or the process RSS high-water mark
    on CPU (exact only with ``MALLOC_MMAP_THRESHOLD_`` set, so that freed buffers leave the process)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.baseline = _proc_status_bytes("VmRSS")

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return _proc_status_bytes("VmHWM") - self.baseline


def _proc_status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")
