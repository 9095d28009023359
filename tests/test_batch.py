"""ShardedBatch: a loader batch cut to one rank's shards, with the documents of its whole positions (no all-gather)."""

from __future__ import annotations

import inspect

import pytest
import torch
from lightning.fabric.utilities.types import _Stateful

import lightning_ulysses.attention.documents as documents_module
from lightning_ulysses.attention import Documents
from lightning_ulysses.batch import ShardedBatch, shard_loader_batch
from lightning_ulysses.hf import apply_ulysses_attention
from lightning_ulysses.loss import StepTokenCounts
from lightning_ulysses.runtime.eval_data import MarkDuplicates, RepeatedRows
from lightning_ulysses.sharding import IGNORE_INDEX, prepare_batch, shard_batch
from tests.tiny import tiny_llama


@pytest.mark.parametrize("ring_size", [1, 2])
def test_the_shards_are_shard_batch_s_and_the_documents_are_of_the_whole_rows(ring_size: int) -> None:
    ids = torch.arange(1, 15).view(2, 7)
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]])
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    prepared = prepare_batch(batch, sp_size=4, ring_size=ring_size)
    for rank in range(4):
        sharded = shard_loader_batch(batch, rank, 4, ring_size, repeated_rows=torch.tensor([False, True]))
        expected = shard_batch(prepared, rank, 4, ring_size)
        assert sharded.inputs.keys() == expected.keys()
        assert torch.equal(sharded.inputs["input_ids"], expected["input_ids"])
        assert torch.equal(sharded.inputs["position_ids"], expected["position_ids"])
        assert torch.equal(sharded.inputs["shift_labels"][0], expected["shift_labels"][0])
        assert (sharded.inputs["shift_labels"][1] == IGNORE_INDEX).all()  # a repeated row counts nowhere
        padding = shard_batch({"input_ids": prepared["attention_mask"] == 0}, rank, 4, ring_size)["input_ids"]
        assert torch.equal(sharded.padding, padding)  # the mask's zeros and the appended columns
        assert torch.equal(sharded.position_ids, prepared["position_ids"]) and sharded.loaded_shape == (2, 7)
        whole = Documents.from_position_ids(prepared["position_ids"])
        assert sharded.documents().offsets == whole.offsets and sharded.documents() is sharded.documents()


def _gathers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the all-gathers of position ids that finding a forward's documents runs."""
    calls: list[int] = []
    gather = documents_module.gather_sequence

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return gather(*args, **kwargs)

    monkeypatch.setattr(documents_module, "gather_sequence", counted)
    return calls


def test_a_forward_on_the_strategy_s_batch_reads_its_documents_without_a_gather(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1]])
    batch = {"input_ids": torch.arange(16).view(2, 8) % 50 + 1, "position_ids": positions}
    sharded: list[ShardedBatch] = [shard_loader_batch(batch, 0, 1)]
    model = tiny_llama()
    apply_ulysses_attention(model, None, sp_size=1, core="sdpa", batches=lambda: sharded[0])  # groups of one rank
    inputs = sharded[0].inputs
    calls = _gathers(monkeypatch)
    with_batch = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits
    assert calls == [] and None in sharded[0].documents_by_chunk  # found from the batch's whole rows

    other = inputs["position_ids"].clone()  # the same values, not the strategy's tensor: found equal, no gather
    assert torch.equal(model(input_ids=inputs["input_ids"], position_ids=other).logits, with_batch)
    assert calls == []

    sharded[0] = shard_loader_batch({**batch, "position_ids": torch.arange(8).expand(2, 8)}, 0, 1)
    again = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits  # not the batch's
    assert calls == [1] and torch.equal(again, with_batch)


def test_step_token_counts_queue_each_batch_s_step_count_in_order() -> None:
    batches = [{"input_ids": torch.ones(1, n, dtype=torch.long)} for n in (3, 5, 2, 4, 6)]
    loader = StepTokenCounts(batches, accumulate=2, remaining_batches=lambda: float("inf"))
    seen = []
    for batch in loader:
        assert batch.keys() == {"input_ids"}  # the batch as loaded: no key of the package's
        seen.append(loader.take())
    assert seen == [2 + 4, 2 + 4, 1 + 3, 1 + 3, 5]
    with pytest.raises(RuntimeError, match="did not yield"):
        loader.take()


class _StatefulBatches(list):
    def state_dict(self) -> dict[str, int]:
        return {"batches": 2}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded = state


def test_step_token_counts_keep_the_loader_s_state_where_lightning_looks() -> None:
    """Lightning saves and restores a training loader's state only when it is an instance of its runtime protocol
    ``_Stateful``, which Python 3.12 checks with ``inspect.getattr_static`` (no ``__getattr__``): the wrapped loader's
    ``state_dict`` / ``load_state_dict`` must be found so, or a mid-epoch resume restarts the epoch's sampler."""
    inner = _StatefulBatches([{"input_ids": torch.ones(1, 3, dtype=torch.long)}])
    loader = StepTokenCounts(inner, accumulate=2, remaining_batches=lambda: float("inf"))
    assert isinstance(loader, _Stateful)
    assert inspect.getattr_static(loader, "state_dict")() == {"batches": 2}
    inspect.getattr_static(loader, "load_state_dict")({"batches": 1})
    assert inner.loaded == {"batches": 1}
    plain = StepTokenCounts(list(inner), accumulate=2, remaining_batches=lambda: float("inf"))
    assert not isinstance(plain, _Stateful)  # a loader without state stays one


def test_evaluation_repeats_are_noted_beside_the_batch_not_in_it() -> None:
    repeated = RepeatedRows()
    batches = [{"input_ids": torch.ones(2, 3, dtype=torch.long)} for _ in range(4)]
    out = list(MarkDuplicates(batches, unique=5, repeated_rows=repeated))
    assert [batch.keys() for batch in out] == [{"input_ids"}] * 4  # as the loader made them
    assert repeated.take(out[0]["input_ids"]) is None  # rows 0, 1: no repeats
    taken = repeated.take(out[3]["input_ids"])  # the batch of rows 4, 5 was never transferred: forgotten
    assert taken is not None and taken.tolist() == [True, True]
    assert repeated.take(out[2]["input_ids"]) is None and repeated.take(out[3]["input_ids"]) is None
