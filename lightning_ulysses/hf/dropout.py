"""Dropout under sequence parallelism: an RNG stream per SP rank for the patched model's forward.

The ranks of an SP group hold different tokens of the same sequences (and, between the all-to-alls of attention,
different heads of the whole sequence), but they start from the same RNG state: ``seed_everything`` seeds every rank
alike, which the data needs (:mod:`lightning_ulysses.sp_loaders`). Drawn from that shared state, the dropout masks of
rank 0's tokens would be those of rank 1's tokens, and the attention-dropout masks of the heads on rank 0 those of the
heads on rank 1, where one process draws independent masks.

:class:`SequenceParallelRNG` gives each SP rank a stream of its own, seeded at set-up from the run's seed
(``torch.initial_seed()``, which ``seed_everything`` sets on every rank) and the SP rank, and a patched model's
forward in training mode draws from it (:meth:`SequenceParallelRNG.drawing`): the default generator of the device the
model computes on is set to the stream's state for the forward and back to the shared state after it, the stream's
advanced state kept for the next forward, as Megatron's ``CudaRNGStatesTracker.fork`` does around its
model-parallel regions. Dropout then draws what one process draws in distribution: the same keep rate, masks
independent across tokens, heads and SP ranks (not the same bits as one process's masks; dropout 0 is unaffected).
The DP replicas of one SP rank share its stream, as plain DDP's replicas share theirs.

What keeps the shared stream: everything outside the model's forward (data, samplers, the user's code in
``training_step``, the vision tower that :class:`~lightning_ulysses.VisionLanguageModel` runs before its language
model, evaluation); on CUDA, the host generator inside it too, so host-side draws that every SP rank must agree on
stay shared (LayerDrop's ``torch.rand([])`` that decides whether a layer runs: the ranks must run the same layers).
On CPU both kinds of draw come from one generator, so a model with LayerDrop is refused there
(:func:`layerdrop_refusal`).

Recomputation: activation checkpointing (``torch.utils.checkpoint``, transformers' gradient checkpointing, the
strategy's ``activation_checkpointing``) and head-chunk recomputation save the RNG state a region's forward saw and
restore it to recompute, so the recompute draws the forward's masks from the stream. Swapping a generator's state is
host-side (a CUDA generator's state is its seed and offset): no device sync.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import Tensor, nn

from lightning_ulysses.groups import SequenceParallelGroups

STREAM_STRIDE = 0x9E3779B97F4A7C15
"""Odd: the SP ranks' seeds ``seed + STREAM_STRIDE * (sp_rank + 1)`` (mod 2**64) differ from each other and from the
run's seed."""


def stream_seed(seed: int, sp_rank: int) -> int:
    """The seed of SP rank ``sp_rank``'s stream in a run seeded with ``seed``."""
    return (seed + STREAM_STRIDE * (sp_rank + 1)) % (1 << 64)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class SequenceParallelRNG:
    """One SP rank's RNG stream for the model's forward (see the module docstring)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._states: dict[torch.device, Tensor] = {}  # per device generator: the stream's state, made at first use

    @classmethod
    def of(cls, groups: SequenceParallelGroups) -> SequenceParallelRNG | None:
        """This rank's stream in the SP groups ``groups``, seeded from the run's seed; ``None`` without sequence
        parallelism (one process draws from the shared generators)."""
        topology = groups.topology
        return cls(stream_seed(torch.initial_seed(), topology.sp_rank)) if topology.sp_size > 1 else None

    @contextmanager
    def drawing(self, device: torch.device) -> Iterator[None]:
        """Inside the block, ``device``'s default generator (the host's for a CPU device, that GPU's for a CUDA one)
        draws from this stream; after it, the generator is back at its shared state and the stream keeps its own."""
        generator = _default_generator(device)
        key = generator.device
        if key not in self._states:
            self._states[key] = torch.Generator(key).manual_seed(self.seed).get_state()
        shared = generator.get_state()
        generator.set_state(self._states[key])
        try:
            yield
        finally:
            self._states[key] = generator.get_state()
            generator.set_state(shared)


def forward_draws(
    rng: SequenceParallelRNG | None, model: nn.Module, outermost: bool, position_ids: Tensor | None
) -> AbstractContextManager[None]:
    """Where a patched ``model``'s forward about to run draws: the SP rank's stream ``rng``, on the device of the
    batch's ``position_ids``, when it is the outermost patched forward in training mode; else the shared
    generators."""
    if rng is None or not outermost or not model.training or position_ids is None:
        return nullcontext()
    return rng.drawing(position_ids.device)


def layerdrop_refusal(model: nn.Module, device: torch.device) -> str | None:
    """Why a model with LayerDrop (a module's ``layerdrop > 0``: in training, one host draw per layer decides whether
    it runs, which every SP rank must agree on) cannot train under SP on ``device``, or ``None``. On the CPU its
    dropout masks draw from the same generator as that decision (:class:`SequenceParallelRNG` swaps it per SP rank);
    on CUDA the masks draw from the GPU's."""
    if device.type != "cpu":
        return None
    dropping = [(name, value) for name, module in model.named_modules() if (value := _layerdrop(module)) > 0]
    if not dropping:
        return None
    name, value = dropping[0]
    return (
        f"{type(model).__name__} uses LayerDrop ({name + '.' if name else ''}layerdrop={value}): in training it skips "
        "layers at random, and the ranks of an SP group must skip the same layers while each draws dropout masks of "
        "its own (an RNG stream per SP rank); on a CPU both come from one generator. Set the config's layerdrop to "
        "0, or train on CUDA GPUs (the decision is drawn on the host, the masks on the GPU)."
    )


def _layerdrop(module: nn.Module) -> float:
    value = getattr(module, "layerdrop", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0
