"""Long-context memory: tiled MLP, tiled logits + loss, activation checkpointing with CPU offload, fused norms.

Past a few hundred thousand tokens per rank, attention (O(N) with flash kernels) is no longer what
fills memory; other things are, and each has a remedy here (ALST's, made exact and ZeRO-safe):

* **MLP intermediates** ``[tokens, intermediate]``: :func:`tiled_map` runs a token-wise function over
  tiles of the tokens and recomputes each tile in the backward, so only one tile's intermediates live.
* **Logits** ``[tokens, vocab]`` (1M x 128k x 4 B = 512 GB in fp32): :mod:`lightning_ulysses.logits`
  computes ``lm_head`` + cross entropy (or evaluation's per-token values) one tile at a time; the loss is
  a *sum*, which :class:`~lightning_ulysses.UlyssesLossMixin` turns into the exact token mean of the SP group.
* **Stored activations**: :func:`checkpoint_activations` keeps only each decoder layer's inputs and
  recomputes the rest in the backward; with ``offload=True`` those inputs wait in pinned CPU memory, copied
  on a side stream (:mod:`lightning_ulysses.offload`).
* **Norm intermediates**: ``fused_norms`` runs every RMSNorm as :func:`~lightning_ulysses.norms.rms_norm` (the same
  output, only its input kept for the backward) where its forward is found to compute exactly that.

Every tile is a :func:`torch.utils.checkpoint.checkpoint` region inside one autograd graph, not a
backward-inside-forward as in DeepSpeed's ``TiledMLP`` / ``TiledFusedLogitsLoss``. So each parameter's
gradient is accumulated once per backward, as ZeRO's hooks expect, under any ZeRO stage and without
``ds_grad_is_ready``; and the loss gradient is scaled by whatever multiplies the loss afterwards
(DeepSpeed's fused loss computes ``lm_head``'s gradient in the forward, blind to later scaling, and its
``"mean"`` averages tile means instead of tokens). The price is one extra forward of each tile.

Tile counts must agree across ranks: under ZeRO-3 every call of a tiled module gathers its parameters
(a collective). An ``int`` is used as is, with empty tiles where a rank has fewer tokens
(``Tensor.tensor_split`` always makes exactly that many); ``True`` picks ``ceil(tokens / hidden_size)``
(a tile's transient tensors are then about the size of one weight matrix), maximised over all ranks: in a patched
model the token count is agreed once per batch by its forward (``PatchState.batch_tokens``), so a tiled MLP call
and its recomputation run no collective and no host sync.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from lightning_ulysses.hf.ledger import Ledger
from lightning_ulysses.hf.state import PatchState, outermost_models
from lightning_ulysses.norms import NormForm, norm_eps, rms_norm, rms_norm_form
from lightning_ulysses.offload import ActivationOffload, default_offload

TileSetting = bool | int
"""``False``: no tiling; ``True``: tile count from the number of tokens; ``int``: that many tiles."""


@dataclass(frozen=True)
class MemoryOptions:
    """The long-context memory options of :class:`~lightning_ulysses.UlyssesStrategy` (validated here)."""

    tiled_mlp: TileSetting = False
    tiled_loss: TileSetting = False
    activation_checkpointing: bool = False
    offload_activations: bool = False
    fused_norms: bool = False

    def __post_init__(self) -> None:
        for name in ("tiled_mlp", "tiled_loss"):
            value = getattr(self, name)
            if not isinstance(value, (bool, int)) or (not isinstance(value, bool) and value < 1):
                raise ValueError(f"{name} must be True, False or a positive number of tiles, got {value!r}.")
        if self.offload_activations and not self.activation_checkpointing:
            raise ValueError(
                "offload_activations=True moves the inputs that activation checkpointing keeps to CPU memory; "
                "set activation_checkpointing=True as well."
            )


def agree_max_tokens(num_tokens: int, device: torch.device) -> int:
    """The largest ``num_tokens`` of all ranks (one ``all_reduce`` and one host sync when there are several)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        agreed = torch.tensor([num_tokens], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return int(agreed.item())
    return num_tokens


def resolve_num_tiles(
    setting: TileSetting, num_tokens: int, tile_tokens: int, device: torch.device, max_tokens: int | None = None
) -> int:
    """The number of tiles for ``num_tokens`` tokens: ``setting`` when an int, else
    ``ceil(max_tokens / tile_tokens)`` with ``max_tokens`` the most tokens of any rank (agreed here with one
    ``all_reduce`` unless given), so that every rank runs the same number of tiled calls."""
    if setting is False:
        return 1
    if setting is not True:
        return int(setting)
    if max_tokens is None:
        max_tokens = agree_max_tokens(num_tokens, device)
    return max(1, math.ceil(max_tokens / tile_tokens))


def tiled_map(fn: Callable[[Tensor], Tensor], x: Tensor, num_tiles: int) -> Tensor:
    """``fn(x)`` computed ``num_tiles`` token tiles at a time, each tile recomputed in the backward.

    Args:
        fn: a token-wise function (token ``t``'s output depends on token ``t`` alone, like an MLP):
            ``[tokens, dim_in] -> [tokens, dim_out]``.
        x: ``[..., tokens, dim_in]``, e.g. ``[batch, seq/sp, hidden]``; leading dims are flattened into tokens.
        num_tiles: exactly this many calls of ``fn`` (tiles may be empty), on every rank alike.

    Returns:
        ``[..., tokens, dim_out]``, equal to ``fn(x)``. Only one tile's intermediates are alive at a time,
        in the forward and in the backward.
    """
    tokens = x.reshape(-1, x.shape[-1])
    run = recomputed_in_backward(fn)
    out = torch.cat([run(tile) for tile in tokens.tensor_split(num_tiles)])
    return out.view(*x.shape[:-1], out.shape[-1])


def recomputed_in_backward(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` as one checkpoint region (its intermediates recomputed in the backward) when autograd records."""
    # one checkpoint region per tile: the backward reaches the tiles one after the other (autograd runs the most
    # recently created nodes first), so each tile's recomputed intermediates are freed before the next tile's
    return functools.partial(checkpoint, fn, use_reentrant=False) if torch.is_grad_enabled() else fn


def checkpoint_activations(
    function: Callable[..., Any], *args: Any, offload: bool | ActivationOffload = False, **kwargs: Any
) -> Any:
    """``function(*args, **kwargs)`` keeping only its tensor ``args`` for the backward, which recomputes the rest.

    With ``offload=True`` the kept ``args`` wait in pinned host memory, copied there on a side CUDA stream that
    overlaps the following compute (:mod:`lightning_ulysses.offload`; an :class:`ActivationOffload` instance
    chooses its own streams) and copied back for the recomputation; tensors already on the host stay where
    they are. ``kwargs`` are not offloaded: pass the large per-layer input (the hidden states) positionally.
    """
    if not offload:
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    with (default_offload() if offload is True else offload).hooks():
        return checkpoint(function, *args, use_reentrant=False, **kwargs)


MEMORY_ATTRIBUTE = "_ulysses_memory"
"""Where a transformers model holds the :class:`~lightning_ulysses.hf.ledger.Ledger` of its memory options."""


def apply_memory_options(model: nn.Module, options: MemoryOptions) -> None:
    """Apply ``options.tiled_mlp``, activation checkpointing and ``options.fused_norms`` to every transformers model
    inside ``model``.

    ``options.tiled_loss`` is read by :class:`~lightning_ulysses.UlyssesLossMixin` instead (the loss is
    the LightningModule's). Raises before any work when a requested option finds nothing to act on. Every change is
    recorded in one ledger per model, which :func:`remove_memory_options` undoes; applied again, the new options
    replace the old.
    """
    hf_models = outermost_models(model)
    if (options.tiled_mlp or options.activation_checkpointing or options.fused_norms) and not hf_models:
        raise ValueError(
            "tiled_mlp, activation_checkpointing and fused_norms act on transformers models, and this "
            "LightningModule holds none. For a custom model call lightning_ulysses.tiled_map on its MLP, "
            "lightning_ulysses.checkpoint_activations on its layers and lightning_ulysses.rms_norm in its norms."
        )
    for hf_model in hf_models:
        if options.activation_checkpointing and not hf_model.supports_gradient_checkpointing:
            raise ValueError(f"{type(hf_model).__name__} does not support activation checkpointing.")
        mlps = _dense_mlps(hf_model) if options.tiled_mlp else []
        _undo_memory_options(hf_model)
        norms = _rms_norms(hf_model) if options.fused_norms else {}
        ledger = Ledger()
        if options.tiled_mlp:
            _tile_mlps(hf_model, mlps, options.tiled_mlp, ledger)
        for norm, form in norms.items():
            eps = norm_eps(norm)
            assert eps is not None  # rms_norm_form found it
            ledger.set("fused_norms", norm, "forward", functools.partial(_fused_norm_forward, norm, eps, form))
        if options.activation_checkpointing:
            # the public gradient_checkpointing_enable takes no checkpoint function (and pins memory on CPU-only hosts)
            checkpointed = functools.partial(checkpoint_activations, offload=options.offload_activations)
            hf_model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpointed)
            off = functools.partial(hf_model._set_gradient_checkpointing, enable=False)
            ledger.record("activation_checkpointing", off)
        ledger.set("memory", hf_model, MEMORY_ATTRIBUTE, ledger)


def remove_memory_options(model: nn.Module) -> None:
    """Undo :func:`apply_memory_options` on every module inside ``model``."""
    for sub in model.modules():
        _undo_memory_options(sub)


def _undo_memory_options(module: nn.Module) -> None:
    ledger = module.__dict__.get(MEMORY_ATTRIBUTE)
    if ledger is not None:
        ledger.undo()


def _dense_mlps(model: PreTrainedModel) -> list[nn.Module]:
    """The ``mlp`` of every decoder layer: dense, token-wise MLPs only (their class names end in "MLP")."""
    mlps = [
        module
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] == "mlp" and type(module).__name__.endswith("MLP")
    ]
    if not mlps:
        raise ValueError(
            f"tiled_mlp found no dense MLP (a submodule named 'mlp' whose class name ends in 'MLP') in "
            f"{type(model).__name__}; mixture-of-experts blocks are not tiled. Set tiled_mlp=False, or tile your own "
            "MLP with lightning_ulysses.tiled_map."
        )
    return mlps


def _rms_norms(model: PreTrainedModel) -> dict[nn.Module, NormForm]:
    """Every RMSNorm of ``model`` that :func:`~lightning_ulysses.norms.rms_norm` reproduces, with its form."""
    forms = {module: rms_norm_form(module) for module in model.modules()}
    norms = {module: form for module, form in forms.items() if form is not None}
    if not norms:
        raise ValueError(
            f"fused_norms found no RMSNorm in {type(model).__name__} whose forward lightning_ulysses.rms_norm "
            "reproduces bit for bit (a module with one 1-D 'weight' and an 'eps' or 'variance_epsilon'). Set "
            "fused_norms=False."
        )
    return norms


def _fused_norm_forward(norm: nn.Module, eps: float, form: NormForm, x: Tensor) -> Tensor:
    """``norm``'s forward as :func:`~lightning_ulysses.norms.rms_norm`; its weight read at each call (ZeRO-3 gathers
    it for the call)."""
    weight = norm.weight
    assert isinstance(weight, Tensor)
    return rms_norm(x, weight, eps, form)


def _tile_mlps(model: PreTrainedModel, mlps: list[nn.Module], setting: TileSetting, ledger: Ledger) -> None:
    state: PatchState | None = model.__dict__.get("_ulysses_state")
    if setting is True and state is not None:  # the patched forward agrees the token count once per batch
        ledger.set("tiled_mlp", state, "agree_tokens", agree_max_tokens)
        ledger.record("tiled_mlp", lambda: setattr(state, "batch_tokens", None))
    for mlp in mlps:
        ledger.set("tiled_mlp", mlp, "forward", functools.partial(_tiled_mlp_forward, mlp.forward, setting, state))


def _tiled_mlp_forward(
    forward: Callable[[Tensor], Tensor], setting: TileSetting, state: PatchState | None, x: Tensor
) -> Tensor:
    """``state``: the :class:`~lightning_ulysses.hf.state.PatchState` of a patched model, whose ``batch_tokens``
    (agreed once per batch) spare this call, and its recomputation, the collective and the host sync."""
    tokens = x.shape[:-1].numel()
    batch = None if state is None else state.batch_tokens
    max_tokens = batch[1] if batch is not None and batch[0] == tokens else None
    num_tiles = resolve_num_tiles(setting, tokens, tile_tokens=x.shape[-1], device=x.device, max_tokens=max_tokens)
    return tiled_map(forward, x, num_tiles)
