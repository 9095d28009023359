"""Fused norms (``fused_norms``): every norm whose forward is found to compute one of the fused forms runs as it.

Found by what each module computes (:func:`~lightning_ulysses.norms.norm_form`): RMSNorms and LayerNorms written in
PyTorch ops run as :func:`~lightning_ulysses.norms.rms_norm` / :func:`~lightning_ulysses.norms.layer_norm` (the same
output, only the input and per-token statistics kept for the backward); a module that computes ``F.layer_norm``
already keeps only those and is left as it is. A call with arguments the fused form does not take (the gate of
Mamba 2's ``RMSNormGated(x, gate)``, which multiplies by ``silu(gate)`` before or after the norm) runs the module's
own forward: the norms called so in the set-up probe are reported.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_ulysses.hf.ledger import Ledger
from lightning_ulysses.memory.probe import Call
from lightning_ulysses.norms import NormForm, fused_norm, norm_eps, norm_form


@dataclass(frozen=True)
class Norm:
    """A norm of the model: its ``form``, and whether the probe called it with more than its input (``gated``)."""

    name: str
    module: nn.Module
    form: NormForm
    gated: bool = False

    @property
    def fused(self) -> bool:
        """Whether its forward is replaced (else torch's own kernel already keeps only what the fused form would)."""
        return self.form != "native_layer_norm"


def find_norms(model: nn.Module) -> list[Norm]:
    """Every module of ``model`` that computes one of the norm forms."""
    found = ((name, module, norm_form(module)) for name, module in model.named_modules())
    return [Norm(name, module, form) for name, module, form in found if form is not None]


def with_call_signatures(norms: list[Norm], calls: dict[nn.Module, list[Call]]) -> list[Norm]:
    """``norms``, each marked ``gated`` where the probe called it with an argument besides its input."""
    return [Norm(n.name, n.module, n.form, any(_extra_arguments(c) for c in calls.get(n.module, []))) for n in norms]


def fuse_norms(norms: list[Norm], ledger: Ledger) -> None:
    for norm in norms:
        if norm.fused:
            eps = norm_eps(norm.module)
            assert eps is not None  # norm_form found it
            forward = functools.partial(_fused_norm_forward, norm.module, eps, norm.form)
            ledger.set("fused_norms", norm.module, "forward", forward)


def _fused_norm_forward(norm: nn.Module, eps: float, form: NormForm, *args: Any, **kwargs: Any) -> Any:
    """``norm``'s forward as the fused form; its parameters read at each call (ZeRO-3 gathers them for the call).
    Called with anything but its input alone (a gate, the input by keyword), the module's own forward."""
    if not args or any(a is not None for a in args[1:]) or any(v is not None for v in kwargs.values()):
        return type(norm).forward(norm, *args, **kwargs)
    weight, bias = norm.weight, getattr(norm, "bias", None)
    assert isinstance(weight, Tensor)
    return fused_norm(args[0], weight, bias if isinstance(bias, Tensor) else None, eps, form)


def _extra_arguments(call: Call) -> bool:
    return any(a is not None for a in call.args[1:]) or any(v is not None for v in call.kwargs.values())
