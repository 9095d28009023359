"""Fused norms (``fused_norms``): every norm whose forward is found to compute one of the fused forms runs as it.

Found by what each module computes (:func:`~lightning_ulysses.norms.norm_form`,
:func:`~lightning_ulysses.norms.gated_norm_groups`): RMSNorms and LayerNorms written in PyTorch ops run as
:func:`~lightning_ulysses.norms.rms_norm` / :func:`~lightning_ulysses.norms.layer_norm`, Mamba 2's gated RMSNorm
(``RMSNormGated(x, gate)``: ``x * silu(gate)`` normalised in groups) as :func:`~lightning_ulysses.norms.gated_rms_norm`
(the same output, only the inputs and per-token statistics kept for the backward); a module that computes
``F.layer_norm`` already keeps only those and is left as it is. A call with arguments that the module's fused form
does not take runs the module's own forward: the norms that the set-up probe saw called so are reported.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_ulysses.hf.ledger import Ledger
from lightning_ulysses.memory.probe import Call
from lightning_ulysses.norms import NormForm, fused_norm, gated_norm_groups, gated_rms_norm, norm_eps, norm_form


@dataclass(frozen=True)
class Norm:
    """A norm of the model: its ungated ``form`` (None: it has none), the groups of its gated form (None: it has
    none), and whether the probe called it with more than its input (``gated``)."""

    name: str
    module: nn.Module
    form: NormForm | None
    gate_groups: int | None = None
    gated: bool = False

    @property
    def fused(self) -> bool:
        """Whether its forward is replaced (a ``"native_layer_norm"``'s kernel keeps only what the fused form would)."""
        return self.gate_groups is not None or self.form != "native_layer_norm"

    @property
    def runs_own_forward(self) -> bool:
        """Whether the probe saw it called in a way that its fused forward does not take (a gate it has no form for)."""
        return self.gated and self.gate_groups is None


def find_norms(model: nn.Module) -> list[Norm]:
    """Every module of ``model`` that computes one of the norm forms."""
    found = ((name, module, norm_form(module), gated_norm_groups(module)) for name, module in model.named_modules())
    return [Norm(name, module, form, groups) for name, module, form, groups in found if form or groups]


def with_call_signatures(norms: list[Norm], calls: dict[nn.Module, list[Call]]) -> list[Norm]:
    """``norms``, each marked ``gated`` where the probe called it with an argument besides its input."""
    return [
        Norm(n.name, n.module, n.form, n.gate_groups, any(_extra_arguments(c) for c in calls.get(n.module, [])))
        for n in norms
    ]


def fuse_norms(norms: list[Norm], ledger: Ledger) -> None:
    for norm in norms:
        if norm.fused:
            eps = norm_eps(norm.module)
            assert eps is not None  # norm_form / gated_norm_groups found it
            forward = functools.partial(_fused_norm_forward, norm.module, eps, norm.form, norm.gate_groups)
            ledger.set("fused_norms", norm.module, "forward", forward)


def _fused_norm_forward(
    norm: nn.Module, eps: float, form: NormForm | None, groups: int | None, *args: Any, **kwargs: Any
) -> Any:
    """``norm``'s forward as its fused form; its weight read at each call (ZeRO-3 gathers it for the call). Called
    with anything its fused forms do not take (the input by keyword, a gate it has no gated form for), the module's
    own forward."""
    extras = [*args[1:], *kwargs.values()]
    given = [e for e in extras if e is not None]
    weight, bias = norm.weight, getattr(norm, "bias", None)
    assert isinstance(weight, Tensor)
    if args and not given and form is not None and form != "native_layer_norm":
        return fused_norm(args[0], weight, bias if isinstance(bias, Tensor) else None, eps, form)
    if args and groups is not None and len(extras) <= 1 and all(isinstance(e, Tensor) for e in given):
        return gated_rms_norm(args[0], given[0] if given else None, weight, eps, groups)
    return type(norm).forward(norm, *args, **kwargs)


def _extra_arguments(call: Call) -> bool:
    return any(a is not None for a in call.args[1:]) or any(v is not None for v in call.kwargs.values())
