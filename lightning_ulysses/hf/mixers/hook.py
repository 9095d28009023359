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
The check plans the mixers (:func:`is_token_mixer`); the applier (:mod:`lightning_ulysses.hf.apply`) installs each
one's :func:`sharded_mixer_forward`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from lightning_ulysses.attention import Documents, documents_of
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf.mixers.cca import is_cca_projection, sharded_cca_forward
from lightning_ulysses.hf.mixers.kernels import FUSED_LAYER_KERNELS, KERNELS, sharded_kernel
from lightning_ulysses.hf.mixers.lightning import is_lightning_attention, sharded_lightning_forward
from lightning_ulysses.hf.mixers.mlstm import is_mlstm_backend, sharded_mlstm_forward
from lightning_ulysses.hf.mixers.rglru import is_recurrent_block, sharded_recurrent_forward
from lightning_ulysses.hf.mixers.shift import sequence_shift_of, sharded_shift_forward
from lightning_ulysses.hf.state import PatchState

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


def is_token_mixer(module: nn.Module) -> bool:
    """Whether ``module`` has a head-sharded form (:func:`sharded_mixer_forward`)."""
    return bool(kernels_called(module)) or _layer_form(module) is not None or sequence_shift_of(module) is not None


def sharded_mixer_forward(module: nn.Module, state: PatchState) -> Callable[..., Any]:
    """The forward of a token mixer (:func:`is_token_mixer`) that runs its sequential part on this rank's heads over
    the whole sequence (see the module docstring): its own forward with the kernels it calls swapped, or the
    head-sharded forward of lightning attention (:mod:`.lightning`), an mLSTM backend (:mod:`.mlstm`), Griffin's
    recurrent block (:mod:`.rglru`) or ZAYA's CCA projection (:mod:`.cca`); a token shift takes its halo
    (:mod:`.shift`). The module's own forward runs whenever ``state`` is not sequence parallel."""
    kernels = kernels_called(module)
    if kernels:
        return _sharded_forward(module, kernels, state)
    form = _layer_form(module)
    if form is not None:
        return _while_sharded(module, state, form(module, _group(state), _documents(state)))
    if sequence_shift_of(module) is not None:
        return _while_sharded(
            module, state, sharded_shift_forward(module, _group(state), _documents(state), lambda: _local_tokens(state))
        )
    raise ValueError(f"{type(module).__name__} is no token mixer with a head-sharded form.")


def _layer_form(module: nn.Module) -> Callable[..., Callable[..., Any]] | None:
    return next((build for recognise, build in LAYER_FORMS if recognise(module)), None)


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


def _group(state: PatchState) -> Callable[[], SequenceParallelGroups]:
    """The SP groups at call time (a sharded form runs only under sequence parallelism: :func:`_while_sharded`)."""
    return lambda: state.group


def _documents(state: PatchState) -> Callable[[], Documents | None]:
    """The documents of the whole rows of the current batch, at call time."""
    return lambda: None if state.forward is None else documents_of(state.forward.position_ids, state.group)


def _local_tokens(state: PatchState) -> int | None:
    """This rank's tokens per row in the current batch."""
    return None if state.forward is None else state.forward.position_ids.shape[-1]


def _sharded_forward(module: nn.Module, kernels: dict[str, Any], state: PatchState) -> Any:
    """The module's own forward, with its kernels pointing at their sharded forms while it runs."""
    forward = module.forward
    namespace = inspect.unwrap(type(module).forward).__globals__
    sharded = {name: sharded_kernel(name, kernel, _group(state), _documents(state)) for name, kernel in kernels.items()}

    def with_sharded_kernels(*args: Any, **kwargs: Any) -> Any:
        with _pointing(namespace, sharded):
            return forward(*args, **kwargs)

    return _while_sharded(module, state, with_sharded_kernels)


def _while_sharded(module: nn.Module, state: PatchState, sharded: Callable[..., Any]) -> Any:
    """``sharded`` under sequence parallelism, the module's own forward otherwise (one rank, or unpatched)."""
    forward = module.forward

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not state.enabled or state.group.sp is None or state.sp_size == 1:
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
