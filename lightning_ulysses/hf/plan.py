"""What the set-up check decides for a model, as data: what each module becomes, or why the model is refused.

:func:`~lightning_ulysses.hf.check.check_model` returns a :class:`ModelPlan` or a :class:`Refusal`;
:class:`~lightning_ulysses.hf.apply.Patch` carries a plan out (and is the only writer of a model's modules).
Modules are named by their path in the model (``model.layers.0.self_attn``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from lightning_ulysses.hf.masks import MaskPattern
from lightning_ulysses.logits import LogitMap

NOT_CHECKED = "not checked"
"""A plan's ``logits`` where the set-up check did not read how the model makes its logits (``tiled_loss`` off)."""


@dataclass(frozen=True)
class ProjectionChunks:
    """An attention module that runs once per head chunk with its projections inside the chunk
    (:mod:`lightning_ulysses.hf.projections`): its ``query``, ``key`` and ``value`` child ``nn.Linear`` narrowed to
    the rows of the chunk's heads, its ``output`` projection to their columns, its per-head ``gates``
    (``(child, features per head)``) and its own ``per_head`` parameters (``[heads, ...]``: attention sinks) to the
    chunk's query heads; ``heads`` query and ``kv_heads`` K/V heads of ``qk_dim`` and ``value_dim``, in ``chunks``
    chunks of each rank's head slots."""

    chunks: int
    query: str
    key: str
    value: str
    output: str
    gates: tuple[tuple[str, int], ...]
    per_head: tuple[str, ...]
    heads: int
    kv_heads: int
    qk_dim: int
    value_dim: int


@dataclass(frozen=True)
class LayerPlan:
    """How one attention layer runs: the pattern its mask asked for (windows and chunks that transformers
    applies only through the mask included), whether it passes attention sinks (``s_aux``, one logit per
    head, read at each call: it is a trained weight), and, under ``head_chunks``, whether its projections run
    inside the chunks (else its attention alone runs in chunks)."""

    pattern: MaskPattern
    sinks: bool = False
    projection_chunks: ProjectionChunks | None = None


@dataclass(frozen=True)
class TokenDims:
    """Where the sequence runs in a module's per-token inputs (by argument key, :func:`argument_keys`:
    ``hidden_states``, ``position_embeddings.1``) and outputs (by position among the output tensors; an output may be
    longer than the sequence by a constant, as a padded convolution's ``N + k - 1``)."""

    inputs: dict[str, int]
    outputs: dict[int, int]


def positional_parameters(module: nn.Module) -> tuple[str, ...]:
    """The names of the parameters of ``module.forward`` that take arguments by position, in order."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # a forward without a signature Python can read
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds)


def argument_keys(parameters: tuple[str, ...], args: tuple, kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(key, value)`` of every argument of a call whose positional parameters are ``parameters``
    (:func:`positional_parameters`): an argument passed by position is keyed by its parameter's name, as when passed
    by name (the set-up check sees the model call its decoder with ``input_ids`` by position; the tiled loss calls
    the decoder with them by name); ``arg{i}`` past the named parameters."""
    by_position = [(parameters[i] if i < len(parameters) else f"arg{i}", a) for i, a in enumerate(args)]
    return by_position + list(kwargs.items())


@dataclass(frozen=True)
class Gathered:
    """A module run on the whole sequence on every rank (:mod:`lightning_ulysses.hf.mixers.gather`), for the token
    mixer ``mixer`` that the check found (``module`` is the mixer itself or a module around it)."""

    mixer: str
    module: str
    dims: TokenDims


