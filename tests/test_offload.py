"""Activation offload: side-stream copies in the right order, and exact gradients.

Without a GPU the stream operations are checked through a stand-in for ``torch.cuda``'s streams
(:class:`RecordingStreams`) that treats CPU tensors as device tensors and records every event, wait,
stream switch and copy: each offloaded tensor must be copied on the side stream after the side stream
waited for the compute stream, and the backward must wait for that copy's event before using it. The
backward must use the host copy (changing the original after the forward does not change the gradients),
and gradients equal those without offloading. On a GPU (skipped elsewhere) the real streams give the same
gradients with pinned host copies.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ulysses.memory import MemoryOptions, apply_memory_options, checkpoint_activations, options
from lightning_ulysses.offload import ActivationOffload, DeviceStreams, default_offload
from tests.tiny import VOCAB, tiny_llama


class _Named:
    def __init__(self, name: str, log: list[tuple[str, ...]]) -> None:
        self.name, self.log = name, log

    def record(self, stream: _Named) -> None:  # as an event
        self.log.append(("record", self.name, stream.name))

    def wait_event(self, event: _Named) -> None:  # as a stream
        self.log.append(("wait", self.name, event.name))


class RecordingStreams(DeviceStreams):
    """CPU tensors play device tensors; every stream operation is appended to ``log``."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.log: list[tuple[str, ...]] = []
        self.compute, self.side = _Named("compute", self.log), _Named("side", self.log)
        self.events = 0

    def offloads(self, tensor: Tensor) -> bool:
        # torch 2.11's checkpoint saves an empty host tensor with the inputs (a placeholder; 2.13's does not
        # save it): on a GPU it is not a device tensor and stays, so the stand-in keeps it too
        return tensor.numel() > 0 and super().offloads(tensor)

    def current_stream(self, device: torch.device) -> _Named:
        return self.compute

    def side_stream(self, device: torch.device) -> _Named:
        return self.side

    def event(self) -> _Named:
        self.events += 1
        return _Named(f"event{self.events}", self.log)

    @contextmanager
    def on(self, stream: _Named) -> Iterator[None]:
        self.log.append(("enter", stream.name))
        yield
        self.log.append(("exit", stream.name))

    def keep_for(self, tensor: Tensor, stream: _Named) -> None:
        self.log.append(("keep_for", stream.name))

    def host_buffer(self, tensor: Tensor) -> Tensor:
        return torch.empty_like(tensor)  # no pinned memory without CUDA


@contextmanager
def offloaded_off_a_device(offloaded: bool = True) -> Iterator[RecordingStreams]:
    """With ``offloaded``, the memory options' activation offload (``offload_activations``) takes CPU tensors for device
    ones, as on a GPU: copied through the side stream of the yielded ``RecordingStreams``, which records every copy's
    event. Without, the default offload (on CPU: nothing moves)."""
    streams, default = RecordingStreams(), options.default_offload
    if offloaded:
        options.default_offload = lambda: ActivationOffload(streams)
    try:
        yield streams
    finally:
        options.default_offload = default


class LogCopies(TorchDispatchMode):
    def __init__(self, log: list[tuple[str, ...]]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.log.append(("copy",))
        return func(*args, **(kwargs or {}))


def _stack(offload: bool | ActivationOffload) -> tuple[torch.nn.ModuleList, Tensor, Any]:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))
    x = torch.randn(4, 8, requires_grad=True)

    def forward() -> Tensor:
        h = x
        for layer in layers:
            h = checkpoint_activations(layer, h, offload=offload)
        return h.square().sum()

    return layers, x, forward


def _grads(layers: torch.nn.ModuleList, x: Tensor, loss: Tensor) -> list[Tensor]:
    return list(torch.autograd.grad(loss, [x, *layers.parameters()]))


def test_copies_go_through_the_side_stream_in_order() -> None:
    streams = RecordingStreams()
    layers, x, forward = _stack(ActivationOffload(streams))
    with LogCopies(streams.log):
        loss = forward()
    forward_log = list(streams.log)
    expected = []
    for layer in range(3):  # one saved input per checkpointed layer: made, copied = event 2k+1, 2k+2
        made, copied = f"event{2 * layer + 1}", f"event{2 * layer + 2}"
        expected += [
            ("record", made, "compute"),
            ("wait", "side", made),
            ("enter", "side"),
            ("copy",),
            ("record", copied, "side"),
            ("exit", "side"),
            ("keep_for", "side"),
        ]
    assert forward_log == expected
    streams.log.clear()
    _grads(layers, x, loss)
    # the backward reaches the layers last to first, each waiting for its own copy on the compute stream
    waits = [entry for entry in streams.log if entry[0] == "wait"]
    assert waits == [("wait", "compute", f"event{2 * layer + 2}") for layer in (2, 1, 0)]


def test_offloaded_gradients_are_exact_and_come_from_the_host_copy() -> None:
    layers, x, forward = _stack(False)
    expected = _grads(layers, x, forward())  # plain checkpointing

    for offload, uses_copy in ((ActivationOffload(RecordingStreams()), True), (False, False)):
        layers, x, forward = _stack(offload)
        loss = forward()
        x.data.add_(1.0)  # after the forward: only a recomputation from a copy still sees the old input
        got = _grads(layers, x, loss)
        same = all(torch.allclose(g, e, rtol=1e-6, atol=0) for g, e in zip(got, expected))
        assert same == uses_copy, "offloaded: must equal; not offloaded: the control must see the change"


def test_offload_on_a_transformers_model_is_exact() -> None:
    ids = torch.randint(1, VOCAB, (2, 19))
    positions = torch.arange(19).expand(2, -1)

    def grads(model: torch.nn.Module) -> list[Tensor]:
        loss = model(input_ids=ids, position_ids=positions).logits.logsumexp(-1).mean()
        return list(torch.autograd.grad(loss, list(model.parameters())))

    expected = grads(tiny_llama().train())
    streams = RecordingStreams()
    model = tiny_llama().train()
    model._set_gradient_checkpointing(  # as apply_memory_options does, with the recording streams
        enable=True,
        gradient_checkpointing_func=functools.partial(checkpoint_activations, offload=ActivationOffload(streams)),
    )
    got = grads(model)
    assert sum(entry[0] == "keep_for" for entry in streams.log) >= 2  # at least one input per layer went through
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_host_tensors_are_kept_as_they_are() -> None:
    tensor = torch.randn(3)
    assert default_offload().pack(tensor) is tensor  # CPU training: nothing to move, no copy


@pytest.mark.cuda  # CUDA streams
def test_cuda_offload_is_exact_with_pinned_copies_on_a_side_stream() -> None:
    offload = default_offload()
    tensor = torch.randn(1024, device="cuda")
    packed = offload.pack(tensor)
    assert packed.host.is_pinned() and offload.streams.side_stream(tensor.device) != torch.cuda.current_stream()
    torch.testing.assert_close(offload.unpack(packed), tensor, rtol=0, atol=0)

    ids = torch.randint(1, VOCAB, (1, 2048), device="cuda")
    positions = torch.arange(2048, device="cuda")[None]
    grads = {}
    for offload_activations in (False, True):
        model = tiny_llama(num_hidden_layers=4).cuda().train()
        options = MemoryOptions(activation_checkpointing=True, offload_activations=offload_activations)
        apply_memory_options(model, options)
        loss = model(input_ids=ids, position_ids=positions).logits.float().logsumexp(-1).mean()
        grads[offload_activations] = torch.autograd.grad(loss, list(model.parameters()))
    for g, e in zip(grads[True], grads[False]):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
