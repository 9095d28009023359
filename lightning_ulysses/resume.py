"""Mid-epoch resume: a checkpoint saved inside an epoch resumes at the next batch, not at the epoch's start.

Lightning restores the loops' progress from a checkpoint, but restarts the training loader at the start of
its epoch unless the loader has ``state_dict`` / ``load_state_dict``: the resumed run then sees the epoch's
first batches twice. :class:`ResumableLoader` gives a plain ``DataLoader`` that state: the epoch, the
number of its batches the training steps took (Lightning's count, so batches prefetched but not trained on
are not skipped) and the global batch size. On resume every DP rank's sampler skips ``batches x
micro_batch_size`` indices, without loading their samples.

The distributed sampler deals one permutation of the epoch round-robin over the DP ranks, so this skips
exactly the first ``batches x global_batch_size`` samples of the epoch whatever the ``(sp, dp)`` layout: a
resume on another layout with the same global batch continues at the same sample.

Wrapped: loaders batched by torch's ``BatchSampler`` (``DataLoader(dataset, batch_size=...)``, with or
without the distributed sampler Lightning adds). Loaders with a custom batch sampler, iterable datasets and
loaders that are resumable already (e.g. torchdata's ``StatefulDataLoader``) are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler


class SkippingSampler(Sampler[int]):
    """Wraps a sampler; its next iteration leaves out the first ``skip`` indices (later ones are whole)."""

    def __init__(self, sampler: Sampler[int]) -> None:
        self.sampler = sampler
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        if callable(set_epoch := getattr(self.sampler, "set_epoch", None)):
            set_epoch(epoch)


def is_resumable(loader: object) -> bool:
    """Whether :class:`ResumableLoader` can wrap ``loader`` (see the module docstring)."""
    return (
        isinstance(loader, DataLoader)
        and not isinstance(loader.dataset, IterableDataset)
        and type(loader.batch_sampler) is BatchSampler
        and not (hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"))
    )


class ResumableLoader:
    """A training ``DataLoader`` with the ``state_dict`` / ``load_state_dict`` that Lightning checkpoints.

    Args:
        loader: the training loader, batched by torch's ``BatchSampler`` (see :func:`is_resumable`). Its
            batch sampler's ``sampler`` is wrapped in a :class:`SkippingSampler` in place.
        fit_loop: the Trainer's fit loop, whose progress says which epoch runs, how many of its batches
            the training steps took and how many the epoch has.
        dp_size: the number of DP ranks, each loading its own ``batch_size`` samples per batch.

    Everything else (``sampler``, ``batch_size``, ``len``) is the wrapped loader's, so Lightning still sets the
    sampler's epoch and sizes the epoch.
    """

    def __init__(self, loader: DataLoader, fit_loop: Any, dp_size: int) -> None:
        assert is_resumable(loader)
        self.loader = loader
        self.fit_loop = fit_loop
        self.dp_size = dp_size
        self.skipping_sampler = SkippingSampler(loader.batch_sampler.sampler)
        loader.batch_sampler.sampler = self.skipping_sampler  # a plain attribute, read at each iteration

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    @property
    def global_batch_size(self) -> int:
        return self.loader.batch_size * self.dp_size

    def state_dict(self) -> dict[str, int]:
        batches = self.fit_loop.epoch_loop.batch_progress.current.ready
        if batches >= self.fit_loop.max_batches:  # the epoch is over (limit_train_batches included)
            batches = 0  # Lightning starts the next one from its first batch
        return {
            "epoch": self.fit_loop.epoch_progress.current.processed,
            "batches": batches,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not state["batches"]:
            return
        if state["global_batch_size"] != self.global_batch_size:
            raise ValueError(
                f"The checkpoint was saved {state['batches']} batches into epoch {state['epoch']} with a global batch "
                f"of {state['global_batch_size']} samples; this run's is {self.global_batch_size} (micro-batch "
                f"{self.loader.batch_size} x {self.dp_size} DP ranks). Resume inside an epoch with the same global "
                "batch, or from an end-of-epoch checkpoint."
            )
        self.skipping_sampler.skip = state["batches"] * self.loader.batch_size
        # the sampler's first iteration may come before Lightning sets the epoch (loaders with workers)
        self.skipping_sampler.set_epoch(state["epoch"])
