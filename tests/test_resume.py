"""The resumable training loader, without processes: what a resumed rank loads after a mid-epoch checkpoint.

The multi-process proof (resumed runs equal uninterrupted ones) is in tests/test_checkpoint.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from lightning_ulysses.resume import ResumableLoader, is_resumable

DATASET = list(range(24))


def fit_loop(epoch: int, batches: int, epoch_batches: float = float("inf")) -> SimpleNamespace:
    """The counters of Lightning's fit loop that the loader reads."""
    return SimpleNamespace(
        epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=epoch)),
        epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=SimpleNamespace(ready=batches))),
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

    rest = epoch_permutation(epoch)[batches_done * global_batch:]
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
