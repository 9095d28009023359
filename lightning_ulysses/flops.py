"""Training FLOPs of a dense decoder-only transformer, counted correctly for a sharded sequence.

A training step costs three forward passes (forward, then backward for activations and weights):

* every ``nn.Linear`` weight multiplies every token once: ``6 * matmul_params`` FLOPs per token;
* causal attention: each (query, key) pair inside a document costs ``2 * D`` FLOPs per head for ``q . k`` and
  ``2 * D_v`` for ``p @ v`` (``D_v = D`` but in multi-head latent attention: DeepSeek V3's 192 and 128); forward +
  backward, over all query heads and layers, ``12 * num_layers * num_heads * (D + D_v) / 2`` FLOPs per pair. A
  document of ``L`` tokens has ``L (L + 1) / 2`` pairs, so the term grows with the square of the sequence length.

Under Ulysses an SP group computes each sequence's attention exactly once: after the all-to-all every
rank holds all ``N`` tokens for ``heads / sp`` heads. Each device therefore does ``1 / sp`` of the
group's FLOPs, linear and attention alike; counting the ``n^2`` term on a rank's ``N / sp`` shard
would under-count it ``sp`` times. Embedding lookups, norms, activations and the softmax are not
counted (the convention of PaLM's MFU and of torchtitan).

Hybrid models: the attention term counts the softmax-attention layers only (those the set-up check planned, on a
patched model); their token mixers' projections are ``nn.Linear`` weights and counted like any other, but the
sequential kernels between them (depthwise convolutions, Mamba scans, delta rules, lightning attention) are not:
they are linear in the sequence length and, for the shipped families, small next to the projections (a short
convolution costs ``2 * kernel_size`` FLOPs per channel and token, against ``2 * hidden_size`` per output channel
of a projection), so MFU slightly under-states the work of a hybrid model.

MFU divides by the device's *dense* peak (:func:`dense_peak_flops`): NVIDIA's datasheets print the tensor-core
figures with 2:4 structured sparsity, twice what a dense matrix product can reach.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_ulysses.sharding import document_starts, positions_within_runs


def causal_attention_pairs(position_ids: Tensor) -> int:
    """The (query, key) pairs that causal document attention computes on whole sequences.

    Args:
        position_ids: ``[B, N]`` global position ids of whole (gathered) sequences; documents start
            at position 0 or in column 0, as in :mod:`lightning_ulysses.sharding`.

    Returns:
        ``sum over documents of L (L + 1) / 2``.
    """
    keys_per_query = positions_within_runs(document_starts(position_ids)) + 1
    return int(keys_per_query.sum())


@dataclass(frozen=True)
class TransformerFlops:
    """FLOP model of a dense decoder-only transformer (forward + backward).

    Invariant: ``batch_flops`` is the work of one SP group on one batch of whole sequences; each of
    its ``sp`` devices does ``1 / sp`` of it.
    """

    matmul_params: int
    """Weights of every ``nn.Linear`` (attention projections, MLP, LM head)."""
    num_layers: int
    """Softmax-attention layers (all decoder layers of a pure transformer)."""
    attention_dim: int
    """``num_attention_heads * (D + D_v) / 2`` (rounded down): the mean width of ``q . k`` and ``p @ v`` over all
    query heads."""

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> TransformerFlops:
        """Read the dimensions from a transformers model. Under ZeRO-3 the full (not partitioned) weight
        sizes are used. Mixture-of-experts models would be over-counted (every expert counts). On a model patched by
        :func:`~lightning_ulysses.hf.apply_ulysses_attention` the attention layers are those it planned (a hybrid's
        convolution, state-space and linear-attention layers are not), else every decoder layer."""
        config = model.config.get_text_config()
        matmul_params = sum(
            getattr(module.weight, "ds_numel", module.weight.numel())
            for module in model.modules()
            if isinstance(module, nn.Linear)
        )
        patched = "_ulysses_patch" in model.__dict__
        attention_layers = sum("_ulysses_plan" in m.__dict__ for m in model.modules()) if patched else None
        num_layers = config.num_hidden_layers if attention_layers is None else attention_layers
        if num_layers == 0:  # a state-space model: no attention heads to read
            return cls(matmul_params, 0, 0)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        qk_dim = getattr(config, "qk_head_dim", None) or head_dim  # MLA configs: their head_dim is the rotary part
        value_dim = getattr(config, "v_head_dim", None) or qk_dim
        return cls(matmul_params, num_layers, config.num_attention_heads * (qk_dim + value_dim) // 2)

    def batch_flops(self, position_ids: Tensor) -> int:
        """Training FLOPs of one batch of whole sequences, ``position_ids [B, N]`` (padding included:
        the model computes it)."""
        linear = 6 * self.matmul_params * position_ids.numel()
        attention = 12 * self.num_layers * self.attention_dim * causal_attention_pairs(position_ids)
        return linear + attention

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of one causal document of ``seq_len`` tokens."""
        pairs = seq_len * (seq_len + 1) // 2
        return 6 * self.matmul_params + 12 * self.num_layers * self.attention_dim * pairs / seq_len


