"""Activation offload: what a checkpointed layer keeps for its backward waits in host memory, copied on a side stream.

:func:`~lightning_ulysses.memory.checkpoint_activations` with ``offload=True`` keeps only a layer's inputs; these
saved-tensor hooks move them to pinned host memory in the forward and back in the backward. The forward's
device-to-host copies run on a *side* stream, so they overlap the compute of the layers that follow::

    pack (forward, the tensor just made on the compute stream)     unpack (backward, the checkpoint recomputes)
      compute: record event `made`                                    compute: wait for `copied`
      side:    wait for `made`, copy to pinned host, record `copied`  compute: copy back to the device
      tensor.record_stream(side)                                      (non-blocking, from pinned memory)

``record_stream`` keeps the caching allocator from giving the tensor's memory to another tensor before the
side stream has read it, though the forward drops its last reference at once. The copy back runs on the
compute stream, which needs it next: only the forward's copies can overlap compute without prefetching.
The values are the tensors' own bytes, so gradients are exact.

The stream operations go through :class:`DeviceStreams` (``torch.cuda``'s by default), so the order of
events and copies can be checked on a machine without a GPU by a stand-in that records them. Tensors
that live on the host already (CPU training) are kept as they are.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import saved_tensors_hooks


class DeviceStreams:
    """The stream operations of one accelerator type that offloading uses (``torch.cuda``'s for ``"cuda"``).

    Events are the device module's: ``event.record(stream)``, ``stream.wait_event(event)``.
    """

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type
        self._side: dict[torch.device, Any] = {}

    @property
    def module(self) -> Any:
        return torch.get_device_module(self.device_type)

    def offloads(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator (and so is moved to the host)."""
        return tensor.device.type == self.device_type

    def current_stream(self, device: torch.device) -> Any:
        return self.module.current_stream(device)

    def side_stream(self, device: torch.device) -> Any:
        """One side stream per device, created on first use and reused by every layer."""
        if device not in self._side:
            self._side[device] = self.module.Stream(device)
        return self._side[device]

    def event(self) -> Any:
        return self.module.Event()

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        """Make ``stream`` current inside the context."""
        return self.module.stream(stream)

    def keep_for(self, tensor: Tensor, stream: Any) -> None:
        """Do not reuse ``tensor``'s memory before the work queued on ``stream`` so far has run."""
        tensor.record_stream(stream)

    def host_buffer(self, tensor: Tensor) -> Tensor:
        """Pinned host memory for a copy of ``tensor`` (pinned: a non-blocking copy needs it)."""
        return torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)


@dataclass(frozen=True)
class _Offloaded:
    host: Tensor
    device: torch.device
    copied: Any  # the event after which ``host`` holds the bytes


class ActivationOffload:
    """Saved-tensor hooks that keep the saved tensors in host memory (see the module docstring)::

    with ActivationOffload().hooks():
        out = checkpoint(layer, hidden_states, use_reentrant=False)
    """

    def __init__(self, streams: DeviceStreams | None = None) -> None:
        self.streams = streams or DeviceStreams()

    def hooks(self) -> saved_tensors_hooks:
        return saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: Tensor) -> Tensor | _Offloaded:
        streams = self.streams
        if not streams.offloads(tensor):
            return tensor
        made, copied = streams.event(), streams.event()
        side = streams.side_stream(tensor.device)
        made.record(streams.current_stream(tensor.device))
        side.wait_event(made)
        with streams.on(side):
            host = streams.host_buffer(tensor)
            host.copy_(tensor, non_blocking=True)
            copied.record(side)
        streams.keep_for(tensor, side)
        return _Offloaded(host, tensor.device, copied)

    def unpack(self, packed: Tensor | _Offloaded) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        self.streams.current_stream(packed.device).wait_event(packed.copied)
        return packed.host.to(packed.device, non_blocking=True)


@functools.cache
def default_offload() -> ActivationOffload:
    """The process's CUDA offload (one side stream per device, shared by every layer)."""
    return ActivationOffload()
