"""Batch preparation and sharding: padding, global positions, labels shifted before sharding."""

import pytest
import torch

from lightning_ulysses.sharding import IGNORE_INDEX, document_starts, prepare_batch, shard_batch

X = IGNORE_INDEX


def test_shift_before_sharding_keeps_the_label_at_each_shard_border() -> None:
    ids = torch.arange(10, 18).view(1, 8)
    prepared = prepare_batch({"input_ids": ids}, sp_size=2)
    shards = [shard_batch(prepared, r, 2) for r in range(2)]
    assert shards[0]["shift_labels"].tolist() == [[11, 12, 13, 14]]  # 14 lives on rank 1: kept
    assert shards[1]["shift_labels"].tolist() == [[15, 16, 17, X]]
    assert shards[0]["position_ids"].tolist() == [[0, 1, 2, 3]]
    assert shards[1]["position_ids"].tolist() == [[4, 5, 6, 7]]  # global, not 0..3
    assert "labels" not in shards[0]


def test_length_is_padded_to_a_multiple_of_sp_and_padding_is_out_of_the_loss() -> None:
    ids = torch.arange(1, 8).view(1, 7)
    labels = ids.clone()
    prepared = prepare_batch({"input_ids": ids, "labels": labels, "extra": torch.ones(1, 7, 3)}, sp_size=4)
    assert prepared["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
    assert prepared["shift_labels"].tolist() == [[2, 3, 4, 5, 6, 7, X, X]]
    assert prepared["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 0]]  # the pad starts its own document
    assert prepared["extra"].shape == (1, 8, 3) and prepared["extra"][0, 7].abs().sum() == 0
    assert [shard_batch(prepared, r, 4)["extra"].shape for r in range(4)] == [(1, 2, 3)] * 4


def test_left_and_right_padding_become_separate_documents() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    ids = torch.arange(12).view(2, 6) + 1
    prepared = prepare_batch({"input_ids": ids, "attention_mask": mask}, sp_size=2)
    assert prepared["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 0, 1]]
    assert prepared["shift_labels"].tolist() == [[X, X, 4, 5, 6, X], [8, 9, 10, X, X, X]]
    assert prepared["attention_mask"].tolist() == mask.tolist()


def test_packed_documents_keep_their_positions_and_do_not_predict_across_borders() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    prepared = prepare_batch({"input_ids": torch.arange(1, 9).view(1, 8), "position_ids": positions}, sp_size=2)
    assert prepared["position_ids"].tolist() == positions.tolist()
    assert prepared["shift_labels"].tolist() == [[2, 3, X, 5, X, 7, 8, X]]
    assert document_starts(positions).tolist() == [[True, False, False, True, False, True, False, False]]


def test_a_row_can_start_mid_document() -> None:
    positions = torch.tensor([[100, 101, 102, 103]])
    starts = document_starts(positions)
    assert starts.tolist() == [[True, False, False, False]]


def test_per_sample_values_pass_through_unchanged() -> None:
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "weight": torch.tensor([1.0, 2.0]), "name": ["a", "b"]}
    shard = shard_batch(prepare_batch(batch, 2), 1, 2)
    assert shard["weight"].tolist() == [1.0, 2.0] and shard["name"] == ["a", "b"]


def test_unshardable_inputs_are_refused_with_their_shapes() -> None:
    with pytest.raises(TypeError, match="dict batches .* got a tuple"):
        prepare_batch((torch.ones(2, 4),), 2)
    with pytest.raises(ValueError, match=r"'input_ids' as a \[batch, seq\] tensor; got \(8,\)"):
        prepare_batch({"input_ids": torch.ones(8)}, 2)
    with pytest.raises(ValueError, match=r"Cannot shard batch entry 'pixel_values' with shape \(2, 3, 5\)"):
        prepare_batch({"input_ids": torch.ones(2, 4, dtype=torch.long), "pixel_values": torch.ones(2, 3, 5)}, 2)


def test_padding_inside_a_row_that_positions_continue_across_is_refused() -> None:
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]])
    with pytest.raises(ValueError, match="row 0 has padding inside the sequence, before column 4"):
        prepare_batch({"input_ids": torch.ones(1, 6, dtype=torch.long), "attention_mask": mask}, 2)
    # the same gap between packed documents is fine: the document after it restarts at 0
    positions = torch.tensor([[0, 1, 0, 0, 0, 1]])
    prepared = prepare_batch(
        {"input_ids": torch.ones(1, 6, dtype=torch.long), "attention_mask": mask, "position_ids": positions}, 2
    )
    assert prepared["position_ids"].tolist() == [[0, 1, 0, 1, 0, 1]]
