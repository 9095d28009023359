"""The core attention backends by name, and the choice of one from the device and the dtype."""

from __future__ import annotations

import importlib.util

import torch

from lightning_ulysses.attention.core import CoreAttention
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
}
_REQUIRED_MODULE = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def resolve_attn_implementation(name: str, device_type: str, dtype: torch.dtype | None = None) -> str:
    """Validate a backend name for ``device_type`` and the compute ``dtype`` (``None``: not known yet).

    ``"auto"`` picks flash-attn 2 on CUDA for fp16/bf16 when it is installed, else SDPA (which on CUDA runs its
    flash or memory-efficient kernel, GQA included, see :func:`~lightning_ulysses.attention.sdpa.needs_repeated_kv`).
    A flash backend asked for another dtype is refused, naming what to change.
    """
    if name == "auto":
        runs_flash = dtype in FLASH_DTYPES and importlib.util.find_spec("flash_attn") is not None
        return "flash_attention_2" if device_type == "cuda" and runs_flash else "sdpa"
    if name not in CORE_ATTENTION:
        refused = (
            " Eager attention materialises a [N, N] mask per head and is not supported." if name == "eager" else ""
        )
        raise ValueError(
            f"Unsupported attn_implementation {name!r}.{refused} Choose one of: 'auto', "
            + ", ".join(repr(k) for k in CORE_ATTENTION)
            + "."
        )
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
    packed rows, flex's block mask; the flash backends need none), so that no attention layer builds it."""
    if name == "sdpa" and not documents.one_per_row:
        packed_plan(documents)
    elif name == "flex_attention":
        document_block_mask(documents, window)
