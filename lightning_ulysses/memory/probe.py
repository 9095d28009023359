"""The memory options' set-up probe: the plain model run once on a few tokens, the calls of chosen modules kept.

What a module is fed in training is found by running it: the tiled MLP rule reads the inputs of each decoder layer's
feed-forward candidates from this run, and the norm rule the arguments its norms are called with. The run is that of
plain transformers (:func:`~lightning_ulysses.hf.apply.unpatched`: no collective of sequence parallelism), in eval
mode without autograd, on the same tokens on every rank; under ZeRO-3 each call gathers its parameters, which every
rank does alike.

It is not the set-up check's whole-sequence run (:class:`~lightning_ulysses.hf.check.whole.WholeRun`), which also
records every module's calls: that run computes token-local attention instead of the model's, on ``sp * 11``
tokens (an odd count per rank; the tiled MLP rule chose its tile counts for :data:`PROBE_TOKENS`), and ends with the
check, before the memory options are chosen (:func:`~lightning_ulysses.memory.apply_memory_options` also runs without
the check, and again with other options); handing it over would keep a clone of every module's inputs and outputs alive
until then, to save one forward of ``2 x PROBE_TOKENS`` tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_map
from transformers import PreTrainedModel

PROBE_TOKENS = 12
"""Tokens per row of the probe (two rows): even, so that tiles of 3 and one-token tiles both occur."""


@dataclass(frozen=True)
class Call:
    """One call of a watched module in the probe run; its tensors cloned (later in-place ops cannot change them)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any


@contextmanager
def probing(model: PreTrainedModel) -> Iterator[None]:
    """Inside the block ``model`` runs as plain transformers, in eval mode (no dropout, no router jitter), without
    autograd; every module's mode is restored afterwards."""
    # imported here: lightning_ulysses.hf imports this package (recomputed_in_backward) as it loads
    from lightning_ulysses.hf.apply import unpatched
    from lightning_ulysses.hf.check.tensors import modes_restored

    with modes_restored(model), torch.no_grad(), unpatched(model):
        model.eval()
        yield


def probe_calls(model: PreTrainedModel, watched: Iterable[nn.Module]) -> dict[nn.Module, list[Call]]:
    """The calls of each ``watched`` module in one forward of ``model`` on ``[2, PROBE_TOKENS]`` ordinary token ids
    (call inside :func:`probing`). Raises what the forward raises."""
    from lightning_ulysses.hf.check import probe_ids

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    input_ids = probe_ids(model, PROBE_TOKENS, device)
    position_ids = torch.arange(PROBE_TOKENS, device=device).expand_as(input_ids)
    calls: dict[nn.Module, list[Call]] = {}

    def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        args, kwargs, output = tree_map(_clone, (args, kwargs, output))
        calls.setdefault(module, []).append(Call(args, kwargs, output))

    handles = [m.register_forward_hook(record, with_kwargs=True) for m in set(watched)]
    try:
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def agreed_on_all_ranks(flags: list[bool], device: torch.device) -> list[bool]:
    """``flags`` AND-ed over every rank (one ``all_reduce`` when there are several): what one rank cannot do, none
    does, so that every rank makes the same calls of a module (ZeRO-3 gathers its parameters collectively)."""
    if not flags or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return flags
    if dist.get_backend() != "nccl":
        device = torch.device("cpu")
    agreed = torch.tensor(flags, dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return [bool(f) for f in agreed.tolist()]


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else value
