"""The resumable training loader and the saved loop state, without processes: where a checkpoint resumes.

The multi-process proofs (resumed runs equal uninterrupted ones) are in tests/test_checkpoint.py (checkpoints at
step ends, layouts, conversion) and tests/test_preemption.py (checkpoints and signals inside steps).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from lightning_ulysses.runtime.resume import ResumableLoader, is_resumable, resume_batch, rewind_to_step_boundary

DATASET = list(range(24))


def fit_loop(
    epoch: int, steps: int, epoch_batches: float = float("inf"), accumulate: int = 1, step_schedulers: int = 0
) -> SimpleNamespace:
    """The parts of Lightning's fit loop that the loader and the rewind read: ``steps`` optimizer steps completed in
    ``epoch`` (automatic optimization), ``step_schedulers`` LR schedulers stepped every optimizer step."""
    trainer = SimpleNamespace(
        lightning_module=SimpleNamespace(automatic_optimization=True),
        accumulate_grad_batches=accumulate,
        global_step=steps,
        lr_scheduler_configs=[SimpleNamespace(interval="step")] * step_schedulers,
    )
    step = SimpleNamespace(current=SimpleNamespace(completed=steps))
    return SimpleNamespace(
        trainer=trainer,
        epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=epoch)),
        epoch_loop=SimpleNamespace(
            automatic_optimization=SimpleNamespace(optim_progress=SimpleNamespace(optimizer=SimpleNamespace(step=step)))
        ),
        max_batches=epoch_batches,
    )


def loader(dp_size: int, dp_rank: int, batch_size: int, progress: SimpleNamespace) -> ResumableLoader:
    sampler = DistributedSampler(DATASET, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    return ResumableLoader(DataLoader(DATASET, batch_size=batch_size, sampler=sampler), progress, dp_size)


def epoch_permutation(epoch: int) -> list[int]:
    sampler = DistributedSampler(DATASET, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize(("saved_dp", "resumed_dp"), [(1, 1), (2, 2), (1, 2), (2, 1), (4, 2)])
def test_resumed_ranks_load_the_rest_of_the_epoch(saved_dp: int, resumed_dp: int) -> None:
    global_batch, epoch, batches_done = 4, 1, 2
    saved = loader(saved_dp, 0, global_batch // saved_dp, fit_loop(epoch, batches_done))
    state = saved.state_dict()
    assert state == {"epoch": epoch, "batches": batches_done, "global_batch_size": global_batch}

    rest = epoch_permutation(epoch)[batches_done * global_batch :]
    for rank in range(resumed_dp):
        resumed = loader(resumed_dp, rank, global_batch // resumed_dp, fit_loop(0, 0))
        resumed.load_state_dict(state)  # sets the sampler's epoch itself, before Lightning does
        assert len(resumed) == len(DATASET) // global_batch  # Lightning counts the epoch's batches from the start
        got = torch.cat(list(resumed)).tolist()
        assert got == rest[rank::resumed_dp], f"DP rank {rank} of {resumed_dp}"
        # only the first iteration after the resume skips
        assert torch.cat(list(resumed)).tolist() == epoch_permutation(epoch)[rank::resumed_dp]


@pytest.mark.parametrize("epoch_batches", [len(DATASET) // 4, 2])  # the whole loader; limit_train_batches=2
def test_a_checkpoint_from_the_end_of_an_epoch_skips_nothing(epoch_batches: int) -> None:
    state = loader(1, 0, 4, fit_loop(0, epoch_batches, epoch_batches)).state_dict()
    resumed = loader(1, 0, 4, fit_loop(0, 0))
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)  # as Lightning does at the start of the next epoch
    assert torch.cat(list(resumed)).tolist() == epoch_permutation(1)


def test_a_changed_global_batch_is_refused_inside_an_epoch() -> None:
    state = loader(2, 0, 2, fit_loop(0, 1)).state_dict()
    with pytest.raises(ValueError, match=r"global batch of 4 samples; this run's is 2 \(micro-batch 2 x 1 DP ranks\)"):
        loader(1, 0, 2, fit_loop(0, 0)).load_state_dict(state)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(DATASET)


def test_only_loaders_batched_by_torchs_batch_sampler_are_wrapped() -> None:
    assert is_resumable(DataLoader(DATASET, batch_size=2))
    assert not is_resumable(DataLoader(Stream(), batch_size=2))

    class BucketBatchSampler(BatchSampler):
        pass

    assert not is_resumable(DataLoader(DATASET, batch_sampler=BucketBatchSampler(SequentialSampler(DATASET), 2, False)))

    class StatefulLoader(DataLoader):
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    assert not is_resumable(StatefulLoader(DATASET, batch_size=2))
    assert not is_resumable([{"input_ids": torch.ones(1, 4)}])


def saved_loop_state(ready: int, started: int, processed: int, completed: int, steps: int) -> dict:
    """``checkpoint["loops"]["fit_loop"]`` as Lightning saves it, with 10 batches and 4 steps of earlier epochs."""

    def counters(offset: int) -> dict:
        return dict(
            ready=ready + offset, started=started + offset, processed=processed + offset, completed=completed + offset
        )

    step = {"total": dict(ready=steps + 4, completed=steps + 4), "current": dict(ready=steps, completed=steps)}
    return {
        "epoch_loop.batch_progress": {"total": counters(10), "current": counters(0), "is_last_batch": False},
        "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {"step": step}},
        "epoch_loop.state_dict": {"_batches_that_stepped": steps + 4},
    }


def test_a_checkpoint_inside_an_accumulation_resumes_at_the_steps_first_micro_batch() -> None:
    # 2 micro-batches a step, 1 step done; saved in the training step of batch 3 (batch 2 is accumulated, not applied)
    loop, state = fit_loop(0, steps=1, accumulate=2), saved_loop_state(4, 4, 3, 3, steps=1)
    assert resume_batch(loop) == 2
    rewind_to_step_boundary(state, loop, step_in_flight=False)
    assert state["epoch_loop.batch_progress"]["current"] == dict(ready=2, started=2, processed=2, completed=2)
    assert state["epoch_loop.batch_progress"]["total"] == dict(ready=12, started=12, processed=12, completed=12)
    assert state["epoch_loop.state_dict"]["_batches_that_stepped"] == 5  # the steps, as after batch 2's end


def test_a_checkpoint_after_the_step_is_left_as_lightning_resumes_it() -> None:
    loop, state = fit_loop(0, steps=2, accumulate=2), saved_loop_state(4, 4, 4, 3, steps=2)  # on_train_batch_end
    before = {key: dict(value) if isinstance(value, dict) else value for key, value in state.items()}
    rewind_to_step_boundary(state, loop, step_in_flight=False)
    assert state == before and resume_batch(loop) == 4


def test_a_checkpoint_inside_optimizer_step_counts_the_applied_step() -> None:
    loop, state = fit_loop(0, steps=1, accumulate=2), saved_loop_state(4, 4, 3, 3, steps=1)
    assert resume_batch(loop, step_in_flight=True) == 4
    rewind_to_step_boundary(state, loop, step_in_flight=True)
    assert state["epoch_loop.batch_progress"]["current"] == dict(ready=4, started=4, processed=4, completed=4)
    assert state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"] == {
        "total": dict(ready=6, completed=6),
        "current": dict(ready=2, completed=2),
    }
    assert state["epoch_loop.state_dict"]["_batches_that_stepped"] == 6
    with pytest.raises(RuntimeError, match="between the optimizer step and the learning-rate scheduler's step"):
        rewind_to_step_boundary(
            saved_loop_state(4, 4, 3, 3, steps=1), fit_loop(0, 1, accumulate=2, step_schedulers=1), step_in_flight=True
        )


def test_the_shorter_last_window_of_an_epoch_is_a_step_that_ends_the_epoch() -> None:
    # 5 batches, 2 micro-batches a step: steps at batches 2, 4 and 5 (the last one a window of one batch)
    loop, state = fit_loop(0, steps=2, epoch_batches=5, accumulate=2), saved_loop_state(5, 5, 4, 4, steps=2)
    assert resume_batch(loop) == 4  # saved in batch 5's training step: its window is redone
    assert resume_batch(loop, step_in_flight=True) == 0  # saved inside its optimizer step: the epoch is over
    rewind_to_step_boundary(state, loop, step_in_flight=True)
    assert state["epoch_loop.batch_progress"]["current"] == dict(ready=5, started=5, processed=5, completed=5)
    assert state["epoch_loop.batch_progress"]["is_last_batch"] is True
    assert state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["current"] == dict(
        ready=3, completed=3
    )
