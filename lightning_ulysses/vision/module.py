"""``VisionLanguageModel``: a transformers vision-language model as a LightningModule, under sequence parallelism.

What each step computes, and where:

1. **Whole sequence, on the host, before sharding** (``on_before_batch_transfer``):
   :func:`~lightning_ulysses.vision.batch.prepare_vision_batch` numbers every placeholder token with its embedding
   row, computes multimodal RoPE positions per document and masks the placeholders' labels.
2. **The strategy** pads and shards every per-token entry (``input_ids``, ``vision_rows``, ``mrope_position_ids``,
   ``position_ids``, ``shift_labels``) like text; the pixels travel whole to every SP rank.
3. **Each rank**: :func:`~lightning_ulysses.vision.embed.merged_inputs_embeds` encodes the items its shard needs and
   merges them into its ``[B, N/sp, hidden]`` embeddings; the language model runs on them with the global positions
   (``[4, B, N/sp]`` for mRoPE: the text positions, which number the documents, then temporal, height, width), and the
   loss is the exact token mean over the SP group, as for text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from transformers import AutoModelForImageTextToText, PreTrainedModel

from lightning_ulysses.model import CausalLM
from lightning_ulysses.vision.batch import MROPE_KEY, prepare_vision_batch
from lightning_ulysses.vision.embed import VISION_ENCODINGS, MergedInputs, VisionEncoding, merged_inputs
from lightning_ulysses.vision.families import VisionFamily, placeholders, vision_family


class VisionLanguageModel(CausalLM):
    """Next-token training of a transformers image-text-to-text model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA,
    Gemma 3) on text and images or video, loss on the text tokens; the arguments of
    :class:`~lightning_ulysses.CausalLM`, and:

    Args:
        vision_encoding: ``"shard"``: each SP rank encodes the images and videos with a placeholder in its shard
            (no communication; items cut by shard borders are encoded twice); ``"exchange"``: each SP rank encodes a
            share of the batch's items balanced by size, and the embeddings are all-gathered (vision compute per
            rank near ``1/sp_size`` of the batch's); ``"all"``: every rank encodes every item of the batch. All
            three are exact (see :mod:`lightning_ulysses.vision.embed`).

    Other vision-language families are refused at set-up (:func:`~lightning_ulysses.vision.families.vision_family`).
    The vision tower is never gradient-checkpointed (``gradient_checkpointing`` applies to the language model).
    """

    auto_class = AutoModelForImageTextToText

    def __init__(self, *args: Any, vision_encoding: VisionEncoding = "shard", **kwargs: Any) -> None:
        if vision_encoding not in VISION_ENCODINGS:
            raise ValueError(f"vision_encoding must be one of {VISION_ENCODINGS}, got {vision_encoding!r}.")
        super().__init__(*args, **kwargs)
        self.family: VisionFamily | None = None
        self._deepstack: MergedInputs | None = None
        """DeepStack families: the inputs of the next language-model call (see :meth:`_feed_deepstack`)."""

    def configure_model(self) -> None:
        if self.model is not None and self.family is not None:
            return
        super().configure_model()
        assert self.model is not None
        self.family = vision_family(self.model)
        for name in self.family.towers:  # recomputed in backward it would run patched (see merged_inputs_embeds)
            for module in getattr(self.model.model, name).modules():
                if hasattr(module, "gradient_checkpointing"):
                    module.gradient_checkpointing = False
        if self.family.deepstack_layers:
            inner: Any = self.model.model
            inner.language_model.register_forward_pre_hook(self._feed_deepstack, with_kwargs=True)

    def _feed_deepstack(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Forward pre-hook of a DeepStack family's language model: it receives the shard's ``visual_pos_masks
        [B, N/sp]`` and ``deepstack_visual_embeds`` (per layer ``[placeholders of the shard, hidden]``) that
        :meth:`model_inputs` merged, in place of what the model's own forward computes from whole-batch pixels
        (nothing: the model gets ``inputs_embeds``). Each merge feeds one call."""
        merged, self._deepstack = self._deepstack, None
        if merged is None:
            return None
        kwargs.update(visual_pos_masks=merged.visual_mask, deepstack_visual_embeds=merged.deepstack)
        return args, kwargs

    def on_fit_start(self) -> None:
        context = self._loss_context()
        bidirectional = self.family is not None and self.family.bidirectional_items
        if context is not None and bidirectional and context.groups.ring_size > 1:
            raise ValueError(
                f"{type(self.model).__name__}'s images attend to themselves bidirectionally, which Ulysses x Ring does "
                "not run (yet); use ring_size=1."
            )
        if context is not None and context.normalization == "global":
            raise ValueError(
                "VisionLanguageModel does not support loss_normalization='global' yet: its step token counts are read "
                "before the image placeholders are masked. Use loss_normalization='sp_group' (the default)."
            )

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.family is None:
            self.configure_model()
        assert self.family is not None and self.model is not None
        return prepare_vision_batch(batch, self.family, self.model.model)

    def model_inputs(self, model: PreTrainedModel, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``inputs_embeds [B, N/sp, hidden]`` with the images merged, ``position_ids`` (``[4, B, N/sp]`` for
        multimodal RoPE, the text positions first) and, where each image attends to itself bidirectionally (Gemma 3),
        ``token_type_ids [B, N/sp]`` (1 on placeholders), from which the patched model reads the image spans."""
        positions = batch["position_ids"]
        if MROPE_KEY in batch:
            positions = torch.cat([positions[None], batch[MROPE_KEY].permute(2, 0, 1)])
        assert self.family is not None
        context = self._loss_context()
        group = context.groups.sp if context is not None else None
        merged = merged_inputs(model, self.family, batch, self.hparams["vision_encoding"], group)
        if self.family.deepstack_layers:
            self._deepstack = merged  # fed to the language model by _feed_deepstack
        inputs = {"inputs_embeds": merged.embeds, "position_ids": positions}
        if self.family.bidirectional_items:
            inputs["token_type_ids"] = placeholders(batch["input_ids"], self.family).long()
        return inputs
