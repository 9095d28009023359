"""Analytic activation memory per token of a Llama-style decoder under the memory options.

What autograd keeps alive per token of a rank at the training step's peak, by component (sizes in elements per
token, times the activation dtype's bytes). One decoder layer keeps:

* norms and residual stream: each of the 2 RMSNorms keeps its normalised input and its output, and each of the
  2 residual sums is a new ``[tokens, hidden]`` tensor: ``6 * hidden``;
* attention: ``q`` (rotated), ``k``, ``v``, the kernel's output and its contiguous copy into ``o_proj``
  (``3 * hidden + 2 * kv_dim``) plus the kernel's fp32 log-sum-exp per head. Fused kernels (flash, SDPA's
  fused ones, compiled flex) keep nothing that grows with ``N`` per token; SDPA's math kernel would add
  ``[heads / sp, N]`` fp32 scores and probabilities per token (not counted);
* MLP: gate, ``silu(gate)``, up and their product, ``4 * intermediate``.

The logits and the loss: ``[tokens, vocab]`` logits, then in the backward the saved log-softmax, the gradient
of the loss and the gradient of the logits exist at once, three fp32 ``vocab``-vectors per token
(``12 * vocab`` bytes). With the options, per token:

* ``activation_checkpointing``: each layer keeps only its input (``hidden``); one layer at a time is
  recomputed in the backward, so its activations plus gradients are alive for that layer only;
* ``tiled_mlp``: the MLP's ``4 * intermediate`` go to a fixed per-tile buffer;
* ``tiled_loss``: the logits term goes to a fixed per-tile buffer (``tile = hidden`` tokens: the size of the
  ``lm_head`` weight, in fp32, three times);
* ``offload_activations``: the checkpointed inputs wait in host memory.

Left out, so that this is the slope of peak memory in the tokens of a rank (what decides the longest sequence) and
not a prediction of a device's peak: everything that does not grow with the tokens (weights, their gradients and
the optimizer states, however ZeRO partitions them; per-tile buffers; the all-to-all buffers of one layer), and the
layers' differences from a dense Llama decoder (a mixture of experts' routed intermediates, a hybrid model's
state-space or convolution layers are read as dense layers of the config's ``intermediate_size``). docs/memory.md
compares it with the slopes that the CPU benchmark measures (``python -m benchmarks.memory_model --benchmark``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from transformers import PretrainedConfig


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a decoder-only transformer that its activation memory per token depends on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one layer's matrix products (attention projections and a gated MLP)."""
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_dim
        return attention + 3 * self.hidden * self.intermediate

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> DecoderShape | None:
        """The shape of a transformers config's text model (``get_text_config``), or ``None`` when it does not
        state the sizes of a decoder (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``vocab_size``; ``num_key_value_heads`` and ``head_dim`` default as in Llama)."""
        text = config.get_text_config()
        names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        sizes = [getattr(text, name, None) for name in names]
        if not all(isinstance(size, int) and size > 0 for size in sizes):
            return None
        hidden, intermediate, layers, heads, vocab = cast(list[int], sizes)
        kv_heads: int = getattr(text, "num_key_value_heads", None) or heads
        head_dim: int = getattr(text, "head_dim", None) or hidden // heads
        return cls(hidden, intermediate, layers, heads, kv_heads, head_dim, vocab)


def components(shape: DecoderShape, element_bytes: int) -> dict[str, float]:
    """Bytes per token of a rank for each component (layer terms are per layer)."""
    h, b = shape.hidden, element_bytes
    return {
        "checkpointed inputs (all layers)": shape.layers * h * b,
        "norms + residual stream (per layer)": 6 * h * b,
        "attention (per layer)": (3 * h + 2 * shape.kv_dim) * b + 4 * shape.heads,
        "MLP intermediates (per layer)": 4 * shape.intermediate * b,
        "logits + loss": 12 * shape.vocab,
    }


def peak_bytes_per_token(
    shape: DecoderShape,
    element_bytes: int,
    *,
    tiled_mlp: bool = False,
    tiled_loss: bool = False,
    checkpointing: bool = False,
    offload: bool = False,
) -> float:
    """Slope of the step's peak memory in the tokens of a rank (bytes per token), under the options."""
    c = components(shape, element_bytes)
    mlp = 0 if tiled_mlp else c["MLP intermediates (per layer)"]
    layer = c["norms + residual stream (per layer)"] + c["attention (per layer)"] + mlp
    logits = 0 if tiled_loss else c["logits + loss"]
    final = 3 * shape.hidden * element_bytes  # the final norm's input, normalised input and output
    if not checkpointing:
        return shape.layers * layer + final + logits
    inputs = 0 if offload else c["checkpointed inputs (all layers)"]
    # the logits' backward and the layers' backward come one after the other: the larger one sets the peak
    return inputs + final + max(logits, layer)
