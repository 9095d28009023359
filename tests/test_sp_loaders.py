"""The ranks of an SP group hold the same rows, whatever loader the user brings (:mod:`lightning_ulysses.sp_loaders`).

One launch of 4 CPU processes: a DataModule written for DDP (``DistributedSampler(dataset)`` over the world) trains
at dp=2 x sp=2 and at sp=4 exactly as one process on the DP ranks' rows, its samplers replaced and the replacement
logged; the check costs one all-gather of 2 numbers over the SP group per batch; loaders that give SP ranks
different rows (an IterableDataset sharded by global rank, a DistributedSampler subclass over the world) or the same
rows with other images (pixels augmented by rank, top-level or nested) are refused at their first batch on every
rank, naming the keys; ``seed_everything(workers=True)`` seeds each worker as Lightning's
``pl_worker_init_function`` does with the DP rank for the global rank.
"""

from __future__ import annotations

import logging
import os
import random
import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info

import lightning_ulysses.attention.documents as documents_module
from lightning_ulysses import UlyssesStrategy, sp_loaders
from lightning_ulysses.sp_loaders import (
    batch_fingerprint,
    batch_leaves,
    fork_can_deadlock,
    warn_on_forked_workers,
    worker_start_method,
)
from tests.launch import launch
from tests.test_strategy import _error, _trainer
from tests.tiny import VOCAB, TinyCausalLM, collate, make_samples, reference_training, relative_update_error, tiny_llama

pytestmark = pytest.mark.distributed

SEQ, NUM, BATCH, STEPS, LR = 16, 16, 2, 2, 0.5
WORLD_SIZE = 4
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "barrier",
)


class RecordingLM(TinyCausalLM):
    """Records the validation rows it sees (``index``) and the random rows of :class:`RandomRows`."""

    def __init__(self) -> None:
        super().__init__(lr=LR)
        self.val_rows: list[int] = []
        self.train_rows: list[dict[str, list]] = []

    def on_before_batch_transfer(self, batch: dict[str, Tensor], dataloader_idx: int) -> dict[str, Tensor]:
        if "worker_seed" in batch:  # the whole rows, before the strategy cuts them into shards
            self.train_rows.append({"worker_seed": batch["worker_seed"].tolist(), "input_ids": batch["input_ids"]})
        return batch

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.val_rows += batch["index"].tolist()


def _indexed_samples() -> list[dict[str, Tensor]]:
    return [{**sample, "index": torch.tensor(i)} for i, sample in enumerate(make_samples(NUM, SEQ))]


class DDPStyleData(L.LightningDataModule):
    """A DataModule written for DDP: its loaders build their own DistributedSampler over the whole world."""

    def train_dataloader(self) -> DataLoader:
        samples = make_samples(NUM, SEQ)
        return DataLoader(samples, batch_size=BATCH, collate_fn=collate, sampler=DistributedSampler(samples))

    def val_dataloader(self) -> DataLoader:
        samples = _indexed_samples()
        sampler = DistributedSampler(samples, shuffle=False)
        return DataLoader(samples, batch_size=BATCH, collate_fn=collate, sampler=sampler)


class RankSharded(IterableDataset):
    """Every ``world_size``-th sample from the global rank on: a shard per rank, as for DDP."""

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        yield from make_samples(NUM, SEQ)[dist.get_rank() :: dist.get_world_size()]


class RankAugmented(Dataset):
    """The same rows on every rank, but pixels augmented with a generator seeded by the global rank: at the top level
    (``pixel_values``) and nested (``vision.crops.1``)."""

    def __len__(self) -> int:
        return NUM

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = make_samples(NUM, SEQ)[index]
        noise = torch.Generator().manual_seed(1000 * dist.get_rank() + index)
        crops = [torch.ones(2, 2), torch.rand(2, 2, generator=noise)]
        return {**sample, "pixel_values": torch.rand(3, 4, 4, generator=noise), "vision": {"crops": crops}}


