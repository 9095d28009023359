"""A step of the set-up check: how a model makes its logits from its decoder's final hidden states (tiled loss).

``UlyssesStrategy(tiled_loss=...)`` never builds the ``[tokens, V]`` logits: it runs the decoder
(``model.get_decoder()``) and then ``lm_head`` (``model.get_output_embeddings()``) one token tile at a time
(:mod:`lightning_ulysses.logits`). Families scale or cap the logits outside ``lm_head``: Granite, GraniteMoe,
GraniteMoeShared and GraniteMoeHybrid divide them by ``logits_scaling``, Cohere, Falcon-H1 and HyperCLOVAX multiply
them by a constant, MiniCPM3 divides the hidden states before ``lm_head``, Gemma 3n and xLSTM soft-cap them. What the
model does is read by running it, not from its config's names:

1. **What ``lm_head`` receives.** In the whole-sequence run (:mod:`~lightning_ulysses.hf.check.whole`) ``lm_head`` and
   the decoder must each be called once, and ``lm_head``'s input must be a constant ``input_scale`` times the
   decoder's output (least squares, then verified to the tolerance of the model's dtype).
2. **What becomes of its output.** The plain model runs once more with ``lm_head``'s output replaced by values of
   every magnitude from ``1e-2`` to ``1e4``, of both signs, in random places (so that a soft-cap shows even where
   the probe's own logits are small). The logits must be ``scale * x`` or ``cap * tanh(scale * x / cap)`` of those
   values ``x``, each logit to the tolerance of the model's dtype (relative to itself: a per-token offset, or a map
   that mixes logits, shows on the smallest). ``scale`` is fitted by least squares (and taken as ``1``, or as one of
   the config's positive float values or its inverse, where it is within rounding of it: bf16 logits give Granite's
   ``1 / 3`` as ``0.33332``); a ``cap`` is one of those values or the largest logit seen (where the tanh
   saturates). Either is then verified like the rest. The tiles apply the maps of steps 1 and 2 as Python floats,
   which are the model's only while nothing in them trains: this run records autograd from the decoder's output to
   ``lm_head``'s input and from ``lm_head``'s output (the probe values, which need no gradient) to the logits, and
   nowhere else, and a tensor needing a gradient among the leaves of either graph (a learned temperature, soft-cap
   or bias on the logits, a trainable factor on the hidden states before ``lm_head``) is refused, named by its
   parameter: the tiles would leave its gradient out. A frozen one is a constant like the config's. The tiled loss
   calls the decoder by itself, so the same run also notes (autograd off) the tensors needing a gradient that torch
   functions receive between the model's call and its decoder's, and refuses any that is not a parameter of the
   decoder (a learned gain on the input embeddings it hands the decoder, 1 at first, so that step 3 sees the same
   hidden states): the decoder by itself would not compute with it.
3. **The decoder called by itself** (after step 6 of the check, on the final plan): on this rank's shard, as the
   tiled loss calls it (``model.get_decoder()(input_ids=..., position_ids=...)``), it must return this rank's shard of
   the final hidden states of the whole run, as ``last_hidden_state``. A module that runs on the whole sequence
   around the decoder (``sequence_mixers="gather"`` of the model or a module holding the decoder) is not run by the
   decoder's own call; a model may give its decoder other inputs than the token ids.
4. **The tensors ``lm_head`` reads** (at the strategy's set-up, fitting with ``lm_head``'s parameters whole on the
   rank, where the training loss runs each tile's backward inside its forward: :mod:`lightning_ulysses.fused_loss`):
   ``lm_head``, called as the loss tiles call it, must read no tensor needing a gradient besides its input and its
   own parameters (another module's weight not tied as the same ``Parameter``, a trainable scale kept outside it),
   whose gradient the fused loss would leave out (:func:`check_head_tensors`).

The verdict of steps 1-3 (a :class:`~lightning_ulysses.logits.LogitMap`, or why the logits cannot be tiled) is the
plan's ``logits``, the same on every rank of the SP group: the tiled loss applies the map to each tile
(:func:`tiled_logit_map`), and with ``tiled_loss`` on the strategy refuses a model without one at set-up
(:func:`check_tiled_logits`, which runs step 4 and refuses by it too, agreed over the SP group alike). Everything
is a Python float decided here: nothing in a training step syncs with the host for it. Under ZeRO-3 both forwards
gather ``lm_head``'s weight as training does (the hooks see its output inside the call), tied embeddings included.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from transformers import PreTrainedModel

from lightning_ulysses.fused_loss import unlisted_leaves
from lightning_ulysses.hf.apply import patch_of, unpatched
from lightning_ulysses.hf.check.shard import Shard, close, tolerance
from lightning_ulysses.hf.check.tensors import first_tensor, gradient_probe, random_hidden_states, tensors_of
from lightning_ulysses.hf.check.whole import WholeRun, probe_attention, token_local_probe
from lightning_ulysses.hf.plan import NOT_CHECKED
from lightning_ulysses.hf.state import PatchState, UnsupportedModelError, model_configs, outermost_models
from lightning_ulysses.logits import LogitMap, fused_loss_module

P = ParamSpec("P")
SPREAD = (1e-2, 1e4)
"""The magnitudes of the values that replace ``lm_head``'s output in step 2."""


