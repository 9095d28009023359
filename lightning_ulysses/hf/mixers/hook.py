"""Install the sharded kernels in the token mixers of a transformers model, with no model code change.

A token mixer is recognised by what its ``forward`` calls: a module whose forward looks up one of the sequential
kernels of :data:`~lightning_ulysses.hf.mixers.kernels.KERNELS` in its modeling module. While such a module runs
under sequence parallelism, the kernel names in its modeling module point at their sharded forms, and back
afterwards; everything else in its forward (projections, gates, norms) runs unchanged on this rank's tokens. A layer
built like lightning attention, which has no kernel function, runs :mod:`.lightning`'s head-sharded forward, and an
mLSTM backend (xLSTM), which holds its kernels rather than calling them by name, :mod:`.mlstm`'s; Griffin's
recurrent block :mod:`.rglru`'s; a token shift by constant padding (RWKV's ``time_shift``) takes its halo from the
previous rank (:mod:`.shift`); ZAYA's CCA projection runs its convolutions head-sharded and its delayed values
shifted (:mod:`.cca`). The
set-up check then compares the model with the plain one on the whole sequence: a mixer the kernels do not make
exact (a mixing step of its own outside them) is found and refused, or gathered with ``sequence_mixers="gather"``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_ulysses.attention import Documents, documents_of
from lightning_ulysses.hf.mixers.cca import is_cca_projection, sharded_cca_forward
from lightning_ulysses.hf.mixers.kernels import FUSED_LAYER_KERNELS, KERNELS, sharded_kernel
from lightning_ulysses.hf.mixers.lightning import is_lightning_attention, sharded_lightning_forward
from lightning_ulysses.hf.mixers.mlstm import is_mlstm_backend, sharded_mlstm_forward
from lightning_ulysses.hf.mixers.rglru import is_recurrent_block, sharded_recurrent_forward
from lightning_ulysses.hf.mixers.shift import sequence_shift_of, sharded_shift_forward

if TYPE_CHECKING:
    from lightning_ulysses.hf.patching import PatchState


LAYER_FORMS: tuple[tuple[Callable[[nn.Module], bool], Callable[..., Callable[..., Any]]], ...] = (
    (is_lightning_attention, sharded_lightning_forward),
    (is_mlstm_backend, sharded_mlstm_forward),
    (is_recurrent_block, sharded_recurrent_forward),
    (is_cca_projection, sharded_cca_forward),
)
"""Layers that compute their sequential part inline (no kernel function to swap), each recognised by its structure,
and the head-sharded forward that replaces theirs: ``build(module, group, documents)``."""


def kernels_called(module: nn.Module) -> dict[str, Any]:
    """The sequential kernels (name -> function) that ``module``'s forward calls from its modeling module, the fused
    whole-layer kernels among them (:data:`~lightning_ulysses.hf.mixers.kernels.FUSED_LAYER_KERNELS`) when it calls
    separate ones too."""
    forward = inspect.unwrap(type(module).forward)
    code, namespace = getattr(forward, "__code__", None), getattr(forward, "__globals__", {})
    if code is None:
        return {}
    called = {name: namespace[name] for name in code.co_names if callable(namespace.get(name))}
    if not any(name in KERNELS for name in called):
        return {}
    return {name: kernel for name, kernel in called.items() if name in KERNELS or name in FUSED_LAYER_KERNELS}


def shard_token_mixers(model: nn.Module, state: PatchState) -> list[str]:
    """Run the sequential kernels of every token mixer inside ``model`` on this rank's heads over the whole sequence
    (see the module docstring), and lightning attention and Griffin's recurrent block (:mod:`.lightning`,
    :mod:`.rglru`, computed inline by their layers), mLSTM backends (:mod:`.mlstm`) and ZAYA's CCA projection
    (:mod:`.cca`) likewise; token shifts take their halo (:mod:`.shift`); the names of the modules changed.
    Idempotent."""
    names = []
    for name, module in model.named_modules():
        if "_ulysses_mixer_forward" in module.__dict__:
            continue
        kernels = kernels_called(module)
        if kernels:
            module.forward = _sharded_forward(module, kernels, state)
        elif (form := next((build for recognise, build in LAYER_FORMS if recognise(module)), None)) is not None:
            module.forward = _while_sharded(module, state, form(module, lambda: state.group, _documents(state)))
        elif sequence_shift_of(module) is not None:
            module.forward = _while_sharded(module, state, sharded_shift_forward(
                module, lambda: state.group, _documents(state), lambda: _local_tokens(state)
            ))
        else:
            continue
        module._ulysses_mixer_forward = True
        names.append(name)
    return names


def register_mixer_weights_for_zero3(model: nn.Module) -> None:
    """Tell ZeRO-3 that every token mixer inside ``model`` uses its children's weights: their forwards read them
    (``self.conv1d.weight``; the sharded recurrent block reads its ``conv_1d``'s and ``rg_lru``'s) without calling
    the children, and ZeRO-3 gathers a weight only around its owner's call otherwise (the plain model fails the same
    way). Registered as the mixer's external parameters, they are gathered for its forward and its backward."""
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    for module in model.modules():
        if kernels_called(module) or is_recurrent_block(module) or is_cca_projection(module):
            for child in module.children():
                for parameter in child.parameters():
                    register_external_parameter(module, parameter)


def remove_sharded_mixers(model: nn.Module) -> None:
    """Undo :func:`shard_token_mixers` on ``model`` and every module inside it."""
    for module in model.modules():
        if module.__dict__.pop("_ulysses_mixer_forward", None):
            del module.forward


def _documents(state: PatchState) -> Callable[[], Documents | None]:
    """The documents of the whole rows of the current batch, at call time."""
    return lambda: None if state.position_ids is None else documents_of(state.position_ids, state.group)


def _local_tokens(state: PatchState) -> int | None:
    """This rank's tokens per row in the current batch."""
    return None if state.position_ids is None else state.position_ids.shape[-1]


def _sharded_forward(module: nn.Module, kernels: dict[str, Any], state: PatchState) -> Any:
    """The module's own forward, with its kernels pointing at their sharded forms while it runs."""
    forward = module.forward
    namespace = inspect.unwrap(type(module).forward).__globals__
    sharded = {
        name: sharded_kernel(name, kernel, lambda: state.group, _documents(state)) for name, kernel in kernels.items()
    }

    def with_sharded_kernels(*args: Any, **kwargs: Any) -> Any:
        with _pointing(namespace, sharded):
            return forward(*args, **kwargs)

    return _while_sharded(module, state, with_sharded_kernels)


def _while_sharded(module: nn.Module, state: PatchState, sharded: Callable[..., Any]) -> Any:
    """``sharded`` under sequence parallelism, the module's own forward otherwise (one rank, or unpatched)."""
    forward = module.forward

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not state.enabled or state.group is None or state.sp_size == 1:
            return forward(*args, **kwargs)
        return sharded(*args, **kwargs)

    return run


@contextmanager
def _pointing(namespace: dict[str, Any], functions: dict[str, Any]) -> Iterator[None]:
    """Within the block, ``namespace[name]`` is ``functions[name]``."""
    saved = {name: namespace[name] for name in functions}
    namespace.update(functions)
    try:
        yield
    finally:
        namespace.update(saved)
