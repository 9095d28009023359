"""What the set-up check finds, agreed over the SP group, and the refusal that names it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_ulysses.hf.mixers import TokenDims
from lightning_ulysses.hf.patching import PatchState


@dataclass(frozen=True)


class Finding:
    """One reason to refuse: where (module path and class) and what. A module that only mixes tokens outside
    attention also carries its path and where the sequence runs in its tensors, so that it can be run on the
    whole sequence instead (:mod:`lightning_ulysses.hf.mixers`)."""

    where: str
    problem: str
    mixer: str | None = None
    dims: TokenDims | None = None
    enclosing: tuple[tuple[str, TokenDims | None], ...] = ()
    """The modules around ``mixer`` whose outputs differ too, innermost first: where to gather when ``mixer``'s own
    inputs are not the sequence (a convolution fed by another convolution's padded output)."""


def agreed(findings: list[Finding], state: PatchState) -> list[Finding]:
    """The union of every SP rank's findings, in rank order (every rank then refuses alike)."""
    if state.group is None or state.sp_size == 1:
        return findings
    gathered: list[list[Finding]] = [[] for _ in range(state.sp_size)]
    dist.all_gather_object(gathered, findings, group=state.group)
    merged: list[Finding] = []
    for rank_findings in gathered:
        merged += [f for f in rank_findings if f not in merged]
    return merged


def any_rank(flags: Tensor, state: PatchState) -> list[bool]:
    """Element-wise OR of ``flags`` over the SP group (gloo and NCCL alike: via the default device of the group)."""
    if flags.numel() == 0:
        return []
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(state.group) == "nccl" else "cpu"
    flags = flags.to(device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=state.group)
    return [bool(f) for f in flags.tolist()]


def module_label(names: dict[nn.Module, str], module: nn.Module) -> str:
    return f"{names.get(module, '?') or '<model>'} ({type(module).__name__})"


def refusal(model: PreTrainedModel, findings: list[Finding], suggest_gather: bool) -> str:
    shown = findings[:8]
    lines = [f"  - {f.where}: {f.problem}" for f in shown]
    if len(findings) > len(shown):
        lines.append(f"  - ... and {len(findings) - len(shown)} more")
    if suggest_gather and all(f.mixer is not None for f in findings):
        lines.append(
            "  UlyssesStrategy(sequence_mixers='gather') runs such layers on the whole sequence on every rank instead: "
            "exact, at sp_size times their compute and with their activations at full length."
        )
    return (
        f"{type(model).__name__} cannot be trained exactly with Ulysses sequence parallelism; lightning-ulysses checked "
        "it at set-up, before any step:\n" + "\n".join(lines) + "\n"
        "Train this model without sequence parallelism (sp_size=1 on a plain strategy), or use a model whose layers "
        "mix tokens only through softmax attention (docs/model-support.md lists every transformers family)."
    )
