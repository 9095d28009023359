"""The applier: carries out a :class:`~lightning_ulysses.hf.plan.ModelPlan` on a model, every change in one ledger.

A :class:`Patch` is one patched ``PreTrainedModel``. Made, it hooks the model: every (sub-)config points at the
``"ulysses"`` attention implementation (:mod:`lightning_ulysses.hf.interface`), every module holds the
:class:`~lightning_ulysses.hf.state.PatchState`, every ``PreTrainedModel`` inside runs the guarded forward
(:mod:`lightning_ulysses.hf.forward`). :meth:`Patch.realize` then brings the modules to a plan, undoing what the
plan no longer holds, and :meth:`Patch.undo` restores the model exactly. Every ``_ulysses_*`` attribute of a
patched model's modules is written here, through the ledger (the memory options of :mod:`lightning_ulysses.memory`
keep a ledger of their own)::

    check_model(model, state, patch.realize)  ->  ModelPlan | Refusal     (the check proposes, the patch realises)
    Patch.realize(plan)                       ->  ledger: ("layer", name), ("projected", name), ("sharded", name), ...
    Patch.undo()                              ->  the model as it was
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from lightning_ulysses.engines import transformers as transformers_engine
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf.forward import guarded_forward
from lightning_ulysses.hf.interface import ULYSSES_ATTN_IMPLEMENTATION
from lightning_ulysses.hf.ledger import Ledger
from lightning_ulysses.hf.mixers import gather_whole_sequence, is_token_mixer, sharded_mixer_forward
from lightning_ulysses.hf.plan import ModelPlan, ProjectionChunks, TokenDims
from lightning_ulysses.hf.projections import projected_forward
from lightning_ulysses.hf.rotary import whole_sequence_rotary
from lightning_ulysses.hf.state import PatchState, model_configs, outermost_models

PATCH_ATTRIBUTE = "_ulysses_patch"
"""Where a patched model holds its :class:`Patch`."""

_HOOK = ("hook",)
"""The ledger key of the changes every patch makes (configs, module state, guarded forwards)."""


class Patch:
    """One patched ``PreTrainedModel``: its state, the plan carried out on it, and the ledger of every change."""

    def __init__(self, model: PreTrainedModel, state: PatchState) -> None:
        self.model, self.state, self.ledger = model, state, Ledger()
        self.plan = ModelPlan()
        configs = model_configs(model)
        self.original_attn: list[tuple[PretrainedConfig, str | None]] = [
            (c, transformers_engine.attn_implementation(c)) for c in configs
        ]
        for module in model.modules():  # any of them may call the attention interface
            self.ledger.set(_HOOK, module, "_ulysses_state", state)
        for config in configs:  # each config by itself: transformers' setter would recurse into the sub-configs
            self.ledger.set(
                _HOOK, config, transformers_engine.ATTN_IMPLEMENTATION_ATTRIBUTE, ULYSSES_ATTN_IMPLEMENTATION
            )
        for sub in model.modules():
            if isinstance(sub, PreTrainedModel):
                self.ledger.set(_HOOK, sub, "forward", guarded_forward(sub, state))
        self.ledger.set(_HOOK, model, PATCH_ATTRIBUTE, self)

    def realize(self, plan: ModelPlan) -> None:
        """Bring the modules to ``plan``: undo the changes of the current plan that ``plan`` does not hold, then make
        those it adds."""
        wanted = self._changes(plan)
        for key in self.ledger.keys():  # noqa: SIM118 - a Ledger is no dict: keys() is a copy, and undo() removes keys
            if key != _HOOK and key not in wanted:
                self.ledger.undo(key)
        for key, change in wanted.items():
            if key not in self.ledger:
                change()
        self.state.sharded_mixers = bool(plan.sharded)
        self.state.token_types = plan.token_types
        self.plan = plan

    def undo(self) -> None:
        """Every change of this patch undone, last first: the model is as it was before the patch."""
        self.ledger.undo()

    def _changes(self, plan: ModelPlan) -> dict[Hashable, Callable[[], None]]:
        """Each change ``plan`` asks for, under its ledger key, and the function that makes it."""
        modules = dict(self.model.named_modules())
        changes: dict[Hashable, Callable[[], None]] = {}
        for name, layer in plan.layers:
            key: Hashable = ("layer", name, layer)
            changes[key] = functools.partial(self.ledger.set, key, modules[name], "_ulysses_plan", layer)
            if layer.projection_chunks is not None:
                key = ("projected", name, layer.projection_chunks)
                changes[key] = functools.partial(self._project, key, modules[name], layer.projection_chunks)
        for name in plan.sharded_mixers():
            key = ("sharded", name)
            changes[key] = functools.partial(shard_mixer, self.ledger, key, modules[name], self.state)
        for name in plan.rotary:
            key = ("rotary", name)
            changes[key] = functools.partial(self._whole_sequence_rotary, key, modules[name])
        for gathered in plan.gathered:
            key = ("gathered", gathered.mixer, gathered.module)
            changes[key] = functools.partial(self._gather, key, modules[gathered.module], gathered.dims)
        return changes

    def _project(self, key: Hashable, module: nn.Module, spec: ProjectionChunks) -> None:
        self.ledger.set(key, module, "forward", projected_forward(module, spec, self.state))

    def _whole_sequence_rotary(self, key: Hashable, module: nn.Module) -> None:
        self.ledger.hooks(key, module, "_ulysses_rotary_hooks", *whole_sequence_rotary(module, self.state))

    def _gather(self, key: Hashable, module: nn.Module, dims: TokenDims) -> None:
        self.ledger.hooks(key, module, "_ulysses_gather_hooks", *gather_whole_sequence(module, self.state, dims))


def shard_mixer(ledger: Ledger, key: Hashable, module: nn.Module, state: PatchState) -> None:
    """Run the token mixer ``module`` head-sharded (:func:`~lightning_ulysses.hf.mixers.sharded_mixer_forward`)."""
    ledger.set(key, module, "forward", sharded_mixer_forward(module, state))
    ledger.set(key, module, "_ulysses_mixer_forward", True)


def shard_token_mixers(model: nn.Module, state: PatchState, ledger: Ledger) -> list[str]:
    """Run every token mixer inside ``model`` head-sharded, each change recorded in ``ledger`` (under
    ``("sharded", name)``); the names of the mixers. For a module that is not a transformers model (a benchmark's
    single mixer); a patched model's mixers are planned by the set-up check."""
    names = [name for name, module in model.named_modules() if is_token_mixer(module)]
    modules = dict(model.named_modules())
    for name in names:
        shard_mixer(ledger, ("sharded", name), modules[name], state)
    return names


