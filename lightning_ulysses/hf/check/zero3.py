"""The set-up check's calls of the model find the parameters read outside their own module's call, as DeepSpeed's
engine does in a step.

ZeRO-3 keeps each parameter partitioned (an empty tensor on every rank) and gathers a module's own parameters around
that module's call (its forward hooks). A module may read a parameter elsewhere: Gemma 3n's decoder layer calls
``AltUp.forward`` directly (``scale_corrected_output``), so no hook runs, and it reads ``correct_output_scale``; in
training ``AltUp.correct`` reads ``self.correction_coefs.weight`` without calling that linear layer. Inside the
engine's forward, DeepSpeed finds such a read: the owner's parameter dict (a ``ZeROOrderedDict``) gathers the
parameter when it is read and registers it as an external parameter of the innermost module being called, which
gathers it for its forward and backward from then on. The engine switches that on (``_parameters._in_forward``) for
its own forward only; the set-up check calls the model itself, before any step, where the read would find the empty
tensor ("The size of tensor a (64) must match the size of tensor b (0)"). Within :func:`engine_like_calls`, every
call of the model has it switched on as in the engine's forward; the check's calls of single modules outside a call
of the model do not (a read there would be registered on the engine's outermost module, gathered for every step).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from lightning_ulysses.engines import deepspeed as deepspeed_engine


@contextmanager
def engine_like_calls(model: nn.Module) -> Iterator[None]:
    """Within the block, each call of ``model`` finds the ZeRO-3 parameters read outside their own module's call as
    a call inside DeepSpeed's engine does (see the module docstring). Nothing changes without ZeRO-3."""
    discovering = deepspeed_engine.zero3_parameter_dicts(model)
    if not discovering:
        yield
        return
    depth = 0  # calls of the model in progress (it may call itself)
    before: list[bool] = []

    def enter(module: nn.Module, args: Any) -> None:
        nonlocal depth
        if depth == 0:
            before[:] = [deepspeed_engine.in_forward(parameters) for parameters in discovering]
            for parameters in discovering:
                deepspeed_engine.set_in_forward(parameters, True)
        depth += 1

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        nonlocal depth
        depth -= 1
        if depth == 0:
            for parameters, was in zip(discovering, before, strict=True):
                deepspeed_engine.set_in_forward(parameters, was)

    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
