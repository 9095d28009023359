"""Measurement shared by the benchmark scripts."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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
            _release_free_heap()
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.baseline = _proc_status_bytes("VmRSS")

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return _proc_status_bytes("VmHWM") - self.baseline


def _release_free_heap() -> None:
    """Hand the free pages of the C heap back to the OS (glibc's ``malloc_trim``; nothing elsewhere). Buffers under
    ``MALLOC_MMAP_THRESHOLD_`` live in the heap, and the pages a step freed stay in the RSS: a later step reuses them
    without raising the high-water mark, so without this its peak would read low by what earlier steps left."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


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


class LiveTensors(TorchDispatchMode):
    """The tensor storages alive while active (a context manager), tracked from the operators that make them: at the
    peak of their total bytes, those bytes split by what made each storage. Storages alive before (weights, gradient
    buffers) are not counted, nor outputs that share an input's storage (views, in-place writes).

    A storage is labelled ``forward <module>`` (made by the forward, outside any backward: what the step keeps for
    its backward), ``recompute <module>`` (made while the backward re-runs a module of ``model``: checkpointed layers,
    MLP and loss tiles) or ``backward <autograd node>`` (made by the backward itself), where ``<module>`` is the
    innermost module of ``model`` running at the time. Frees are seen after the next operator, so the peak may count
    one operator's freed input as still alive. Being a dispatch mode, it also changes what it measures a little:
    autograd then adds gradients out of place (without it, a gradient buffer that nothing else holds is added to in
    place), so a gradient summed from many parts counts one whole buffer more than it takes."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._names = {id(m): name or "model" for name, m in model.named_modules()}
        self._modules: list[str] = []
        self._live: dict[int, tuple[StorageWeakRef, int, str, tuple[int, ...]]] = {}
        self.total = self.peak = 0
        self.at = ""
        self.parts: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        self._hooks: list[Any] = []

    def __enter__(self) -> LiveTensors:
        def enter(module: nn.Module, *args: Any) -> None:
            self._modules.append(self._names.get(id(module), self._modules[-1] if self._modules else "model"))

        def leave(module: nn.Module, *args: Any) -> None:
            self._modules.pop()

        self._hooks = [
            nn.modules.module.register_module_forward_pre_hook(enter),
            nn.modules.module.register_module_forward_hook(leave, always_call=True),
        ]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for hook in self._hooks:
            hook.remove()

    def _label(self) -> str:
        node = torch._C._current_autograd_node()
        module = self._modules[-1] if self._modules else "model"
        if node is None:
            return f"forward {module}"
        return f"recompute {module}" if self._modules else f"backward {node.name()}"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for key in [key for key, (ref, *_) in self._live.items() if ref.expired()]:
            self.total -= self._live.pop(key)[1]
        label = None
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self._live or key in inputs:  # a view of an input, or written in place
                continue
            label = label or self._label()
            self._live[key] = (StorageWeakRef(storage), nbytes, label, tuple(tensor.shape))
            self.total += nbytes
        if self.total > self.peak:
            self.peak, self.at = self.total, f"{self._label()} {func.__name__}"
            self.parts = {}
            for _, nbytes, part, shape in self._live.values():
                size, count, largest = self.parts.get(part, (0, 0, ()))
                if not largest or torch.Size(shape).numel() > torch.Size(largest).numel():
                    largest = shape
                self.parts[part] = (size + nbytes, count + 1, largest)
        return out

    def report(self) -> dict[str, Any]:
        """``{"peak": bytes, "at": where, "parts": {label: (bytes, storages, largest shape)}}``."""
        return {"peak": self.peak, "at": self.at, "parts": self.parts}


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


def publish(report: str, output: Path | None) -> None:
    """Write a benchmark's markdown ``report`` to ``output`` when one is given (its folder made as needed), then print
    it."""
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(report)
    print(report)