TF = 1e12
# Dense peak FLOP/s per GPU, from NVIDIA's datasheets, whose tensor-core figures (marked there "with sparsity")
# are halved here: A100 Tensor Core GPU datasheet (SXM4 and PCIe alike); H100 Tensor Core GPU datasheet (SXM,
# PCIe, NVL); H200 Tensor Core GPU datasheet (SXM, NVL); HGX B200 specifications (8-GPU totals divided by 8).
# fp32 is the CUDA-core (non-tensor-core) rate; "tf32" is fp32 matrix products on tensor cores.
_DENSE_PEAK: dict[str, dict[torch.dtype | str, float]] = {
    "a100": {torch.bfloat16: 312 * TF, torch.float16: 312 * TF, "tf32": 156 * TF, torch.float32: 19.5 * TF},
    "h100 sxm": {torch.bfloat16: 989.5 * TF, torch.float16: 989.5 * TF, "tf32": 494.5 * TF, torch.float32: 67 * TF},
    "h100 pcie": {torch.bfloat16: 756.5 * TF, torch.float16: 756.5 * TF, "tf32": 378 * TF, torch.float32: 51 * TF},
    "h100 nvl": {torch.bfloat16: 835.5 * TF, torch.float16: 835.5 * TF, "tf32": 417.5 * TF, torch.float32: 60 * TF},
    "h200 sxm": {torch.bfloat16: 989.5 * TF, torch.float16: 989.5 * TF, "tf32": 494.5 * TF, torch.float32: 67 * TF},
    "h200 nvl": {torch.bfloat16: 835.5 * TF, torch.float16: 835.5 * TF, "tf32": 417.5 * TF, torch.float32: 60 * TF},
    "b200": {torch.bfloat16: 2250 * TF, torch.float16: 2250 * TF, "tf32": 1125 * TF, torch.float32: 75 * TF},
}


def dense_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s of one A100, H100, H200 or B200 for matrix products in ``dtype``; ``None`` for other devices.

    Args:
        device_name: as ``torch.cuda.get_device_name`` reports it, e.g. ``"NVIDIA H200"``,
            ``"NVIDIA H100 80GB HBM3"`` (SXM), ``"NVIDIA H100 PCIe"``, ``"NVIDIA H200 NVL"``,
            ``"NVIDIA A100-SXM4-80GB"``.
        dtype: the compute dtype of the matrix products (bf16, fp16 or fp32).
        tf32: fp32 products run on tensor cores (``torch.get_float32_matmul_precision() != "highest"``).
    """
    name = device_name.lower()
    family = re.search(r"\b(a100|h100|h200|b200)\b", name)  # word boundary: "GH200" is another device
    if family is None:
        return None
    chip = family[1]
    if chip in ("h100", "h200"):
        chip += " nvl" if "nvl" in name else " pcie" if "pcie" in name else " sxm"
    key = "tf32" if dtype == torch.float32 and tf32 else dtype
    return _DENSE_PEAK[chip].get(key)
