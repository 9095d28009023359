"""The set-up check reads a module's ``forward`` signature (:func:`~lightning_ulysses.hf.plan.positional_parameters`,
:func:`~lightning_ulysses.hf.check.rope.is_rotary`) for the calls it records: once per method, and not at all where the
call's outputs or the module's weights already decide; the answers are those of ``inspect.signature``."""

from __future__ import annotations

import functools
import gc
import inspect
import weakref
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import lightning_ulysses.hf.check.rope as rope
import lightning_ulysses.hf.plan as plan
from lightning_ulysses.hf.check.rope import is_rotary
from lightning_ulysses.hf.check.tensors import Call
from lightning_ulysses.hf.plan import positional_parameters


def _traced(function: Any) -> Any:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return wrapper


class Block(nn.Module):
    @_traced  # read through ``__wrapped__``, as transformers' decorators are
    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, *, cache: Any = None) -> Tensor:
        return hidden_states


@pytest.fixture
def signature_reads(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The callables whose signature ``plan`` and ``rope`` read (both import ``inspect``)."""
    reads: list[Any] = []
    real = inspect.signature

    def counting(obj: Any, *args: Any, **kwargs: Any) -> inspect.Signature:
        reads.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(plan.inspect, "signature", counting)
    assert rope.inspect is plan.inspect
    return reads


def test_positional_parameters_are_read_once_per_method(signature_reads: list[Any]) -> None:
    blocks = [Block(), Block()]
    assert [positional_parameters(b) for b in blocks] == [("hidden_states", "attention_mask")] * 2
    assert len(signature_reads) == 1  # the second block's method has the first's function


def test_a_forward_set_on_the_instance_is_read_each_time(signature_reads: list[Any]) -> None:
    block = Block()
    block.forward = lambda x, y=None: x  # type: ignore[method-assign]
    assert positional_parameters(block) == ("x", "y")
    block.forward = lambda a, *rest: a  # type: ignore[method-assign]
    assert positional_parameters(block) == ("a",)
    assert len(signature_reads) == 2


def test_a_class_made_at_run_time_is_not_kept_alive() -> None:
    made = type("Made", (nn.Module,), {"forward": lambda self, tokens: tokens})
    assert positional_parameters(made()) == ("tokens",)
    assert made.forward in plan._METHOD_POSITIONAL_PARAMETERS
    function = weakref.ref(made.forward)
    del made
    gc.collect()
    assert function() is None


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
