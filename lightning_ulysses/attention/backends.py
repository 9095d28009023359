"""The core attention backends by name, and the choice of one from the device and the dtype."""

from __future__ import annotations

import importlib.util

import torch

from lightning_ulysses.attention.core import CoreAttention
from lightning_ulysses.attention.cudnn import cudnn_attention_available, prefers_cudnn, sdpa_cudnn_attention
from lightning_ulysses.attention.documents import Documents
from lightning_ulysses.attention.flash import (
    FLASH_DTYPES,
    flash_attention_2,
    flash_attention_3,
    refuse_unsupported_dtype,
)
from lightning_ulysses.attention.flex import document_block_mask, flex_attention
from lightning_ulysses.attention.sdpa import packed_plan, sdpa_attention

CORE_ATTENTION: dict[str, CoreAttention] = {
    "sdpa": sdpa_attention,
    "flash_attention_2": flash_attention_2,
    "flash_attention_3": flash_attention_3,
    "flex_attention": flex_attention,
    "sdpa_cudnn": sdpa_cudnn_attention,
}
_REQUIRED_MODULE = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def resolve_attn_implementation(
    name: str, device_type: str, dtype: torch.dtype | None = None, capability: tuple[int, int] | None = None
) -> str:
    """Validate a backend name for ``device_type``, the compute ``dtype`` (``None``: not known yet) and the GPU's
    compute ``capability`` (``None``: not known).

    ``"auto"`` on CUDA in fp16/bf16 picks SDPA's cuDNN backend on Hopper and later (compute capability 9.0+) when
    torch has cuDNN, else flash-attn 2 when it is installed, else SDPA (which on CUDA runs its flash or
    memory-efficient kernel, GQA included, see :func:`~lightning_ulysses.attention.sdpa.needs_repeated_kv`); fp32 and
    CPU runs get SDPA. A flash or cuDNN backend asked for another dtype, and cuDNN asked without CUDA or without
    cuDNN in torch, are refused, naming what to change.
    """
    if name == "auto":
        if device_type != "cuda" or dtype not in FLASH_DTYPES:
            return "sdpa"
        if prefers_cudnn(dtype, capability):
            return "sdpa_cudnn"
        return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa"
    if name not in CORE_ATTENTION:
        refused = (
            " Eager attention materialises a [N, N] mask per head and is not supported." if name == "eager" else ""
        )
        raise ValueError(
            f"Unsupported attn_implementation {name!r}.{refused} Choose one of: 'auto', "
            + ", ".join(repr(k) for k in CORE_ATTENTION)
            + "."
        )
    if name == "sdpa_cudnn":
        if device_type != "cuda":
            raise ValueError(
                f"attn_implementation='sdpa_cudnn' runs on CUDA GPUs, and this run is on {device_type}: choose "
                "attn_implementation='sdpa' (or 'auto', which picks cuDNN on Hopper GPUs)."
            )
        if not cudnn_attention_available():
            raise ValueError(
                "attn_implementation='sdpa_cudnn' needs a torch built with cuDNN and its SDPA backend enabled "
                "(torch.backends.cuda.enable_cudnn_sdp(True)); choose attn_implementation='sdpa' otherwise."
            )
        if dtype is not None:
            refuse_unsupported_dtype(name, dtype)
    module = _REQUIRED_MODULE.get(name)
    if module is not None and importlib.util.find_spec(module) is None:
        raise ValueError(
            f"attn_implementation={name!r} needs the {module!r} package, which is not installed "
            "(pip install 'lightning-ulysses[flash]' on a CUDA machine), or choose 'sdpa'."
        )
    if module is not None and dtype is not None:
        refuse_unsupported_dtype(name, dtype)
    return name


def prepare_plans(name: str, documents: Documents, window: int | None) -> None:
    """Build the plan that backend ``name`` derives from ``documents`` for ``window`` (SDPA's length classes of
    packed rows, cuDNN's too, flex's block mask; the flash backends need none), so that no attention layer builds
    it."""
    if name in ("sdpa", "sdpa_cudnn") and not documents.one_per_row:
        packed_plan(documents)
    elif name == "flex_attention":
        document_block_mask(documents, window)
