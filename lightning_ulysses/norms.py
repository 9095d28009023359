"""Fused norms: the same forward as transformers' RMSNorms and LayerNorms, keeping only the input for the backward.

A norm written in PyTorch ops, as transformers writes them (``x.float()``, ``pow``, ``mean``, ``rsqrt``, products),
leaves autograd the float copy of its input and the normalised ``[tokens, hidden]`` tensor, and its backward makes
several more: in bf16 that is about five times the input's bytes per norm, two norms per layer, at the moment a
checkpointed layer is recomputed for its backward, which is where long-context training peaks.
:class:`_FusedRMSNorm` and :class:`_FusedLayerNorm` compute the forward with the same operations (bit for bit the same
output) and keep the input, the parameters and the ``[tokens, 1]`` per-token statistics (reciprocal RMS; mean and
reciprocal standard deviation); their backward is the closed form.

Mamba 2's gated RMSNorm (``x * silu(gate)`` normalised in groups) is :func:`gated_rms_norm`, found by calling the
module with a gate (:func:`gated_norm_groups`). Which modules are such norms is found by what they do
(:func:`norm_form`): a module with a 1-D ``weight`` (and
optionally a 1-D ``bias``) and an epsilon attribute whose own forward, run on probe inputs, gives bit for bit the
output of one of the :data:`FORMS`, and, in float32, the same gradients (a forward that treats a tensor as a
constant in its backward, such as a detached statistic, would otherwise get the fused form's backward instead of its
own). A module that computes ``torch.nn.functional.layer_norm`` (``nn.LayerNorm``) is
found as ``"native_layer_norm"``: torch's kernel already keeps only the input and the per-token statistics, so it is
left as it is. Anything else keeps its forward.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NormForm = Literal[
    "weight", "weight_in_float", "one_plus_weight", "layer_norm", "layer_norm_in_float", "native_layer_norm"
]
"""What a norm computes. RMSNorms, with ``xhat = x.float() * rsqrt(mean(x.float() ** 2) + eps)``: ``"weight"``:
``weight * xhat.to(x.dtype)`` (Llama, Mistral, Qwen, ...); ``"weight_in_float"``: ``(xhat * weight).to(x.dtype)``
(OLMo 2); ``"one_plus_weight"``: ``(xhat * (1 + weight.float())).to(x.dtype)`` (Gemma). LayerNorms, with ``xhat =
(x.float() - mean) * rsqrt(mean((x.float() - mean) ** 2) + eps)``: ``"layer_norm"``: ``weight * xhat.to(x.dtype)
[+ bias]``; ``"layer_norm_in_float"``: ``(weight.float() * xhat [+ bias.float()]).to(x.dtype)`` (Cohere).
``"native_layer_norm"``: ``F.layer_norm`` (``nn.LayerNorm``; kept as it is)."""
RMS_FORMS: tuple[NormForm, ...] = ("weight", "weight_in_float", "one_plus_weight")
LAYER_NORM_FORMS: tuple[NormForm, ...] = ("layer_norm", "layer_norm_in_float")
FORMS: tuple[NormForm, ...] = (*RMS_FORMS, *LAYER_NORM_FORMS, "native_layer_norm")
EPS_ATTRIBUTES = ("variance_epsilon", "eps")


def rms_norm(x: Tensor, weight: Tensor, eps: float, form: NormForm = "weight") -> Tensor:
    """RMSNorm of ``x [..., d]`` over its last dimension with ``weight [d]`` in ``form`` (one of :data:`RMS_FORMS`),
    keeping only ``x`` and the reciprocal RMS ``[..., 1]`` for the backward."""
    return _FusedRMSNorm.apply(x, weight, eps, form)


def layer_norm(
    x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, form: NormForm = "layer_norm_in_float"
) -> Tensor:
    """LayerNorm of ``x [..., d]`` over its last dimension with ``weight [d]`` and ``bias [d]`` (or None) in ``form``
    (one of :data:`LAYER_NORM_FORMS`), keeping only ``x``, the mean and the reciprocal standard deviation
    (``[..., 1]`` each) for the backward."""
    return _FusedLayerNorm.apply(x, weight, bias, eps, form)


def gated_rms_norm(x: Tensor, gate: Tensor | None, weight: Tensor, eps: float, groups: int = 1) -> Tensor:
    """Mamba 2's gated RMSNorm: ``u = x.float() * silu(gate.float())`` (``x.float()`` without a gate), normalised
    over ``groups`` equal groups of its last dimension, ``weight * uhat.to(x.dtype)``; keeping only ``x``, ``gate``
    and the reciprocal RMS ``[..., groups, 1]`` for the backward."""
    return _FusedGatedRMSNorm.apply(x, gate, weight, eps, groups)


def fused_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, form: NormForm) -> Tensor:
    """The norm of ``form`` (not ``"native_layer_norm"``) as :func:`rms_norm` or :func:`layer_norm`."""
    if form in RMS_FORMS:
        assert bias is None  # norm_form finds RMS forms only for modules without a bias
        return rms_norm(x, weight, eps, form)
    return layer_norm(x, weight, bias, eps, form)


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


class _FusedLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, form: NormForm) -> Tensor:
        xf = x.float()
        mean = xf.mean(-1, keepdim=True)
        rstd = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
        xhat = (xf - mean) * rstd
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        if form == "layer_norm":
            out = weight * xhat.to(x.dtype)
            return out if bias is None else out + bias
        out = weight.float() * xhat
        return (out if bias is None else out + bias.float()).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        """With ``g`` the gradient in float times the weight: ``dx = rstd * (g - mean(g) - xhat * mean(g xhat))``,
        ``dweight = sum(grad * xhat)``, ``dbias = sum(grad)`` over the tokens."""
        x, weight, bias, mean, rstd = ctx.saved_tensors
        xhat = (x.float() - mean).mul_(rstd)
        g = grad.float()
        grad_weight = (g * xhat).sum_to_size(weight.shape).to(weight.dtype)
        grad_bias = None if bias is None else g.sum_to_size(bias.shape).to(bias.dtype)
        g = g.mul_(weight.float()) if g is not grad else g * weight.float()
        row_mean = g.mean(-1, keepdim=True)
        row_dot = (g * xhat).mean(-1, keepdim=True)
        grad_x = g.sub_(row_mean).sub_(xhat.mul_(row_dot)).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, grad_bias, None, None


class _FusedGatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, gate: Tensor | None, weight: Tensor, eps: float, groups: int) -> Tensor:
        u = _gated(x, gate)
        grouped = u.view(*u.shape[:-1], groups, u.shape[-1] // groups)
        rstd = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, gate, weight, rstd)
        return weight * (grouped * rstd).view(u.shape).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        """RMSNorm's closed form per group for ``du``, then ``dx = du * silu(gate)`` and
        ``dgate = du * x * silu'(gate)``, ``silu'(z) = sigmoid(z) * (1 + z * (1 - sigmoid(z)))``."""
        x, gate, weight, rstd = ctx.saved_tensors
        groups = rstd.shape[-2]
        u = _gated(x, gate)
        uhat = u.view(*u.shape[:-1], groups, -1) * rstd  # not in place: u is x itself for an fp32 x and no gate
        g = grad.float()
        grad_weight = (g * uhat.view(u.shape)).sum_to_size(weight.shape).to(weight.dtype)
        gs = (g * weight.float()).view_as(uhat)
        du = (gs - uhat * (gs * uhat).mean(-1, keepdim=True)).mul_(rstd).view(u.shape)
        if gate is None:
            return du.to(x.dtype), None, grad_weight, None, None
        z = gate.float()
        sigmoid = torch.sigmoid(z)
        grad_gate = du * x.float() * sigmoid * (1 + z * (1 - sigmoid))
        return (du * (z * sigmoid)).to(x.dtype), grad_gate.to(gate.dtype), grad_weight, None, None


def _gated(x: Tensor, gate: Tensor | None) -> Tensor:
    """``x.float() * silu(gate.float())`` as transformers' gated norms compute it, or ``x.float()``."""
    u = x.to(torch.float32)
    return u if gate is None else u * F.silu(gate.to(torch.float32))


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