def patch_of(model: nn.Module) -> Patch | None:
    """The :class:`Patch` of a patched ``PreTrainedModel``, or None."""
    return model.__dict__.get(PATCH_ATTRIBUTE)


def patches(model: nn.Module) -> list[Patch]:
    """The patches of the outermost transformers models inside ``model``."""
    return [patch for m in outermost_models(model) if (patch := patch_of(m)) is not None]


@contextmanager
def sequence_parallel_disabled(model: nn.Module) -> Iterator[None]:
    """Run the patched attention of ``model`` locally (no SP group) inside the ``with`` block.

    The model must then be called with whole sequences (``[B, N]`` inputs and global ``position_ids``) on
    one rank; documents and padding are still masked from the position ids; a call with ``labels=`` returns the
    model's own loss. Not collective.
    """
    states = [patch.state for patch in patches(model)]
    saved = [(state.group, state.sp_size, state.labels_loss, state.batches) for state in states]
    local = SequenceParallelGroups.of(None)  # its cache keeps the block's documents
    try:
        for state in states:
            # labels=: the model's own loss; the documents: those of the whole sequences it is called with
            state.group, state.sp_size, state.labels_loss, state.batches = local, 1, None, None
        yield
    finally:
        for state, (group, sp_size, labels_loss, batches) in zip(states, saved, strict=True):
            state.group, state.sp_size, state.labels_loss, state.batches = group, sp_size, labels_loss, batches


@contextmanager
def unpatched(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as plain transformers inside the ``with`` block: its original attention implementation
    (and the masks transformers builds for it), no forward guard, no whole-sequence RoPE. Not collective."""
    found = patches(model)
    try:
        for patch in found:
            patch.state.enabled = False
            for config, implementation in patch.original_attn:
                transformers_engine.set_own_attn_implementation(config, implementation)
        yield
    finally:
        for patch in found:
            patch.state.enabled = True
            for config, _ in patch.original_attn:
                transformers_engine.set_own_attn_implementation(config, ULYSSES_ATTN_IMPLEMENTATION)