def fit_output_map(x: Tensor, y: Tensor, constants: Iterable[float] = ()) -> LogitMap | str:
    """``y`` (the logits) as ``scale * x`` or ``cap * tanh(scale * x / cap)`` of ``x`` (``lm_head``'s output), every
    element to :func:`~lightning_ulysses.hf.check.shard.tolerance` of ``y``'s dtype relative to itself, or what was
    seen instead. ``constants`` (the config's): candidate caps besides the largest ``|y|``, and values (or inverses)
    that a fitted factor is taken as where it is within rounding of one; ``x`` must have no zero."""
    if x.shape != y.shape:
        return f"its logits, shaped {tuple(y.shape)}, are not an element-wise map of lm_head's output {tuple(x.shape)}"
    tol, constants = tolerance(y.dtype), list(constants)
    x, y = x.double().flatten(), y.double().flatten()
    if not torch.isfinite(y).all():
        return "its logits are not finite where lm_head's output is"
    scale = _factor(x, y, constants, tol)
    if _matches(scale * x, y, tol):
        return LogitMap(scale=scale)
    largest = y.abs().max().item()
    for cap in dict.fromkeys([*constants, largest]):  # in order, each once
        inner = y.abs() <= cap / 2  # where atanh is well conditioned
        if largest > cap * (1 + tol) or not inner.any():
            continue
        cap_scale = _factor(x[inner], cap * torch.atanh(y[inner] / cap), constants, tol)
        if _matches(cap * torch.tanh(cap_scale * x / cap), y, tol):
            return LogitMap(scale=cap_scale, cap=cap)
    error = ((scale * x - y).abs() / (scale * x).abs()).max().item()
    return (
        f"maps lm_head's output to its logits other than element-wise by a constant factor or a tanh soft-cap: with "
        f"that output replaced by values of magnitude {SPREAD[0]:g} to {SPREAD[1]:g}, the closest factor "
        f"({scale:.4g}) is off by up to {error:.2g} of a logit, and no soft-cap (largest logit {largest:.4g}) fits"
    )