def collate_nested(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack the top-level tensors and each nested crop."""
    batch = {key: torch.stack([s[key] for s in samples]) for key in ("input_ids", "pixel_values")}
    crops = [torch.stack([s["vision"]["crops"][i] for s in samples]) for i in range(2)]
    return {**batch, "vision": {"crops": crops}}


class MyDistributedSampler(DistributedSampler):
    """A subclass over the world: the strategy cannot know how it samples, so only the check judges it."""


def random_row() -> Tensor:
    """A training row drawn from torch's, numpy's and Python's generators (as random augmentation would)."""
    ids = torch.randint(1, VOCAB, (SEQ,))
    ids[1] = int(np.random.randint(1, VOCAB))
    ids[2] = random.randint(1, VOCAB - 1)
    return ids


class RandomRows(Dataset):
    """Random rows, with the torch seed that the DataLoader gave the worker that drew them."""

    def __len__(self) -> int:
        return NUM

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": random_row(), "worker_seed": torch.tensor(get_worker_info().seed)}


class CollectiveCounter:
    """Counts the torch.distributed collectives called inside ``UlyssesStrategy.batch_to_device``."""

    def __init__(self, strategy: UlyssesStrategy) -> None:
        self.calls: list[list[tuple[str, int, list[int]]]] = []  # per batch: (collective, numel, group ranks)
        self.inside = False
        original = strategy.batch_to_device

        def counted_batch_to_device(*args: Any, **kwargs: Any) -> Any:
            self.calls.append([])
            self.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self.inside = False

        strategy.batch_to_device = counted_batch_to_device  # type: ignore[method-assign]
        self.originals = {name: getattr(dist, name) for name in COLLECTIVES}
        for name in COLLECTIVES:
            setattr(dist, name, self._counted(name))

    def _counted(self, name: str) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            if self.inside:
                tensor = args[1] if name == "all_gather" else (args[0] if args else None)
                group = kwargs.get("group")
                self.calls[-1].append(
                    (
                        name,
                        tensor.numel() if isinstance(tensor, Tensor) else 0,
                        dist.get_process_group_ranks(group) if group is not None else [],
                    )
                )
            return self.originals[name](*args, **kwargs)

        return collective

    def restore(self) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)


class PositionGathers:
    """Counts the all-gathers of position ids that finding the documents runs once a batch has been transferred
    (the set-up check's probes, before any batch, gather theirs)."""

    def __init__(self, strategy: UlyssesStrategy) -> None:
        self.count = 0
        self.original = documents_module.gather_sequence

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += strategy.sharded_batch is not None
            return self.original(*args, **kwargs)

        documents_module.gather_sequence = counted

    def restore(self) -> None:
        documents_module.gather_sequence = self.original


