"""What each asked memory option applies to, as one table logged at fit start (:class:`MemoryReport`).

Module paths are summarised by pattern: ``model.layers.0.mlp`` ... ``model.layers.3.mlp`` read
``model.layers.*.mlp (LlamaMLP) x4``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:  # hf.plan imports logits, which imports this package's tiling
    from lightning_ulysses.hf.plan import ModelPlan


@dataclass(frozen=True)
class OptionReport:
    """One asked option: what it ``applies`` to and what it leaves out (``"what: why"``)."""

    option: str
    applies: str
    left_out: tuple[str, ...] = ()


@dataclass
class MemoryReport:
    rows: list[OptionReport] = field(default_factory=list)

    def table(self) -> str:
        lines = ["| option | applies to | left out |", "| --- | --- | --- |"]
        for row in self.rows:
            lines.append(f"| {row.option} | {row.applies} | {'; '.join(row.left_out) or '-'} |")
        return "lightning-ulysses memory options in effect:\n" + "\n".join(lines)


def summarize(modules: Iterable[tuple[str, nn.Module]]) -> str:
    """``model.layers.*.mlp (LlamaMLP) x4, ...``: module paths with layer numbers folded, by class (a path that occurs
    once is shown whole)."""
    return _folded((name, f" ({type(module).__name__})") for name, module in modules)


def summarize_names(names: Iterable[str]) -> str:
    """``model.layers.*.mlp x4, ...``: module paths with layer numbers folded (a path that occurs once is shown
    whole)."""
    return _folded((name, "") for name in names)


def _folded(items: Iterable[tuple[str, str]]) -> str:
    groups: dict[tuple[str, str], list[str]] = {}
    for name, suffix in items:
        groups.setdefault((re.sub(r"\.\d+(?=\.|$)", ".*", name), suffix), []).append(name)
    return ", ".join(
        f"{names[0]}{suffix}" if len(names) == 1 else f"{path}{suffix} x{len(names)}"
        for (path, suffix), names in groups.items()
    )


def head_chunks_row(plans: list[ModelPlan], head_chunks: int | str) -> OptionReport:
    """``head_chunks``: the attention layers that run per chunk with their projections narrowed to the chunk's heads
    (the set-up check's plan, :mod:`lightning_ulysses.hf.check.projections`), and those that chunk their attention
    alone."""
    layers = [(name, layer) for plan in plans for name, layer in plan.layers]
    projected = [name for name, layer in layers if layer.projection_chunks is not None]
    rest = [name for name, layer in layers if layer.projection_chunks is None]
    applies = f"{len(layers)} attention layers: {len(projected)} projected per chunk"
    left = (f"{summarize_names(rest)}: chunked attention only (projections not per head)",) if rest else ()
    return OptionReport(f"head_chunks={head_chunks}", applies, left)


def tiled_loss_row(setting: int | bool, logits_transform: str | None = None) -> OptionReport:
    """``tiled_loss``: ``forward_causal_lm_loss``'s ``lm_head`` + cross entropy. ``logits_transform``: what the tiled
    path applies to each logit tile besides ``lm_head`` (the set-up finding of the model's logit scaling or
    soft-cap), when one is found."""
    tiles = "tiles sized by bytes" if setting is True else f"{setting} tiles"
    applies = f"lm_head + cross entropy of forward_causal_lm_loss in {tiles}"
    if logits_transform:
        applies += f", each tile's logits {logits_transform}"
    return OptionReport(f"tiled_loss={setting}", applies)