@dataclass(frozen=True)
class ModelPlan:
    """What each module of a patched model becomes.

    * ``layers``: attention layer -> its :class:`LayerPlan`;
    * ``sharded``: token mixers whose kernels run head-sharded on the whole sequence
      (:mod:`~lightning_ulysses.hf.mixers`);
    * ``rotary``: rotary embeddings given the whole sequence's largest position
      (:mod:`~lightning_ulysses.hf.rotary`);
    * ``gathered``: modules run on the whole sequence on every rank (``sequence_mixers="gather"``); a sharded mixer
      inside one runs as it is;
    * ``token_types``: what ``token_type_ids`` mean to the masks (bidirectional image spans, Gemma 3);
    * ``logits``: how the logits follow from the final hidden states, which the tiled loss applies per tile.
    """

    layers: tuple[tuple[str, LayerPlan], ...] = ()
    sharded: tuple[str, ...] = ()
    rotary: tuple[str, ...] = ()
    gathered: tuple[Gathered, ...] = ()
    token_types: str = ""
    """What the model's masks do with ``token_type_ids`` (:mod:`lightning_ulysses.hf.check.spans`): ``""`` nothing
    (or it takes none), ``"spans"`` runs of ``1`` attend to themselves bidirectionally, else why it cannot be given
    them."""
    logits: LogitMap | str = NOT_CHECKED
    """The :class:`~lightning_ulysses.logits.LogitMap` from the decoder's final hidden states to the logits
    (:mod:`lightning_ulysses.hf.check.logits`), or why the logits cannot be computed in token tiles, or
    :data:`NOT_CHECKED` (the check ran without ``tiled_loss``)."""

    def with_gathered(self, gathered: Gathered) -> ModelPlan:
        """This plan with ``gathered`` in place of any earlier choice for the same mixer or inside its module."""
        kept = tuple(g for g in self.gathered if g.mixer != gathered.mixer and not _inside(g.module, gathered.module))
        return replace(self, gathered=(*kept, gathered))

    def sharded_mixers(self) -> tuple[str, ...]:
        """The head-sharded mixers that run so: those outside every gathered module."""
        return tuple(name for name in self.sharded if not any(_inside(name, g.module) for g in self.gathered))


@dataclass(frozen=True)
class Finding:
    """One reason to refuse: where (module path and class) and what. A module that only mixes tokens outside
    attention also carries its path and where the sequence runs in its tensors, so that it can be run on the
    whole sequence instead (:mod:`lightning_ulysses.hf.mixers.gather`)."""

    where: str
    problem: str
    mixer: str | None = None
    dims: TokenDims | None = None
    enclosing: tuple[tuple[str, TokenDims | None], ...] = ()
    """The modules around ``mixer`` whose outputs differ too, innermost first: where to gather when ``mixer``'s own
    inputs are not the sequence (a convolution fed by another convolution's padded output)."""


@dataclass(frozen=True)
class Refusal:
    """The model cannot run exactly: every finding, agreed over the SP group."""

    model: str
    """The model's class name."""
    findings: tuple[Finding, ...] = field(default_factory=tuple)
    suggest_gather: bool = True
    """Whether to point at ``sequence_mixers="gather"`` when every finding is a token mixer."""

    def message(self) -> str:
        shown = self.findings[:8]
        lines = [f"  - {f.where}: {f.problem}" for f in shown]
        if len(self.findings) > len(shown):
            lines.append(f"  - ... and {len(self.findings) - len(shown)} more")
        if self.suggest_gather and all(f.mixer is not None for f in self.findings):
            lines.append(
                "  UlyssesStrategy(sequence_mixers='gather') runs such layers on the whole sequence on every rank "
                "instead: exact, at sp_size times their compute and with their activations at full length."
            )
        return (
            f"{self.model} cannot be trained exactly with Ulysses sequence parallelism; lightning-ulysses checked "
            "it at set-up, before any step:\n" + "\n".join(lines) + "\n"
            "Train this model without sequence parallelism (sp_size=1 on a plain strategy), or use a model whose "
            "layers mix tokens only through softmax attention (docs/model-support.md lists every transformers family)."
        )


def _inside(name: str, module: str) -> bool:
    """Whether the module at path ``name`` is ``module`` or inside it."""
    return name == module or name.startswith(module + ".") or module == ""