class InfoMessages(logging.Handler):
    """Collects the messages of Lightning's loggers (where ``rank_zero_info`` writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        for name in ("lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def worker(args: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    messages = InfoMessages()
    for sp in (2, 4):  # a DDP DataModule: trains as one process on the DP ranks' rows
        module = RecordingLM()
        strategy = UlyssesStrategy(sp_size=sp, stage=2, attn_implementation="sdpa")
        counter = CollectiveCounter(strategy) if sp == 2 else None
        gathers = PositionGathers(strategy) if sp == 2 else None
        messages.messages.clear()
        _trainer(WORLD_SIZE, strategy, max_steps=STEPS).fit(module, datamodule=DDPStyleData())
        if counter is not None and gathers is not None:
            counter.restore()
            gathers.restore()
            result["collectives"] = counter.calls
            result["position_gathers"] = gathers.count
        result[f"sp{sp}"] = {
            "losses": module.losses,
            "params": {n: p.detach().clone() for n, p in module.model.named_parameters()},
            "val_rows": module.val_rows,
            "dp_rank": strategy.dp_rank,
            "sp_rank": strategy.sp_rank,
            "sp_group": dist.get_process_group_ranks(strategy.sp_group),
            "messages": [m for m in messages.messages if "DistributedSampler" in m],
        }

    # refused at the first batch, on every rank
    module = RecordingLM()
    sharded = DataLoader(RankSharded(), batch_size=BATCH, collate_fn=collate)
    strategy = UlyssesStrategy(sp_size=2, stage=2, attn_implementation="sdpa")
    result["iterable_by_rank"] = _error(lambda: _trainer(WORLD_SIZE, strategy, max_steps=STEPS).fit(module, sharded))
    result["iterable_by_rank_steps"] = len(module.losses)
    samples = _indexed_samples()
    subclassed = DataLoader(
        samples, batch_size=BATCH, collate_fn=collate, sampler=MyDistributedSampler(samples, shuffle=False)
    )
    strategy = UlyssesStrategy(sp_size=2, stage=2, attn_implementation="sdpa")
    module = RecordingLM()
    trainer = _trainer(WORLD_SIZE, strategy)
    result["val_subclass"] = _error(lambda: trainer.validate(module, subclassed, verbose=False))
    result["val_subclass_rows"] = module.val_rows
    module = RecordingLM()
    augmented = DataLoader(RankAugmented(), batch_size=BATCH, collate_fn=collate_nested)
    strategy = UlyssesStrategy(sp_size=2, stage=2, attn_implementation="sdpa")
    result["pixels_by_rank"] = _error(lambda: _trainer(WORLD_SIZE, strategy, max_steps=STEPS).fit(module, augmented))
    result["pixels_by_rank_steps"] = len(module.losses)

    # seed_everything(workers=True): workers seeded by DP rank
    L.seed_everything(7, workers=True)
    module = RecordingLM()
    strategy = UlyssesStrategy(sp_size=2, stage=2, attn_implementation="sdpa")
    # started as the data modules start theirs (a fork server where a forked worker can hang), which seeds it alike
    loader = DataLoader(
        RandomRows(),
        batch_size=BATCH,
        collate_fn=collate,
        num_workers=1,
        multiprocessing_context=worker_start_method(1),
    )
    _trainer(WORLD_SIZE, strategy, max_steps=STEPS).fit(module, loader)
    os.environ.pop("PL_SEED_WORKERS")
    result["seeded"] = {"rows": module.train_rows, "dp_rank": strategy.dp_rank, "sp_rank": strategy.sp_rank}
    return result


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch("tests.test_sp_loaders:worker", WORLD_SIZE, {})


@pytest.mark.parametrize("sp", [2, 4])
def test_a_world_distributed_sampler_is_replaced_by_the_dp_one(results: list[dict[str, Any]], sp: int) -> None:
    dp = WORLD_SIZE // sp
    expected_losses, expected = reference_training(
        make_samples(NUM, SEQ), steps=STEPS, batch_size=BATCH, dp_size=dp, lr=LR
    )
    initial = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    for rank, result in enumerate(results):
        got = result[f"sp{sp}"]
        assert (got["dp_rank"], got["sp_rank"]) == (rank // sp, rank % sp)
        if got["dp_rank"] == 0:
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"rank {rank}: relative weight-update error {error:.2e}"
        # the sanity check's 2 validation batches: the DP ranks' rows of the unshuffled set
        assert got["val_rows"] == list(range(got["dp_rank"], NUM, dp))[: 2 * BATCH]
        if rank == 0:
            assert len(got["messages"]) == 2, got["messages"]
            for hook, message in zip(("val_dataloader", "train_dataloader"), got["messages"]):
                assert f"the {hook}'s DistributedSampler runs over all 4 ranks" in message
                assert f"now runs over the {dp} DP ranks" in message
        else:
            assert got["messages"] == []


def test_the_check_costs_one_small_all_gather_over_the_sp_group_per_batch(results: list[dict[str, Any]]) -> None:
    for result in results:
        calls = result["collectives"]
        assert len(calls) == STEPS + 2  # the sanity check's 2 validation batches, then the training steps
        for batch_calls in calls:
            assert batch_calls == [("all_gather", 2, result["sp2"]["sp_group"])]


def test_the_steps_read_the_documents_of_the_whole_batch_without_gathering_positions(
    results: list[dict[str, Any]],
) -> None:
    """The patched model's forward, in training and validation steps, finds its documents from the strategy's
    ShardedBatch (the whole position ids before they were cut), not by all-gathering its shard of them."""
    assert all(len(result["collectives"]) >= STEPS for result in results)  # the steps ran
    assert [result["position_gathers"] for result in results] == [0] * WORLD_SIZE


def test_sp_ranks_given_different_rows_are_refused_at_the_first_batch(results: list[dict[str, Any]]) -> None:
    for result in results:
        for key, hook in (("iterable_by_rank", "train_dataloader"), ("val_subclass", "val_dataloader")):
            message = result[key]
            assert message.startswith(f"ValueError: The {hook} gave the ranks of an SP group"), message
            assert "input_ids" in message and "num_replicas=trainer.strategy.dp_size" in message
            assert "use_distributed_sampler=True" in message
        assert result["iterable_by_rank_steps"] == 0 and result["val_subclass_rows"] == []


def test_sp_ranks_given_other_pixels_of_the_same_rows_are_refused_at_the_first_batch(
    results: list[dict[str, Any]],
) -> None:
    for result in results:
        message = result["pixels_by_rank"]
        assert message.startswith("ValueError: The train_dataloader gave the ranks of an SP group"), message
        assert "different batches: pixel_values, vision.crops.1 of SP rank(s) [1] differ" in message, message
        assert "built differently in each process" in message and "prepare_data" in message
        assert result["pixels_by_rank_steps"] == 0


def test_workers_are_seeded_by_dp_rank_as_lightning_seeds_them(results: list[dict[str, Any]]) -> None:
    by_coordinates = {(r["seeded"]["dp_rank"], r["seeded"]["sp_rank"]): r["seeded"]["rows"] for r in results}
    for dp_rank in (0, 1):
        rows = by_coordinates[dp_rank, 0]
        assert len(rows) == STEPS
        for batch, other in zip(rows, by_coordinates[dp_rank, 1]):
            assert torch.equal(batch["input_ids"], other["input_ids"]), "SP ranks of a group draw the same rows"
        # Lightning's pl_worker_init_function with the DP rank, from the torch seed the DataLoader gave the worker
        torch.manual_seed(rows[0]["worker_seed"][0])
        pl_worker_init_function(0, rank=dp_rank)
        expected = torch.stack([random_row() for _ in range(STEPS * BATCH)])
        torch.testing.assert_close(torch.cat([batch["input_ids"] for batch in rows]), expected, rtol=0, atol=0)
    first = [torch.cat([batch["input_ids"] for batch in by_coordinates[d, 0]]) for d in (0, 1)]
    assert not torch.equal(first[0], first[1]), "DP groups draw different rows"


def _summary(batch: Any) -> tuple[int, ...]:
    cpu = torch.device("cpu")
    return tuple(batch_fingerprint(batch, cpu).summary(cpu).tolist())


def test_fingerprints_tell_apart_rows_that_a_sum_would_not() -> None:
    row = torch.arange(1, 9)[None]
    variants = {
        "row": {"input_ids": row},
        "tokens permuted": {"input_ids": row.flip(1)},
        "two tokens swapped": {"input_ids": row[:, [1, 0, *range(2, 8)]]},
        "shifted by a column": {"input_ids": row.roll(1, dims=1)},
        "other shape": {"input_ids": row.view(2, 4)},
        "rows swapped": {"input_ids": torch.cat([row, row + 1]).flip(0)},
        "two rows": {"input_ids": torch.cat([row, row + 1])},
        "with labels": {"input_ids": row, "labels": row},
        "with the mask": {"input_ids": row, "attention_mask": torch.ones_like(row)},
        "with positions": {"input_ids": row, "position_ids": torch.arange(8)[None]},
        "other positions": {"input_ids": row, "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])},
        "a list": [row],
    }
    fingerprints = {name: _summary(batch) for name, batch in variants.items()}
    assert len(set(fingerprints.values())) == len(variants), fingerprints
    assert _summary({"input_ids": row.clone()}) == fingerprints["row"]


def test_fingerprints_cover_every_tensor_of_a_nested_batch_bit_for_bit() -> None:
    pixels = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    nudged = pixels.clone()
    nudged[1, 2, 3, 0] = torch.nextafter(nudged[1, 2, 3, 0], torch.tensor(2.0))  # one element, its last bit
    ids = torch.arange(1, 9)[None]

    def batch(pixel_values: Tensor = pixels, crops: tuple[Tensor, ...] = (pixels[1],), **extra: Any) -> dict:
        return {"input_ids": ids, "pixel_values": pixel_values, "vision": {"crops": [*crops], "sizes": (4, 4)}, **extra}

    variants = {
        "batch": batch(),
        "one pixel one ulp off": batch(nudged),
        "pixels as float64": batch(pixels.double()),
        "pixels as bfloat16": batch(pixels.bfloat16()),
        "a nested crop one ulp off": batch(crops=(nudged[1],)),
        "a nested crop more": batch(crops=(pixels[1], pixels[0])),
        "a nested size": {**batch(), "vision": {"crops": [pixels[1]], "sizes": (4, 5)}},
        "a text field": batch(text=["a b"]),
        "another text field": batch(text=["a c"]),
        "a boolean mask": batch(image_mask=pixels[:, 0] > 0.5),
        "another boolean mask": batch(image_mask=pixels[:, 0] > 0.4),
        "complex": batch(spectrum=torch.tensor([1 + 2j])),
        "other complex": batch(spectrum=torch.tensor([1 - 2j])),
    }
    variants["zeros"] = batch(torch.where(pixels > 0.5, pixels, torch.zeros(())))
    variants["negative zeros"] = batch(torch.where(pixels > 0.5, pixels, -torch.zeros(())))
    fingerprints = {name: _summary(b) for name, b in variants.items()}
    assert len(set(fingerprints.values())) == len(variants), fingerprints
    # equal batches agree: other objects, other key order
    reordered = {
        "vision": {"sizes": (4, 4), "crops": [pixels[1].clone()]},
        "pixel_values": pixels.clone(),
        "input_ids": ids,
    }
    assert _summary(reordered) == fingerprints["batch"]
    assert [path for path, _ in batch_leaves(batch())] == [
        "input_ids",
        "pixel_values",
        "vision.crops.0",
        "vision.sizes.0",
        "vision.sizes.1",
    ]


def test_a_tensor_hashed_in_steps_has_the_fingerprint_of_one_step(monkeypatch: pytest.MonkeyPatch) -> None:
    pixels = torch.rand(3, 5, 7, generator=torch.Generator().manual_seed(0))
    whole = sp_loaders.tensor_fingerprint(pixels)
    monkeypatch.setattr(sp_loaders, "HASHED_AT_ONCE", 4)  # 27 steps, the last one shorter
    assert sp_loaders.tensor_fingerprint(pixels) == whole
    swapped = pixels.flatten()[[*range(96), 97, 96, *range(98, 105)]].view(3, 5, 7)  # two elements of a late step
    assert sp_loaders.tensor_fingerprint(swapped) != whole


@pytest.mark.parametrize(
    ("version", "implementation", "can_hang"),
    [
        ((3, 10, 14), "cpython", True),
        ((3, 10, 15), "cpython", False),
        ((3, 11, 7), "cpython", True),
        ((3, 11, 10), "cpython", False),
        ((3, 12, 0), "cpython", False),
        ((3, 11, 7), "pypy", False),
    ],
)
def test_the_releases_whose_fork_can_hang_are_known(
    version: tuple[int, int, int], implementation: str, can_hang: bool
) -> None:
    assert fork_can_deadlock(version, implementation) is can_hang


def test_forked_workers_are_warned_of_where_a_fork_can_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    forking = DataLoader(range(4), num_workers=2)
    monkeypatch.setattr(sp_loaders, "fork_can_deadlock", lambda: True)
    with pytest.warns(UserWarning, match=r"train_dataloader forks 2 worker.*gh-112275.*3\.11\.10.*num_workers=0"):
        warn_on_forked_workers(forking, "train_dataloader")
    in_process, by_forkserver = (
        DataLoader(range(4)),
        DataLoader(range(4), num_workers=2, multiprocessing_context="forkserver"),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for loader in (in_process, by_forkserver):
            warn_on_forked_workers(loader, "train_dataloader")
        monkeypatch.setattr(sp_loaders, "fork_can_deadlock", lambda: False)
        warn_on_forked_workers(forking, "train_dataloader")


def test_the_data_modules_start_method_is_a_fork_server_only_where_a_fork_can_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for can_hang in (True, False):
        monkeypatch.setattr(sp_loaders, "fork_can_deadlock", lambda can_hang=can_hang: can_hang)
        assert worker_start_method(0) is None
        assert worker_start_method(2) == ("forkserver" if can_hang else None)
