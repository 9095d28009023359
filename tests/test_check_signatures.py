"""The set-up check reads a module's ``forward`` signature (:func:`~lightning_ulysses.hf.check.rope.is_rotary`) only
where the call's outputs and the module's weights leave the question open."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import lightning_ulysses.hf.check.rope as rope
from lightning_ulysses.hf.check.rope import is_rotary
from lightning_ulysses.hf.check.tensors import Call


@pytest.fixture
def signature_reads(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The callables whose signature ``rope`` reads."""
    reads: list[Any] = []
    real = inspect.signature

    def counting(obj: Any, *args: Any, **kwargs: Any) -> inspect.Signature:
        reads.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(rope.inspect, "signature", counting)
    return reads


def test_rotary_module_is_told_and_a_weighted_one_without_reading_its_signature(signature_reads: list[Any]) -> None:
    config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2)
    rotary = LlamaRotaryEmbedding(config)
    hidden, positions = torch.randn(1, 5, 16), torch.arange(5)[None]
    cos_sin = list(rotary(hidden, positions))
    assert is_rotary(rotary, Call({}, cos_sin, (hidden, positions), {}))
    assert len(signature_reads) == 1

    weighted = nn.Bilinear(5, 5, 5)  # weights: never rotary, whatever it maps
    assert not is_rotary(weighted, Call({}, cos_sin, (hidden,), {"position_ids": positions}))
    one_output = Call({}, cos_sin[:1], (hidden, positions), {})
    assert not is_rotary(rotary, one_output)
    assert len(signature_reads) == 1