def norm_form(module: nn.Module) -> NormForm | None:
    """The :data:`NormForm` whose norm gives bit for bit ``module``'s own output, or None.

    The module's forward runs on a stand-in (its attributes, probe parameters, no hooks: nothing of the real module,
    which ZeRO-3 may have partitioned, is read or gathered), on inputs of 2, 3 and 4 dimensions in float32 and
    bfloat16, at the scale of the data and at the scale of its epsilon (where a different epsilon would show)."""
    params = dict(module.named_parameters(recurse=False))
    eps = norm_eps(module)
    if eps is None or list(params) not in (["weight"], ["weight", "bias"]) or list(module.children()):
        return None
    if "forward" in module.__dict__:  # patched by someone else: what runs is not the class's forward
        return None
    shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in params.values()]  # ZeRO-3 keeps the full shape there
    if any(len(shape) != 1 or shape != shapes[0] for shape in shapes):
        return None
    size = shapes[0][0]
    generator = torch.Generator().manual_seed(0)
    probe_params = {name: torch.randn(size, generator=generator).to(p.dtype) for name, p in params.items()}
    probes = [
        (torch.randn(*leading, size, generator=generator) * scale).to(dtype)
        for leading in PROBE_LEADING_DIMS
        for dtype in (torch.float32, torch.bfloat16)
        for scale in (1.0, eps**0.5)
    ]
    stand_in = _stand_in(module, probe_params)
    weight, bias = probe_params["weight"], probe_params.get("bias")
    forms = FORMS if bias is None else (*LAYER_NORM_FORMS, "native_layer_norm")
    with torch.no_grad():
        try:
            expected = [type(module).forward(stand_in, x) for x in probes]
        except Exception:  # noqa: BLE001 - a forward that cannot run on a plain tensor is not a norm we know
            return None
        for form in forms:
            got = [_reference(x, weight, bias, eps, form) for x in probes]
            if all(_same(g, e) for g, e in zip(got, expected, strict=True)):
                break
        else:
            return None
    trained = _stand_in(module, probe_params, trainable=True)
    leaves = dict(trained.named_parameters(recurse=False))
    fused = functools.partial(_reference, weight=leaves["weight"], bias=leaves.get("bias"), eps=eps, form=form)
    own = functools.partial(type(module).forward, trained)
    return form if _same_gradients(own, fused, [probes[0]], list(leaves.values())) else None


