"""What the set-up check finds (:class:`~lightning_ulysses.hf.plan.Finding`), agreed over the SP group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_ulysses.hf.plan import Finding
from lightning_ulysses.hf.state import PatchState


def agreed(findings: list[Finding], state: PatchState) -> list[Finding]:
    """The union of every SP rank's findings, in rank order (every rank then refuses alike)."""
    group = state.group.sp
    if group is None or state.sp_size == 1:
        return findings
    gathered: list[list[Finding]] = [[] for _ in range(state.sp_size)]
    dist.all_gather_object(gathered, findings, group=group)
    merged: list[Finding] = []
    for rank_findings in gathered:
        merged += [f for f in rank_findings if f not in merged]
    return merged


def any_rank(flags: Tensor, state: PatchState) -> list[bool]:
    """Element-wise OR of ``flags`` over the SP group (gloo and NCCL alike: via the default device of the group)."""
    if flags.numel() == 0:
        return []
    group = state.group.sp
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    flags = flags.to(device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [bool(f) for f in flags.tolist()]


def module_label(names: dict[nn.Module, str], module: nn.Module) -> str:
    return f"{names.get(module, '?') or '<model>'} ({type(module).__name__})"