def spread_values(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Values of magnitudes log-uniform in :data:`SPREAD`, of both signs, in random (seeded) places."""
    generator = torch.Generator().manual_seed(0)
    low, high = (math.log10(bound) for bound in SPREAD)
    magnitudes = 10 ** (low + (high - low) * torch.rand(shape, generator=generator, dtype=torch.float64))
    signs = torch.randint(0, 2, shape, generator=generator) * 2 - 1
    return (magnitudes * signs).to(device=device, dtype=dtype)


def tiled_logit_map(model: PreTrainedModel) -> LogitMap:
    """The :class:`~lightning_ulysses.logits.LogitMap` that the tiled loss applies to ``model``'s ``lm_head`` per tile,
    as the set-up check found it (raises where there is none)."""
    patch = patch_of(model)
    if patch is None:
        raise RuntimeError(
            f"tiled_loss computes the logits of {type(model).__name__} as the set-up check found that the model makes "
            "them, and UlyssesStrategy checks the outermost transformers models of the LightningModule at set-up: "
            "pass such a model."
        )
    return _found_map(model, patch.plan.logits)


def check_tiled_logits(module: nn.Module, *, fused_training: bool = False) -> str | None:
    """Refuse, at set-up, the ``tiled_loss`` of any patched transformers model inside ``module`` whose logits cannot be
    computed in tiles, and with ``fused_training`` (the strategy fits, ``lm_head``'s parameters whole on the rank: the
    training loss runs fused) one whose ``lm_head`` reads a tensor needing a gradient besides its own parameters
    (:func:`check_head_tensors`; collective over the SP group). Returns what the tiles apply besides ``lm_head``
    (e.g. ``"GraniteForCausalLM: 0.25 * lm_head(h)"``, for the set-up report), or ``None`` where every model's logits
    are plain ``lm_head(h)``."""
    maps = []
    for model in outermost_models(module):
        patch = patch_of(model)
        if patch is None:
            continue
        found = _found_map(model, patch.plan.logits)
        if fused_training:
            checked = check_head_tensors(model, patch.state, found, module)
            if isinstance(checked, str):
                raise UnsupportedModelError(checked)
        if found != LogitMap():
            maps.append(f"{type(model).__name__}: {found}")
    return "; ".join(maps) or None


def _found_map(model: PreTrainedModel, found: LogitMap | str) -> LogitMap:
    if found == NOT_CHECKED:
        raise RuntimeError(
            f"{type(model).__name__} was patched with tiled_loss off, so the set-up check did not read how it makes "
            "its logits, which the tiled loss must apply: turn tiled_loss on (UlyssesStrategy(tiled_loss=...), "
            "apply_ulysses_attention(..., tiled_loss=True))."
        )
    if isinstance(found, str):
        raise UnsupportedModelError(_refusal(model, found))
    return found


def _refusal(model: PreTrainedModel, problem: str) -> str:
    return (
        f"{type(model).__name__} cannot compute its logits in token tiles: {problem}. tiled_loss computes them as a "
        "constant factor or a tanh soft-cap of lm_head(decoder's final hidden states), which would not be this model's "
        "logits or their gradients. Set tiled_loss=False (the logits are then the model's own)."
    )


def _agreed_over_sp(step: Callable[P, LogitMap | str]) -> Callable[P, LogitMap | str]:
    """``step``, its verdict agreed over the SP group of its ``state`` argument: the first problem any SP rank found,
    else SP rank 0's map (ranks differ at most by rounding). Collective: call it on every rank."""
    signature = inspect.signature(step)

    @functools.wraps(step)
    def agreed(*args: P.args, **kwargs: P.kwargs) -> LogitMap | str:
        found = step(*args, **kwargs)
        state: PatchState = signature.bind(*args, **kwargs).arguments["state"]
        group = state.group.sp
        if group is None or state.sp_size == 1:
            return found
        gathered: list[LogitMap | str | None] = [None] * state.sp_size
        dist.all_gather_object(gathered, found, group=group)
        return next((f for f in gathered if isinstance(f, str)), gathered[0] or found)

    return agreed


@_agreed_over_sp
def find_logit_map(
    model: PreTrainedModel, state: PatchState, whole: WholeRun, input_ids: Tensor, position_ids: Tensor
) -> LogitMap | str:
    """Steps 1 and 2 of the module docstring: the map from ``model``'s decoder's final hidden states to its logits, or
    why there is none that applies per tile; agreed over the SP group (collective: call it on every rank)."""
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        return "it has no output embeddings (get_output_embeddings() returns None)"
    decoder = model.get_decoder()
    if decoder is model:
        return "its decoder (get_decoder()) is the model itself"
    names = {module: name for name, module in model.named_modules()}
    head_calls, decoder_calls = (whole.calls.get(names.get(m, "?"), []) for m in (lm_head, decoder))
    if len(head_calls) != 1 or len(decoder_calls) != 1:
        return (
            f"its forward calls its output embeddings ({names.get(lm_head, '?')}) {len(head_calls)} times and its "
            f"decoder ({names.get(decoder, '?')}) {len(decoder_calls)} times, not once each"
        )
    received, hidden = next(iter(head_calls[0].inputs.values())), decoder_calls[0].outputs[0]
    constants = [
        value
        for config in model_configs(model)
        for value in config.to_dict().values()
        if isinstance(value, float) and math.isfinite(value) and value > 0
    ]
    input_scale = math.nan
    if received.shape == hidden.shape:
        input_scale = _factor(hidden.double(), received.double(), constants, tolerance(hidden.dtype))
    if not close(received, (hidden.double() * input_scale).to(hidden.dtype)):
        return "its output embeddings receive other than a constant times its decoder's final hidden states"
    found = _output_map(model, decoder, lm_head, head_calls[0].outputs[0], input_ids, position_ids, constants)
    return found if isinstance(found, str) else LogitMap(input_scale, found.scale, found.cap)


@_agreed_over_sp
def check_decoder_call(
    model: PreTrainedModel,
    state: PatchState,
    whole: WholeRun,
    shard: Shard,
    input_ids: Tensor,
    position_ids: Tensor,
    found: LogitMap,
    gathered: tuple[str, ...],
) -> LogitMap | str:
    """Step 3 of the module docstring on the model's final plan (``gathered``: the modules it runs on the whole
    sequence): ``found``, or why the tiled loss's call of the decoder would not give the decoder's final hidden
    states; agreed over the SP group (collective: call it on every rank)."""
    decoder = model.get_decoder()
    name = next(n for n, m in model.named_modules() if m is decoder)
    expected = whole.calls[name][0].outputs[0]  # step 1 found the decoder called once, its hidden states first

    try:
        with probe_attention(state, token_local_probe):
            output = decoder(input_ids=shard.of(input_ids), position_ids=shard.of(position_ids))
    except Exception as error:  # noqa: BLE001 - the reason to refuse tiled_loss, with its text
        return (
            f"its decoder ({name}) fails when called by itself on this rank's shard as the tiled loss calls it "
            f"({error})"
        )
    hidden = getattr(output, "last_hidden_state", None)
    if isinstance(hidden, Tensor) and shard.agree(expected, hidden):
        return found
    around = [g or "the model" for g in gathered if g == "" or name.startswith(g + ".")]
    why = f" (it runs inside {around[0]}, which sequence_mixers='gather' runs on the whole sequence)" if around else ""
    return (
        f"its decoder ({name}), called by itself on this rank's shard as the tiled loss calls it, does not return "
        f"the final hidden states it computes inside the model as last_hidden_state{why}"
    )


HEAD_PROBE_TOKENS = 2
"""Tokens of the hidden states :func:`check_head_tensors` runs ``lm_head`` on."""


@_agreed_over_sp
def check_head_tensors(
    model: PreTrainedModel, state: PatchState, found: LogitMap, trained: nn.Module
) -> LogitMap | str:
    """``found``, or why the fused tiled loss would drop a gradient: ``model``'s ``lm_head``, called as each loss tile
    calls it (``found.head(lm_head)``) once on :data:`HEAD_PROBE_TOKENS` tokens of random hidden states that need a
    gradient, reads a tensor needing a gradient that is neither that input nor one of ``lm_head``'s parameters
    (:func:`~lightning_ulysses.fused_loss.unlisted_leaves`, the walk the loss's first tile makes). Its name is looked
    up among ``trained``'s parameters (the module the strategy trains). The graph is dropped: no gradient is made, and
    the random generators' states are restored. Nothing is run where the loss would not be fused (an engine shards
    ``lm_head``'s parameters, ZeRO-3). Agreed over the SP group (collective: call it on every rank)."""
    lm_head = model.get_output_embeddings()
    head = found.head(lm_head)
    module = fused_loss_module(head)
    if module is None:
        return found
    weight = getattr(module, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:  # [vocab, hidden], as the loss tiles read it
        features, dtype, device = weight.shape[-1], weight.dtype, weight.device
    else:
        features, dtype, device = model.config.get_text_config().hidden_size, model.dtype, model.device
    hidden = random_hidden_states(HEAD_PROBE_TOKENS, features, dtype, device)
    with gradient_probe(device):
        hidden.requires_grad_()
        unlisted = unlisted_leaves(head(hidden), [hidden, *module.parameters()])
    if not unlisted:
        return found
    head_name = next((name for name, m in model.named_modules() if m is lm_head), "?")
    tensors = _described(unlisted, trained)
    return (
        f"{type(model).__name__}'s lm_head ({head_name}) reads in its forward tensors that need a gradient and are "
        f"none of lm_head's parameters: {tensors}. With lm_head's parameters whole on the rank the tiled loss runs "
        "each tile's backward inside its forward with respect to lm_head's own parameters only, which would leave "
        "their gradients out. Make each such tensor a parameter of lm_head (or tie it as the same Parameter), or set "
        "tiled_loss=False (with ZeRO-3 or UlyssesFSDPStrategy the tiles are recomputed in the backward instead, which "
        "takes every gradient)."
    )


def _output_map(
    model: PreTrainedModel,
    decoder: nn.Module,
    lm_head: nn.Module,
    output: Tensor,
    input_ids: Tensor,
    position_ids: Tensor,
    constants: list[float],
) -> LogitMap | str:
    """Step 2 of the module docstring: the map from ``lm_head``'s output to the logits, refused where a tensor
    needing a gradient joins where the tiles apply a map of Python floats instead of the model's computation: between
    the decoder's output and ``lm_head``'s input (step 1's factor) or between ``lm_head``'s output and the logits
    (step 2's map), whose gradient the tiles would leave out. Autograd records in those two stretches only (switched
    on by hooks after the decoder's call and after ``lm_head``'s, off again before ``lm_head``'s), so the leaves of
    their graphs are what joins there: the decoder and ``lm_head`` run without it, no graph of theirs is kept, and
    ZeRO-3's hooks see no output needing a gradient where nothing joins. Refused as well: a tensor needing a gradient,
    other than the decoder's parameters, that a torch function receives from the model's call to its decoder's
    (:class:`_TrainableArguments`, autograd off), which the decoder called by itself would not compute with."""
    with torch.inference_mode(False):  # tensors autograd can record, even where the check runs in inference mode
        values = spread_values(output.shape, output.dtype, output.device)  # need no gradient: no leaf of lm_head's
    calls = []
    into_head: list[Tensor] = []
    before_decoder = _TrainableArguments()

    def enter_model(module: nn.Module, args: tuple) -> None:
        if not before_decoder.active and not before_decoder.done:
            before_decoder.__enter__()

    def enter_decoder(module: nn.Module, args: tuple) -> None:
        if before_decoder.active:
            before_decoder.__exit__(None, None, None)
            before_decoder.done = True

    def after_decoder(module: nn.Module, args: tuple, result: object) -> None:
        torch.set_grad_enabled(True)

    def before_head(module: nn.Module, args: tuple, kwargs: dict) -> None:
        into_head.extend(_trainable_leaves(tensors_of((args, kwargs))))
        torch.set_grad_enabled(False)

    def replace(module: nn.Module, args: tuple, result: Tensor) -> Tensor:
        calls.append(result.shape)
        torch.set_grad_enabled(True)
        return values if result.shape == values.shape else result

    handles = [
        model.register_forward_pre_hook(enter_model),
        decoder.register_forward_pre_hook(enter_decoder),
        decoder.register_forward_hook(after_decoder),
        lm_head.register_forward_pre_hook(before_head, with_kwargs=True),
        lm_head.register_forward_hook(replace),
    ]
    try:
        with unpatched(model), torch.inference_mode(False), torch.no_grad():
            logits = first_tensor(model(input_ids=input_ids, position_ids=position_ids, use_cache=False))
    except Exception as error:  # noqa: BLE001 - the reason to refuse tiled_loss, with its text
        return f"its forward fails with lm_head's output replaced ({error})"
    finally:
        for handle in handles:
            handle.remove()
        if before_decoder.active:  # the forward failed before its decoder's call
            before_decoder.__exit__(None, None, None)
    if calls != [values.shape] or logits is None:
        return f"its plain forward calls its output embeddings {len(calls)} times, not once on the whole sequence"
    found = fit_output_map(values, logits.detach(), constants)
    decoder_parameters = {id(p) for p in decoder.parameters()}
    constants_applied = "which the tiles would apply as constants of their present values"
    for stretch, joined, how in (
        (
            "its input to its decoder's",
            [t for t in before_decoder.read.values() if id(t) not in decoder_parameters],
            "which the tiled loss, calling its decoder by itself, would not compute with",
        ),
        ("its decoder's final hidden states to lm_head's input", into_head, constants_applied),
        ("lm_head's output to its logits", _trainable_leaves([logits]), constants_applied),
    ):
        if joined and isinstance(found, LogitMap):
            return (
                f"on the way from {stretch} it computes with tensors that need a gradient: {_described(joined, model)}"
                f", {how}, leaving their gradients out"
            )
    return found


class _TrainableArguments(TorchFunctionMode):
    """The tensors needing a gradient that torch functions receive as arguments while the mode is on (with autograd
    off: the model's parameters and any other leaf needing a gradient, a view of one as the tensor it views), each
    once; entered and left by hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.read: dict[int, Tensor] = {}
        self.active = self.done = False

    def __enter__(self) -> _TrainableArguments:
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.active = False
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        read = (t if t._base is None else t._base for t in tensors_of((args, kwargs)) if t.requires_grad)
        self.read.update((id(t), t) for t in read)
        return func(*args, **kwargs)  # the mode is off inside its own handler: no recursion


def _trainable_leaves(tensors: Iterable[Tensor]) -> list[Tensor]:
    """The tensors needing a gradient that ``tensors`` are computed from as autograd recorded it (the leaves of their
    graphs, a leaf that needs a gradient itself), each once."""
    leaves = {}
    for tensor in tensors:
        for leaf in [tensor] if tensor.is_leaf else unlisted_leaves(tensor, []):
            if leaf.requires_grad:
                leaves[id(leaf)] = leaf
    return list(leaves.values())


def _described(tensors: Iterable[Tensor], owner: nn.Module) -> str:
    """``tensors`` by their names among ``owner``'s parameters (by identity) and their shapes (a ZeRO-3 parameter's
    whole shape, partitioned or not): ``"model.norm.weight (32,)"``."""
    names = {id(p): name for name, p in owner.named_parameters(remove_duplicate=False)}
    return ", ".join(
        f"{names.get(id(t), f'one that is no parameter of {type(owner).__name__}')} "
        f"{tuple(getattr(t, 'ds_shape', t.shape))}"
        for t in tensors
    )


def _factor(x: Tensor, y: Tensor, constants: list[float], tol: float) -> float:
    """The least-squares ``c`` of ``y = c * x`` (float64 tensors), or the nearest of ``1``, ``constants`` and their
    inverses where that is within ``tol / 10`` of it (rounding in the model's dtype: Granite's ``1 / 3`` for the
    ``0.33332`` fitted to bf16 logits)."""
    scale = ((x * y).sum() / (x * x).sum().clamp(min=1e-300)).item()
    nearest = min([1.0, *constants, *(1 / c for c in constants)], key=lambda c: abs(c - scale))
    return nearest if abs(nearest - scale) <= tol / 10 * abs(scale) else scale


def _matches(expected: Tensor, got: Tensor, tol: float) -> bool:
    """Every element of ``got`` within ``tol`` of the same element of ``expected``, relative to that element."""
    return bool(((got - expected).abs() <= tol * expected.abs()).all() and expected.abs().min() > 0)