def gated_norm_groups(module: nn.Module) -> int | None:
    """The number of groups ``g`` for which :func:`gated_rms_norm` gives bit for bit ``module(x, gate)``'s output (and
    ``module(x)``'s, as ``gated_rms_norm(x, None, ...)``), or None; probed on a stand-in as :func:`norm_form` does."""
    params = dict(module.named_parameters(recurse=False))
    eps = norm_eps(module)
    if eps is None or list(params) != ["weight"] or list(module.children()) or "forward" in module.__dict__:
        return None
    shape = tuple(getattr(params["weight"], "ds_shape", params["weight"].shape))
    if len(shape) != 1:
        return None
    size = shape[0]
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(size, generator=generator).to(params["weight"].dtype)
    probes = [
        tuple((torch.randn(*leading, size, generator=generator) * scale).to(dtype) for scale in (1.0, eps**0.5))
        for leading in PROBE_LEADING_DIMS[:2]
        for dtype in (torch.float32, torch.bfloat16)
    ]
    stand_in = _stand_in(module, {"weight": weight})
    with torch.no_grad():
        try:
            expected = [
                (type(module).forward(stand_in, x, gate), type(module).forward(stand_in, x)) for x, gate in probes
            ]
        except Exception:  # noqa: BLE001 - a forward that takes no gate is not a gated norm
            return None
        for groups in (g for g in range(1, size + 1) if size % g == 0):
            got = [
                (gated_rms_norm(x, gate, weight, eps, groups), gated_rms_norm(x, None, weight, eps, groups))
                for x, gate in probes
            ]
            if all(_same(g, e) for pair, pairs in zip(got, expected, strict=True) for g, e in zip(pair, pairs)):
                break
        else:
            return None
    trained = _stand_in(module, {"weight": weight}, trainable=True)
    trained_weight = trained.weight
    assert isinstance(trained_weight, Tensor)
    fused = functools.partial(gated_rms_norm, weight=trained_weight, eps=eps, groups=groups)
    inputs = [probes[0][0], torch.randn(probes[0][0].shape, generator=generator)]  # x, a gate at the scale of x
    same = _same_gradients(functools.partial(type(module).forward, trained), fused, inputs, [trained_weight])
    return groups if same else None


