"""Long-context memory: tiled MLP, tiled logits + loss, activation checkpointing with CPU offload, fused norms.

Past a few hundred thousand tokens per rank, attention (O(N) with flash kernels) is no longer what
fills memory; other things are, and each has a remedy here (ALST's, made exact and ZeRO-safe):

* **Feed-forward intermediates** ``[tokens, intermediate]`` (``[tokens, top_k, intermediate]`` in a mixture of
  experts): :func:`tiled_map` runs a token-wise module over tiles of the sequence and recomputes each tile in the
  backward, so only one tile's intermediates live. ``tiled_mlp`` finds each decoder layer's feed-forward by what it
  does, dense MLP or MoE block alike, and tiles those whose tiles equal the whole call (:mod:`.feed_forward`).
* **Logits** ``[tokens, vocab]`` (1M x 128k x 4 B = 512 GB in fp32): :mod:`lightning_ulysses.logits`
  computes ``lm_head`` + cross entropy (or evaluation's per-token values) one tile at a time; the loss is
  a *sum*, which :class:`~lightning_ulysses.UlyssesLossMixin` turns into the exact token mean of the SP group.
* **Stored activations**: :func:`checkpoint_activations` keeps only each decoder layer's inputs and
  recomputes the rest in the backward; with ``offload=True`` those inputs wait in pinned CPU memory, copied
  on a side stream (:mod:`lightning_ulysses.offload`).
* **Norm intermediates**: ``fused_norms`` runs every RMSNorm, gated RMSNorm and LayerNorm as a fused norm
  (:mod:`lightning_ulysses.norms`: the same output, only its input and per-token statistics kept for the backward)
  where its forward is found to compute exactly that (:mod:`.norms`).

Every tile is a :func:`torch.utils.checkpoint.checkpoint` region inside one autograd graph, not a
backward-inside-forward as in DeepSpeed's ``TiledMLP`` / ``TiledFusedLogitsLoss``. So each parameter's
gradient is accumulated once per backward, as ZeRO's hooks expect, under any ZeRO stage and without
``ds_grad_is_ready``; and the loss gradient is scaled by whatever multiplies the loss afterwards
(DeepSpeed's fused loss computes ``lm_head``'s gradient in the forward, blind to later scaling, and its
``"mean"`` averages tile means instead of tokens). The price is one extra forward of each tile. Tile counts agree
across ranks (:mod:`lightning_ulysses.tiling`).

:func:`apply_memory_options` returns a :class:`~.report.MemoryReport` of what each asked option applies to (the
strategy logs it at fit start) and refuses an option that would apply to nothing.
"""

from lightning_ulysses.memory.options import (
    MEMORY_ATTRIBUTE,
    MemoryOptions,
    apply_memory_options,
    checkpoint_activations,
    remove_memory_options,
)
from lightning_ulysses.memory.report import MemoryReport, OptionReport, head_chunks_row, tiled_loss_row
from lightning_ulysses.tiling import (
    TileSetting,
    agree_max_tokens,
    recomputed_in_backward,
    resolve_num_tiles,
    tiled_map,
)

__all__ = [
    "MEMORY_ATTRIBUTE",
    "MemoryOptions",
    "MemoryReport",
    "OptionReport",
    "TileSetting",
    "agree_max_tokens",
    "apply_memory_options",
    "checkpoint_activations",
    "head_chunks_row",
    "recomputed_in_backward",
    "remove_memory_options",
    "resolve_num_tiles",
    "tiled_loss_row",
    "tiled_map",
]
