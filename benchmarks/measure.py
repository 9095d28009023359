"""Measurement shared by the benchmark scripts."""

from __future__ import annotations

import gc
from dataclasses import dataclass
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


class SavedForBackward:
    """Bytes of the distinct storages autograd saves for backward while active (a context manager): the
    activations a step keeps alive, as opposed to the transient buffers the peak also counts."""

    def __init__(self) -> None:
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def __enter__(self) -> SavedForBackward:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


@dataclass(frozen=True)
class ProbeSchedule:
    """The lengths a probe for the longest sequence tries: ``start``, doubled while everything fits (up to
    ``maximum``), then ``refine`` bisections between the longest fit and the shortest miss, in steps of
    ``start / 16``. The answer is the bracket ``[longest fit, shortest miss)``, never an extrapolation."""

    start: int
    maximum: int
    refine: int

    def next(self, fits: list[int], misses: list[int]) -> int | None:
        """The next length to try, or None when done."""
        if not fits and not misses:
            return self.start
        if not misses:
            longest = max(fits)
            return None if longest >= self.maximum else min(2 * longest, self.maximum)
        if not fits:
            return None  # even the first length does not fit: start shorter
        low, high = max(fits), min(misses)
        step = max(1, self.start // 16)
        middle = (low + high) // 2 // step * step
        bisections = sum(1 for length in fits + misses if length not in self._doubling())
        return middle if bisections < self.refine and low < middle < high else None

    def _doubling(self) -> set[int]:
        lengths, length = set(), self.start
        while length < self.maximum:
            lengths.add(length)
            length *= 2
        return lengths | {self.maximum}
