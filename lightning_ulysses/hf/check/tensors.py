"""The tensors of module calls: recorded, named, mapped; forward hooks on every module; modes kept across a probe,
backward hooks kept from firing in it; gradient probes (autograd on, random states restored; whether a zero gradient
reaches a tensor)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_ulysses.hf.plan import argument_keys, positional_parameters


@dataclass
class Call:
    """One call of a module in the whole-sequence run: its tensors, for comparison with the sharded run."""

    inputs: dict[str, Tensor]
    outputs: list[Tensor]
    args: tuple
    kwargs: dict[str, Any]


def tensors_of(value: Any) -> list[Tensor]:
    """Every tensor in a (nested) output or argument structure, in order."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        return tensors_of(value.to_tuple())
    return []


def named_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Tensor]:
    """The tensors among the arguments of a call of ``module``, keyed by parameter name (``hidden_states``,
    ``position_embeddings.1``, ...: :func:`~lightning_ulysses.hf.plan.argument_keys`)."""
    named: dict[str, Tensor] = {}
    for key, value in argument_keys(positional_parameters(module), args, kwargs):
        tensors = tensors_of(value)
        if isinstance(value, Tensor):
            named[key] = value
        else:
            named.update({f"{key}.{i}": t for i, t in enumerate(tensors)})
    return named


def first_tensor(output: Any) -> Tensor | None:
    tensors = tensors_of(output)
    return tensors[0] if tensors else None


@contextmanager
def hooks(model: nn.Module, hook: Any) -> Iterator[None]:
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def modes_restored(module: nn.Module) -> Iterator[None]:
    """Inside the block a probe may put ``module`` in eval or train mode; after it every submodule has its own mode
    back (``module.train(mode)`` would set one mode on all, a frozen part's included)."""
    modes = {m: m.training for m in module.modules()}
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training


@contextmanager
def backward_hooks_off(module: nn.Module) -> Iterator[None]:
    """Within the block no module inside ``module`` has backward hooks: a probe's backward is no step's. ZeRO-3
    reduces the gradients of a leaf module (DeepSpeed makes Mixtral's and Qwen-MoE's blocks leaves) in such a hook,
    and would queue them twice in the first step. The forward hooks, which gather ZeRO-3's parameters for the forward
    and the backward, stay."""
    kept = [(m, m._backward_hooks, m._backward_pre_hooks) for m in module.modules()]
    try:
        for m, _, _ in kept:
            m._backward_hooks, m._backward_pre_hooks = OrderedDict(), OrderedDict()
        yield
    finally:
        for m, hooks, pre_hooks in kept:
            m._backward_hooks, m._backward_pre_hooks = hooks, pre_hooks


@contextmanager
def gradient_probe(device: torch.device) -> Iterator[None]:
    """Within the block autograd records (also where the caller runs in inference mode), and on leaving the random
    generators' states (the CPU's and ``device``'s) are those of entering: a probe that leaves no trace."""
    devices = [] if device.type == "cpu" else [device]
    with torch.inference_mode(False), torch.enable_grad(), torch.random.fork_rng(devices, device_type=device.type):
        yield


def zero_gradient_reaches(outputs: Sequence[Tensor], inputs: Sequence[Tensor], retain_graph: bool = False) -> bool:
    """Whether a zero gradient of ``outputs`` gives any of ``inputs`` a non-zero one (:func:`torch.autograd.grad`: no
    ``.grad`` is written): a loss that only the backward sees, added on the way. ``False`` where no output records."""
    if not outputs:
        return False
    zeros = [torch.zeros_like(t) for t in outputs]
    grads = torch.autograd.grad(outputs, inputs, zeros, retain_graph=retain_graph, allow_unused=True)
    return any(g is not None and bool(g.any()) for g in grads)


def random_hidden_states(tokens: int, features: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[tokens, features]`` seeded normal values in ``dtype`` on ``device`` (the default generator untouched): what
    a probe of an output head calls it on."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(tokens, features, generator=generator).to(device=device, dtype=dtype)