GRADIENT_TOLERANCE = 1e-4
"""The largest relative error (norm of the difference over the norm) between a module's float32 gradients and its
fused form's that :func:`_same_gradients` takes as rounding: the closed-form backward against autograd's chain."""


def _same_gradients(
    own: Callable[..., Tensor], fused: Callable[..., Tensor], inputs: list[Tensor], parameters: list[Tensor]
) -> bool:
    """Whether ``own(*inputs)`` and ``fused(*inputs)`` (both reading ``parameters``, which need a gradient) have the
    same gradients with respect to ``inputs`` and ``parameters`` for one seeded upstream gradient, in float32: their
    forwards agree bit for bit, their backwards may not (a statistic detached in ``own``)."""
    inputs = [t.detach().float().requires_grad_() for t in inputs]
    leaves = [*inputs, *parameters]
    with torch.inference_mode(False), torch.enable_grad():
        own_output, fused_output = own(*inputs), fused(*inputs)
        upstream = torch.randn(own_output.shape, generator=torch.Generator().manual_seed(1))
        expected = torch.autograd.grad(own_output, leaves, upstream, allow_unused=True)
        got = torch.autograd.grad(fused_output, leaves, upstream, allow_unused=True)
    return all(_close_gradient(g, e, leaf) for g, e, leaf in zip(got, expected, leaves, strict=True))


def _close_gradient(got: Tensor | None, expected: Tensor | None, leaf: Tensor) -> bool:
    """``got`` within :data:`GRADIENT_TOLERANCE` of ``expected`` (``None``: no gradient, zeros)."""
    got = torch.zeros_like(leaf) if got is None else got
    expected = torch.zeros_like(leaf) if expected is None else expected
    return bool((got - expected).norm() <= GRADIENT_TOLERANCE * expected.norm())


def _reference(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, form: NormForm) -> Tensor:
    if form == "native_layer_norm":
        return F.layer_norm(x, weight.shape, weight, bias, eps)
    return fused_norm(x, weight, bias, eps, form)


def norm_eps(module: nn.Module) -> float | None:
    """The epsilon a norm module holds (``variance_epsilon`` or ``eps``), or None."""
    return next((v for name in EPS_ATTRIBUTES if isinstance(v := getattr(module, name, None), float)), None)


def _stand_in(module: nn.Module, params: dict[str, Tensor], trainable: bool = False) -> nn.Module:
    """A shallow copy of ``module`` with ``params`` as its parameters (those it holds as None kept; needing a gradient
    where ``trainable``, in float32) and no hooks."""
    stand_in = copy.copy(module)
    stand_in.__dict__.update(
        _parameters={
            name: None
            if name not in params
            else nn.Parameter(params[name].float() if trainable else params[name], requires_grad=trainable)
            for name in module._parameters
        },
        _forward_hooks=OrderedDict(),
        _forward_pre_hooks=OrderedDict(),
    )
    return stand_in


def _same(got: Tensor, expected: object) -> bool:
    return isinstance(expected, Tensor) and expected.dtype == got.dtype and torch.equal(expected, got)
