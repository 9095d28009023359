"""Fused RMSNorm: the same forward as transformers' RMSNorms, keeping only its input for the backward.

An RMSNorm written in PyTorch ops, as transformers writes them (``x.float()``, ``pow``, ``mean``, ``rsqrt``, two
products), leaves autograd the float copy of its input and the normalised ``[tokens, hidden]`` tensor, and its
backward makes several more: in bf16 that is about five times the input's bytes per norm, two norms per layer, at
the moment a checkpointed layer is recomputed for its backward, which is where long-context training peaks.
:class:`_FusedRMSNorm` computes the forward with the same operations (bit for bit the same output) and keeps the
input, the weight and the ``[tokens, 1]`` reciprocal RMS; its backward is the closed form.

Which modules are RMSNorms is found by what they do (:func:`rms_norm_form`): a module with one parameter, a 1-D
``weight``, and an epsilon attribute whose own forward, run on probe inputs, gives bit for bit the output of one
of the :data:`FORMS`. Anything else keeps its forward.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Literal

import torch
from torch import Tensor, nn

NormForm = Literal["weight", "weight_in_float", "one_plus_weight"]
"""How the weight scales the normalised ``xhat = x.float() * rsqrt(mean(x.float() ** 2) + eps)``:
``"weight"``: ``weight * xhat.to(x.dtype)`` (Llama, Mistral, Qwen, ...); ``"weight_in_float"``:
``(xhat * weight).to(x.dtype)`` (OLMo 2); ``"one_plus_weight"``: ``(xhat * (1 + weight.float())).to(x.dtype)``
(Gemma)."""
FORMS: tuple[NormForm, ...] = ("weight", "weight_in_float", "one_plus_weight")
EPS_ATTRIBUTES = ("variance_epsilon", "eps")


def rms_norm(x: Tensor, weight: Tensor, eps: float, form: NormForm = "weight") -> Tensor:
    """RMSNorm of ``x [..., d]`` over its last dimension with ``weight [d]`` in ``form``, keeping only ``x`` and the
    reciprocal RMS ``[..., 1]`` for the backward."""
    return _FusedRMSNorm.apply(x, weight, eps, form)


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, form: NormForm) -> Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.form = form
        return _scale(x.float() * rstd, weight, x.dtype, form)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        """With ``s`` the weight's float scale (``weight`` or ``1 + weight``) and ``g`` the gradient in float:
        ``dweight = sum(g * xhat)`` over the tokens, ``dx = rstd * (g s - xhat * mean(g s xhat))``. At most two
        ``[tokens, d]`` float temporaries at a time: ``xhat`` with ``g * xhat``, then ``xhat`` with ``dx``."""
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        g = grad.float()
        scale = _float_scale(weight, ctx.form)
        product = g * xhat
        grad_weight = product.sum_to_size(weight.shape)
        # mean(g s xhat) per token by a matrix-vector product: no third [tokens, d] temporary
        row_mean = (product @ scale).unsqueeze(-1).div_(x.shape[-1])
        del product
        grad_x = g * scale
        grad_x.sub_(xhat.mul_(row_mean)).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None, None


def _scale(xhat: Tensor, weight: Tensor, dtype: torch.dtype, form: NormForm) -> Tensor:
    if form == "weight":
        return weight * xhat.to(dtype)
    return (xhat * _float_scale(weight, form)).to(dtype)


def _float_scale(weight: Tensor, form: NormForm) -> Tensor:
    """What multiplies ``xhat`` in float in the forms other than ``"weight"``: ``1 + weight`` or ``weight``."""
    return 1 + weight.float() if form == "one_plus_weight" else weight.float()


PROBE_LEADING_DIMS = ((6,), (2, 3), (1, 2, 3))
"""The probes' dimensions before the normalised one: tokens, ``[batch, seq]`` (hidden states) and ``[batch, seq,
heads]`` (per-head q/k norms), so that a forward that branches on its input's rank is seen doing so."""


def rms_norm_form(module: nn.Module) -> NormForm | None:
    """The :data:`NormForm` whose :func:`rms_norm` gives bit for bit ``module``'s own output, or None.

    The module's forward runs on a stand-in (its attributes, a probe weight, no hooks: nothing of the real module,
    which ZeRO-3 may have partitioned, is read or gathered), on inputs of 2, 3 and 4 dimensions in float32 and
    bfloat16, at the scale of the data and at the scale of its epsilon (where a different epsilon would show)."""
    params = dict(module.named_parameters(recurse=False))
    eps = norm_eps(module)
    if eps is None or list(params) != ["weight"] or params["weight"].dim() != 1 or list(module.children()):
        return None
    if "forward" in module.__dict__:  # patched by someone else: what runs is not the class's forward
        return None
    size = int(getattr(params["weight"], "ds_shape", params["weight"].shape)[0])  # ZeRO-3 keeps the full shape there
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(size, generator=generator).to(params["weight"].dtype)
    probes = [
        (torch.randn(*leading, size, generator=generator) * scale).to(dtype)
        for leading in PROBE_LEADING_DIMS
        for dtype in (torch.float32, torch.bfloat16)
        for scale in (1.0, eps**0.5)
    ]
    stand_in = _stand_in(module, weight)
    with torch.no_grad():
        try:
            expected = [type(module).forward(stand_in, x) for x in probes]
        except Exception:  # noqa: BLE001 - a forward that cannot run on a plain tensor is not an RMSNorm we know
            return None
        for form in FORMS:
            if all(_same(rms_norm(x, weight, eps, form), e) for x, e in zip(probes, expected, strict=True)):
                return form
    return None


def norm_eps(module: nn.Module) -> float | None:
    """The epsilon a norm module holds (``variance_epsilon`` or ``eps``), or None."""
    return next((v for name in EPS_ATTRIBUTES if isinstance(v := getattr(module, name, None), float)), None)


def _stand_in(module: nn.Module, weight: Tensor) -> nn.Module:
    """A shallow copy of ``module`` with ``weight`` as its parameter and no hooks."""
    stand_in = copy.copy(module)
    stand_in.__dict__.update(
        _parameters={"weight": nn.Parameter(weight, requires_grad=False)},
        _forward_hooks=OrderedDict(),
        _forward_pre_hooks=OrderedDict(),
    )
    return stand_in


def _same(got: Tensor, expected: object) -> bool:
    return isinstance(expected, Tensor) and expected.dtype == got.dtype and torch.equal(expected, got)
