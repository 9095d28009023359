"""Mid-epoch resume: a checkpoint saved anywhere inside an epoch resumes at the next untrained batch.

Lightning restores the loops' progress from a checkpoint, but restarts the training loader at the start of
its epoch unless the loader has ``state_dict`` / ``load_state_dict``: the resumed run then sees the epoch's
first batches twice. :class:`ResumableLoader` gives a plain ``DataLoader`` that state: the epoch, the
number of its batches that the saved weights contain (:func:`resume_batch`) and the global batch size. On
resume every DP rank's sampler skips ``batches x micro_batch_size`` indices, without loading their samples.

Which batches the weights contain. A checkpoint holds the weights and optimizer state after the last
optimizer step, never the gradients of a step in progress: a checkpoint saved inside a step (from a
callback during gradient accumulation, in ``training_step``, after the backward, ...) must resume at that
step's first micro-batch. Lightning's own counters say otherwise there (its batch count already includes the
batch in flight, and it counts the micro-batches of an unfinished accumulation as done), so
:func:`rewind_to_step_boundary` rewrites the saved loop progress to the last optimizer step, as if the
checkpoint had been saved right after it. Steps fall on every ``accumulate_grad_batches``-th batch of an
epoch and on its last batch, which ends a shorter window when the epoch length is not a multiple (the strategy
lets Lightning decide, as without a strategy, and tells DeepSpeed's engine).

The distributed sampler deals one permutation of the epoch round-robin over the DP ranks, so this skips
exactly the first ``batches x global_batch_size`` samples of the epoch whatever the ``(sp, dp)`` layout: a
resume on another layout with the same global batch continues at the same sample.

Wrapped: loaders batched by torch's ``BatchSampler`` (``DataLoader(dataset, batch_size=...)``, with or
without the distributed sampler Lightning adds). Loaders with a custom batch sampler, iterable datasets and
loaders that are resumable already (e.g. torchdata's ``StatefulDataLoader``) are left as they are.

Not torchdata's ``StatefulDataLoader`` for this: its state is how far this rank's own loader got (Lightning keeps
rank 0's), which points at the same samples only on the same DP layout and when no step was in flight; the
epoch-wide sample offset above is what resumes exactly on another layout, and it needs no extra dependency.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, TypeGuard, cast

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


def resume_batch(fit_loop: Any, step_in_flight: bool = False) -> int:
    """The batch of the current epoch that a checkpoint saved now resumes at (0: the next epoch's first).

    Under automatic optimization: the epoch's optimizer steps in the weights x ``accumulate_grad_batches``, the
    batches whose gradients the weights hold; a step in progress is redone from its first micro-batch.
    ``step_in_flight``: the optimizer has applied a step that Lightning counts only once ``optimizer_step``
    returns (a save from inside it). Under manual optimization, where only the module knows when it steps:
    the batches whose training step returned.
    """
    if fit_loop.trainer.lightning_module.automatic_optimization:
        batches = _batches_in_weights(fit_loop, step_in_flight)
    else:
        batches = fit_loop.epoch_loop.batch_progress.current.processed
    return 0 if batches >= fit_loop.max_batches else batches  # the epoch is over (limit_train_batches included)


def _batches_in_weights(fit_loop: Any, step_in_flight: bool) -> int:
    steps = fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.current.completed
    return min((steps + step_in_flight) * fit_loop.trainer.accumulate_grad_batches, fit_loop.max_batches)


def rewind_to_step_boundary(loop_state: dict[str, Any], fit_loop: Any, step_in_flight: bool) -> None:
    """Rewrite the fit loop's saved progress ``loop_state`` (``checkpoint["loops"]["fit_loop"]``) to the last
    optimizer step in the weights, as if the checkpoint had been saved right after that step's batch.

    Lightning resumes a checkpoint saved in ``on_train_batch_end`` (or later) of the batch that completed a step
    at the next batch; saved anywhere else inside a step, its counters point past the step's first untrained
    micro-batch (it would skip the micro-batches of an unfinished accumulation), or before a step that the
    weights hold (``step_in_flight``, see :func:`resume_batch`: it would apply that step twice). Invariant
    after the rewrite: the epoch's batch counters (``ready`` ... ``completed``) equal :func:`resume_batch` before its
    end-of-epoch wrap, which is where the loader resumes, and the step counters count the steps in the weights.
    Manual optimization is left as Lightning saves it (see :func:`resume_batch`).
    """
    trainer = fit_loop.trainer
    if not trainer.lightning_module.automatic_optimization:
        return
    batch = _batches_in_weights(fit_loop, step_in_flight)
    progress = loop_state["epoch_loop.batch_progress"]
    current, total = progress["current"], progress["total"]
    if current["ready"] == current["processed"] == batch:
        return  # saved at on_train_batch_end of the step's last batch or later: Lightning resumes it exactly
    if step_in_flight:
        if any(config.interval == "step" for config in trainer.lr_scheduler_configs):
            raise RuntimeError(
                "This checkpoint would be saved between the optimizer step and the learning-rate scheduler's step of "
                f"global step {trainer.global_step} (inside optimizer_step), so it would resume with the scheduler one "
                "step behind. Save it in on_train_batch_end (or let ModelCheckpoint do it) instead."
            )
        step = loop_state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]
        for counters in (step["total"], step["current"]):
            counters["ready"] = counters["completed"] = counters["completed"] + 1
        # Lightning counts a stepping batch after on_train_batch_end, which it has not reached
        loop_state["epoch_loop.state_dict"]["_batches_that_stepped"] += 1
    for key in ("ready", "started", "processed", "completed"):
        total[key] += batch - current[key]
        current[key] = batch
    progress["is_last_batch"] = batch >= fit_loop.max_batches


def is_resumable(loader: object) -> TypeGuard[DataLoader]:
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
        fit_loop: the Trainer's fit loop, whose progress says which epoch runs and where a checkpoint saved
            now resumes (:func:`resume_batch`).
        dp_size: the number of DP ranks, each loading its own ``batch_size`` samples per batch.
        step_in_flight: whether an optimizer step is applied but not yet counted (see :func:`resume_batch`).

    Everything else (``sampler``, ``batch_size``, ``len``) is the wrapped loader's, so Lightning still sets the
    sampler's epoch and sizes the epoch.
    """

    def __init__(
        self, loader: DataLoader, fit_loop: Any, dp_size: int, step_in_flight: Callable[[], bool] = lambda: False
    ) -> None:
        assert is_resumable(loader)
        batch_sampler = cast(BatchSampler, loader.batch_sampler)
        sampler = cast(Sampler[int], batch_sampler.sampler)  # a DataLoader's index sampler
        self.loader = loader
        self.fit_loop = fit_loop
        self.dp_size = dp_size
        self.step_in_flight = step_in_flight
        self.batch_size = batch_sampler.batch_size  # this DP rank's samples per batch
        self.skipping_sampler = SkippingSampler(sampler)
        batch_sampler.sampler = self.skipping_sampler  # a plain attribute, read at each iteration

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp_size

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.fit_loop.epoch_progress.current.processed,
            "batches": resume_batch(self.fit_loop, self.step_in_flight()),
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not state["batches"]:
            return
        if state["global_batch_size"] != self.global_batch_size:
            raise ValueError(
                f"The checkpoint was saved {state['batches']} batches into epoch {state['epoch']} with a global batch "
                f"of {state['global_batch_size']} samples; this run's is {self.global_batch_size} (micro-batch "
                f"{self.batch_size} x {self.dp_size} DP ranks). Resume inside an epoch with the same global "
                "batch, or from an end-of-epoch checkpoint."
            )
        self.skipping_sampler.skip = state["batches"] * self.batch_size
        # the sampler's first iteration may come before Lightning sets the epoch (loaders with workers)
        self.skipping_sampler.set_epoch(state["epoch"])
