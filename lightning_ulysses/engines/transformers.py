"""transformers' private names that lightning-ulysses uses, each with the reason (see
:mod:`lightning_ulysses.engines`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from transformers import PretrainedConfig, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

ATTN_IMPLEMENTATION_ATTRIBUTE = "_attn_implementation_internal"
"""Where a config keeps its own attention implementation, the ``ALL_ATTENTION_FUNCTIONS`` key its layers call. The
patch sets it on each config by itself (and restores each config's own value): the setter of
``config._attn_implementation`` (private too) recurses into the sub-configs, and ``model.set_attn_implementation``
accepts only the kernels transformers knows."""

LOSS_FUNCTION_ATTRIBUTE = "_loss_function"
"""The instance attribute behind ``PreTrainedModel.loss_function``'s setter (the property has no deleter): present in
the model's ``__dict__`` when a loss function of the user's own replaces the class's, deleted to restore the class's."""


def attn_implementation(config: PretrainedConfig) -> str | None:
    """The attention implementation ``config``'s layers run (``config._attn_implementation``; transformers has no
    public reader)."""
    return config._attn_implementation


def set_own_attn_implementation(config: PretrainedConfig, implementation: str | None) -> None:
    """Set ``config``'s attention implementation, not its sub-configs' (see :data:`ATTN_IMPLEMENTATION_ATTRIBUTE`)."""
    setattr(config, ATTN_IMPLEMENTATION_ATTRIBUTE, implementation)


def unregister_mask_interface(name: str) -> None:
    """Undo ``ALL_MASK_ATTENTION_FUNCTIONS.register(name, ...)``: ``register`` writes the class-wide
    ``_global_mapping``, which ``del ALL_MASK_ATTENTION_FUNCTIONS[name]`` (the instance's local mapping) does not
    reach."""
    del ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[name]


def enable_gradient_checkpointing(model: PreTrainedModel, function: Callable[..., Any]) -> None:
    """Checkpoint the activations of ``model``'s layers with ``function``, a checkpoint function of our own: the public
    ``gradient_checkpointing_enable`` takes none (it builds ``torch.utils.checkpoint`` itself, and pins memory on
    CPU-only hosts); ``_set_gradient_checkpointing`` is what it calls."""
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=function)


def disable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Undo :func:`enable_gradient_checkpointing`, by the same private method (the call the public
    ``activation_checkpointing_disable`` makes)."""
    model._set_gradient_checkpointing(enable=False)


def rnn_scan(lru: Any, hidden_states: Tensor, recurrent_gate: Tensor, reset: Tensor) -> Tensor:
    """RecurrentGemma's linear recurrence over the sequence (``RecurrentGemmaRglru._rnn_scan``, from no initial state),
    reused by the sequence-sharded RG-LRU so that the scan is transformers' own."""
    out, _ = lru._rnn_scan(
        hidden_states=hidden_states, recurrent_gate=recurrent_gate, reset=reset, recurrent_states=None
    )
    return out
