"""Liger kernels, opt-in (``UlyssesStrategy(liger_kernels=...)``): LinkedIn's Triton kernels in place of PyTorch ops.

``liger-kernel`` (``pip install 'lightning-ulysses[liger]'``; Triton, CUDA only) replaces, where asked:

* ``"cross_entropy"``: the ``tiled_loss`` path's ``lm_head`` + cross entropy by Liger's fused linear cross entropy
  (chunks of tokens, the logits' gradient made in the forward and scaled by the loss's gradient in the backward), with
  the :class:`~lightning_ulysses.logits.LogitMap` the set-up check found: its factors folded into the hidden states
  (and ``lm_head``'s bias), its soft-cap as Liger's ``softcap``. Needs ``tiled_loss`` on. Liger computes the linear
  layer from ``lm_head.weight`` and ``lm_head.bias`` itself, without calling the module, so an ``lm_head`` whose own
  call does more (a LoRA adapter inside a ``Linear`` subclass, a forward hook) is refused at set-up, found by running it
  (:func:`liger_head_problem`).
* ``"rms_norm"``: every RMSNorm found, by running it, to compute Llama's form (``weight * xhat.to(dtype)``; Liger's
  ``casting_mode="llama"``) or Gemma's (``(xhat * (1 + weight)).to(dtype)``; ``offset=1, casting_mode="gemma"``),
  as ``LigerRMSNormFunction`` (not in place: the residual stream shares the gradient). The other forms are left.
* ``"swiglu"``: every decoder-layer child found, by running a stand-in of it, to compute
  ``down(silu(gate(x)) * up(x))`` with three bias-free ``nn.Linear`` children, as the same three projections around
  ``LigerSiLUMulFunction`` (``tiled_mlp`` then tiles that forward).

Liger's RoPE is not offered: transformers applies rotary embeddings in a module-level function of each model file
(Liger patches ``apply_rotary_pos_emb`` by name), which the behaviour checks here cannot find. Every replacement is
exact to bf16 rounding (tests/test_liger.py, on a GPU). Asked without ``liger_kernel`` and ``triton`` installed, on a
CPU, or under ZeRO-3 (the fused loss takes ``lm_head``'s weight whole), the strategy refuses at set-up.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_ulysses.fused_loss import unlisted_leaves
from lightning_ulysses.hf.check.logits import HEAD_PROBE_TOKENS
from lightning_ulysses.hf.check.tensors import gradient_probe, random_hidden_states
from lightning_ulysses.hf.ledger import Ledger
from lightning_ulysses.hf.state import outermost_models
from lightning_ulysses.logits import LogitMap
from lightning_ulysses.memory.feed_forward import candidate_modules
from lightning_ulysses.memory.report import OptionReport, summarize
from lightning_ulysses.norms import norm_eps, norm_form

LIGER_KERNELS = ("cross_entropy", "rms_norm", "swiglu")
LIGER_ATTRIBUTE = "_ulysses_liger"
"""Where a transformers model holds the :class:`~lightning_ulysses.hf.ledger.Ledger` of its Liger replacements."""
_RMS_NORM_CASTING = {"weight": (0.0, "llama"), "one_plus_weight": (1.0, "gemma")}
"""Our RMSNorm forms (:data:`~lightning_ulysses.norms.NormForm`) that Liger computes: its ``(offset, casting_mode)``."""


def check_liger_kernels(setting: bool | Sequence[str]) -> tuple[str, ...]:
    """The kernels asked (``True``: all of :data:`LIGER_KERNELS`; ``False``: none); refuses unknown names and, when
    any is asked, a missing ``liger_kernel`` or ``triton``."""
    kernels = LIGER_KERNELS if setting is True else () if setting is False else tuple(setting)
    unknown = [k for k in kernels if k not in LIGER_KERNELS]
    if unknown or isinstance(setting, str):
        raise ValueError(
            f"liger_kernels takes True, False or a list of {', '.join(map(repr, LIGER_KERNELS))}; got {setting!r}."
        )
    missing = [m for m in ("liger_kernel", "triton") if kernels and importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"liger_kernels={setting!r} needs the {' and '.join(map(repr, missing))} package(s), which are not "
            "installed (pip install 'lightning-ulysses[liger]' on a CUDA machine), or set liger_kernels=False."
        )
    return kernels


def refuse_liger_setup(
    kernels: tuple[str, ...], device_type: str, parameters_sharded: bool, tiled_loss: object
) -> None:
    """Refuse, before any step, asked kernels that cannot run here: off CUDA, the fused loss where the engine shards
    parameters (ZeRO-3, FSDP2) or without ``tiled_loss``."""
    if not kernels:
        return
    if device_type != "cuda":
        raise ValueError(
            f"liger_kernels={list(kernels)} runs Triton kernels on CUDA GPUs, and this run is on {device_type}: set "
            "liger_kernels=False."
        )
    if "cross_entropy" in kernels and parameters_sharded:
        raise ValueError(
            "liger_kernels 'cross_entropy' takes lm_head's weight whole, which ZeRO-3 (and FSDP2) partitions: use "
            "UlyssesStrategy with stage 1 or 2, or leave 'cross_entropy' out (the tiled loss then computes the loss in "
            "tiles)."
        )
    if "cross_entropy" in kernels and not tiled_loss:
        raise ValueError(
            "liger_kernels 'cross_entropy' is the fused form of tiled_loss: set tiled_loss=True, or leave "
            "'cross_entropy' out."
        )


def liger_loss_sum(lm_head: nn.Module, logit_map: LogitMap) -> Callable[[Tensor, Tensor, int], Tensor]:
    """``(hidden_states [tokens, hidden], labels [tokens], ignore_index) -> `` the fp32 sum of the token cross
    entropies of the model's logits ``logit_map.head(lm_head)(hidden_states)``, by Liger's fused linear cross entropy.
    ``lm_head`` must be an ``nn.Linear`` (its weight and bias are read at each call)."""
    if not isinstance(lm_head, nn.Linear):
        raise ValueError(
            f"liger_kernels 'cross_entropy' computes lm_head as a linear layer, and this model's is a "
            f"{type(lm_head).__name__}: leave 'cross_entropy' out."
        )
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    factor = logit_map.input_scale * logit_map.scale

    def loss_sum(hidden_states: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
        bias = lm_head.bias if lm_head.bias is None or logit_map.scale == 1 else lm_head.bias * logit_map.scale
        loss = liger_fused_linear_cross_entropy(
            hidden_states if factor == 1 else hidden_states * factor,
            lm_head.weight,
            labels,
            bias,
            ignore_index=ignore_index,
            reduction="sum",
            softcap=logit_map.cap,
        )
        return loss.float()

    return loss_sum


def apply_liger_kernels(model: nn.Module, kernels: tuple[str, ...]) -> list[OptionReport]:
    """Replace the RMSNorms and SwiGLU feed-forwards found in every transformers model inside ``model`` (as asked in
    ``kernels``) by Liger's, and report them; raises where an asked kernel finds nothing, and before any change where
    ``"cross_entropy"`` would not compute a model's ``lm_head`` exactly (:func:`liger_head_problem`).
    ``"cross_entropy"`` is the loss's (:func:`liger_loss_sum`), reported here. :func:`remove_liger_kernels` undoes the
    rest."""
    remove_liger_kernels(model)
    for hf_model in outermost_models(model) if "cross_entropy" in kernels else []:
        problem = liger_head_problem(hf_model.get_output_embeddings())
        if problem is not None:
            raise ValueError(
                f"liger_kernels 'cross_entropy' computes {type(hf_model).__name__}'s lm_head as F.linear of its weight "
                f"and bias, without calling it, and its lm_head {problem}: the loss or the gradients would not be the "
                "model's. Leave 'cross_entropy' out (the tiled loss calls lm_head as it is)."
            )
    norms: list[tuple[str, nn.Module]] = []
    mlps: list[tuple[str, nn.Module]] = []
    for hf_model in outermost_models(model):
        ledger = Ledger()
        if "rms_norm" in kernels:
            norms += _replace_rms_norms(hf_model, ledger)
        if "swiglu" in kernels:
            mlps += _replace_swiglus(hf_model, ledger)
        ledger.set("liger", hf_model, LIGER_ATTRIBUTE, ledger)
    rows = []
    for kernel, found, what in (("rms_norm", norms, "RMSNorm"), ("swiglu", mlps, "SwiGLU feed-forward")):
        if kernel not in kernels:
            continue
        if not found:
            raise ValueError(
                f"liger_kernels {kernel!r} found no {what} that Liger's kernel computes in this model: leave "
                f"{kernel!r} out."
            )
        rows.append(OptionReport(f"liger_kernels {kernel!r}", f"{summarize(found)}: Liger's Triton kernel"))
    if "cross_entropy" in kernels:
        rows.append(OptionReport("liger_kernels 'cross_entropy'", "tiled_loss: Liger's fused linear cross entropy"))
    return rows


def liger_head_problem(lm_head: nn.Module | None) -> str | None:
    """What Liger's fused linear cross entropy, which computes ``F.linear(h, lm_head.weight, lm_head.bias)`` itself,
    would leave out of ``lm_head``'s own call (``None``: nothing). ``lm_head`` is called as a module (its hooks run) on
    :data:`~lightning_ulysses.hf.check.logits.HEAD_PROBE_TOKENS` random hidden states that need a gradient: its output
    must equal that linear layer's bit for bit, and its graph may reach no tensor needing a gradient that the weight and
    bias are not computed from (a parametrized weight is read as it is computed). Only for weights whole on the rank
    (Liger's loss is refused under ZeRO-3); the random generators' states are restored and no gradient is made."""
    weight = getattr(lm_head, "weight", None)
    if lm_head is None or not isinstance(lm_head, nn.Linear) or not isinstance(weight, Tensor):
        return f"is a {type(lm_head).__name__}, not a linear layer"
    hidden = random_hidden_states(HEAD_PROBE_TOKENS, weight.shape[-1], weight.dtype, weight.device)
    with gradient_probe(weight.device):
        hidden.requires_grad_()
        linear = F.linear(hidden, lm_head.weight, lm_head.bias)
        output = lm_head(hidden)
        if not isinstance(output, Tensor) or output.shape != linear.shape or not torch.equal(output, linear):
            return "computes other than a linear layer of its weight and bias (a forward of its own, or a hook)"
        extra = unlisted_leaves(output, unlisted_leaves(linear, []))
    if extra:
        shapes = ", ".join(str(tuple(t.shape)) for t in extra)
        return f"reads tensors that need a gradient besides its weight and bias, shaped {shapes} (an adapter?)"
    return None


def remove_liger_kernels(model: nn.Module) -> None:
    """Undo :func:`apply_liger_kernels` on every module inside ``model``."""
    for sub in model.modules():
        ledger = sub.__dict__.get(LIGER_ATTRIBUTE)
        if ledger is not None:
            ledger.undo()


def _replace_rms_norms(model: nn.Module, ledger: Ledger) -> list[tuple[str, nn.Module]]:
    replaced = []
    for name, module in model.named_modules():
        form = norm_form(module)
        if form in _RMS_NORM_CASTING:
            eps = norm_eps(module)
            assert eps is not None  # norm_form found it
            ledger.set(
                name, module, "forward", functools.partial(_liger_rms_norm, module, eps, *_RMS_NORM_CASTING[form])
            )
            replaced.append((name, module))
    return replaced


def _liger_rms_norm(norm: nn.Module, eps: float, offset: float, casting_mode: str, x: Tensor) -> Tensor:
    from liger_kernel.transformers.functional import liger_rms_norm

    return liger_rms_norm(x, norm.weight, eps, offset=offset, casting_mode=casting_mode, in_place=False)


def _replace_swiglus(model: nn.Module, ledger: Ledger) -> list[tuple[str, nn.Module]]:
    replaced = []
    for module, name in candidate_modules(model).items():
        order = swiglu_projections(module)
        if order is not None:
            ledger.set(name, module, "forward", functools.partial(_liger_swiglu, module, *order))
            replaced.append((name, module))
    return replaced


def swiglu_projections(module: nn.Module) -> tuple[str, str, str] | None:
    """The names ``(gate, up, down)`` of ``module``'s three bias-free ``nn.Linear`` children for which its own
    forward, run on a stand-in with probe weights (nothing of the real module read: ZeRO-3 may partition it), gives
    ``down(silu(gate(x)) * up(x))`` bit for bit in float32; None where no order does."""
    children = dict(module.named_children())
    if len(children) not in (3, 4) or "forward" in module.__dict__:
        return None
    linears = [(n, m) for n, m in children.items() if isinstance(m, nn.Linear)]
    if len(linears) != 3 or any(m.bias is not None for _, m in linears):
        return None
    shapes = {n: _full_shape(m.weight) for n, m in linears}  # [out, in]
    generator = torch.Generator().manual_seed(0)
    probes = {n: nn.Linear(s[1], s[0], bias=False) for n, s in shapes.items()}
    for probe in probes.values():
        probe.weight.data = torch.randn(probe.weight.shape, generator=generator) * probe.weight.shape[1] ** -0.5
    stand_in = copy.copy(module)
    stand_in.__dict__.update(
        _modules=OrderedDict({**children, **probes}), _forward_hooks=OrderedDict(), _forward_pre_hooks=OrderedDict()
    )
    for down, (hidden, inner) in shapes.items():
        gate_up = [n for n in probes if n != down]
        if any(shapes[n] != (inner, hidden) for n in gate_up):
            continue
        x = torch.randn(2, 3, hidden, generator=generator)
        with torch.no_grad():
            try:
                expected = type(module).forward(stand_in, x)
            except Exception:  # noqa: BLE001 - a forward that cannot run on a plain tensor is no feed-forward we know
                return None
            for gate, up in (gate_up, gate_up[::-1]):
                got = probes[down](F.silu(probes[gate](x)) * probes[up](x))
                if isinstance(expected, Tensor) and expected.shape == got.shape and torch.equal(got, expected):
                    return gate, up, down
    return None


def _full_shape(weight: Tensor) -> tuple[int, ...]:
    """``weight``'s shape, the full one where ZeRO-3 partitioned it (kept as ``ds_shape``)."""
    return tuple(getattr(weight, "ds_shape", weight.shape))


def _liger_swiglu(module: nn.Module, gate: str, up: str, down: str, x: Tensor, *args: Any, **kwargs: Any) -> Any:
    """``module``'s forward as ``down(SiLUMul(gate(x), up(x)))`` (the projections called as modules: ZeRO's hooks run);
    called with more than its input, the module's own forward."""
    if args or kwargs:
        return type(module).forward(module, x, *args, **kwargs)
    from liger_kernel.transformers.functional import liger_swiglu

    return getattr(module, down)(liger_swiglu(getattr(module, gate)(x), getattr(module, up)(x)))
