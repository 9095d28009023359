"""The vision-language families that train under sequence parallelism, and how each one's images become embeddings.

A family is told by its config's ``model_type``. Each supported one is described by a :class:`VisionFamily`: the
placeholder token of each modality (image, video), where the batch holds each item's pixels, how many embedding rows
each item fills (its placeholder tokens, in order), how a subset of the items is encoded (the model's own
``get_image_features`` / ``get_video_features``: vision tower and projector), and, for multimodal RoPE, how the
positions of one document are computed (the model's own ``get_rope_index``), and whether an item's placeholders attend
to each other bidirectionally (Gemma 3). Every other vision-language model is
refused for vision inputs by :func:`vision_family`, with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_ulysses.hf.state import UnsupportedModelError


@dataclass(frozen=True)
class Modality:
    """One kind of vision input: its placeholder token and the batch keys of its pixels and grids."""

    name: str
    token_id: int
    pixels_key: str
    grid_key: str | None = None
    type_id: int = 1
    """Its value in ``mm_token_type_ids`` (text 0, image 1, video 2), as Qwen-VL's ``get_rope_index`` reads them."""


class VisionFamily:
    """How one family's vision inputs fill its placeholder tokens. Items are numbered per modality, in batch order.

    ``inner`` is the model's base (``model.model``), which holds ``get_image_features`` and ``get_rope_index``.
    """

    mrope = False
    """Positions are multimodal RoPE: ``[3, N]`` per document (temporal, height, width) from ``get_rope_index``."""
    towers: tuple[str, ...] = ()
    """Attribute names of the modules on ``inner`` that encode vision inputs (never sequence-sharded)."""
    bidirectional_items = False
    """Each item's run of placeholders attends to itself both ways (Gemma 3): the model is given ``token_type_ids``
    (``1`` on placeholders), which the set-up check found make its masks so
    (:mod:`lightning_ulysses.hf.check.spans`)."""
    deepstack_layers = 0
    """DeepStack (Qwen3-VL): :meth:`encode` returns ``1 + deepstack_layers`` blocks of ``hidden`` columns per row,
    the input embedding then the features that the first ``deepstack_layers`` decoder layers add to their output."""

    def __init__(self, modalities: tuple[Modality, ...]) -> None:
        self.modalities = modalities

    def item_pixels(self, vision: Mapping[str, Any], modality: Modality, items: Sequence[int]) -> Tensor:
        """The pixels of ``items``, concatenated as the model takes several of them."""
        return vision[modality.pixels_key][list(items)]

    def feature_rows(self, vision: Mapping[str, Any], modality: Modality, placeholders: int) -> list[int]:
        """Embedding rows (placeholder tokens) of each item of ``modality`` in the batch."""
        raise NotImplementedError

    def item_runs(self, vision: Mapping[str, Any], modality: Modality) -> list[int]:
        """Runs of consecutive placeholders that each item of ``modality`` fills in the sequence (1 per item but
        for Qwen3-VL's videos, one run per frame, separated by timestamp text)."""
        return [1] * len(self.feature_rows(vision, modality, 0))

    def encode(self, inner: nn.Module, vision: Mapping[str, Any], modality: Modality, items: Sequence[int]) -> Tensor:
        """``[sum of the items' rows, hidden]``: the embeddings of ``items``, in order."""
        raise NotImplementedError

    def blank_vision(
        self, inner: nn.Module, modality: Modality, device: torch.device, dtype: torch.dtype
    ) -> dict[str, Tensor]:
        """The vision inputs of one smallest item of ``modality``, all zeros."""
        raise NotImplementedError

    def rope_index(
        self,
        inner: nn.Module,
        input_ids: Tensor,
        token_types: Tensor,
        vision: Mapping[str, Any],
        items: Mapping[str, list[int]],
    ) -> Tensor:
        """``[3, n]`` multimodal RoPE positions of one document ``input_ids [n]`` holding ``items`` of each modality."""
        raise NotImplementedError


class QwenVLFamily(VisionFamily):
    """Qwen2-VL and Qwen2.5-VL: patches of every item flattened into one ``[patches, C * T * P * P]`` tensor, a
    ``[t, h, w]`` patch grid per item, ``spatial_merge_size ** 2`` patches merged into each embedding row, mRoPE."""

    mrope = True
    towers = ("visual",)

    def __init__(self, modalities: tuple[Modality, ...], merge: int, video_seconds: bool) -> None:
        super().__init__(modalities)
        self.merge = merge
        self.video_seconds = video_seconds
        """``get_rope_index`` takes ``second_per_grid_ts`` (Qwen2.5-VL: temporal positions in seconds)."""

    def _grids(self, vision: Mapping[str, Any], modality: Modality) -> Tensor:
        assert modality.grid_key is not None  # every Qwen modality has its grids
        return vision[modality.grid_key]

    def item_pixels(self, vision: Mapping[str, Any], modality: Modality, items: Sequence[int]) -> Tensor:
        patches = self._grids(vision, modality).prod(-1).tolist()
        starts = [0, *torch.tensor(patches).cumsum(0).tolist()]
        pixels = vision[modality.pixels_key]
        return torch.cat([pixels[starts[i] : starts[i + 1]] for i in items])

    def feature_rows(self, vision: Mapping[str, Any], modality: Modality, placeholders: int) -> list[int]:
        return (self._grids(vision, modality).prod(-1) // self.merge**2).tolist()

    def encode(self, inner: nn.Module, vision: Mapping[str, Any], modality: Modality, items: Sequence[int]) -> Tensor:
        pixels = self.item_pixels(vision, modality, items)
        grids = self._grids(vision, modality)[list(items)]
        features: Any = inner.get_image_features if modality.name == "image" else inner.get_video_features
        return torch.cat(list(features(pixels, grids, return_dict=True).pooler_output))

    def blank_vision(
        self, inner: nn.Module, modality: Modality, device: torch.device, dtype: torch.dtype
    ) -> dict[str, Tensor]:
        """One ``[1, merge, merge]`` grid: ``merge ** 2`` patches, one embedding row."""
        model_config: Any = inner.config
        config = model_config.vision_config
        values = config.in_channels * config.temporal_patch_size * config.patch_size**2
        assert modality.grid_key is not None
        return {
            modality.pixels_key: torch.zeros(self.merge**2, values, device=device, dtype=dtype),
            modality.grid_key: torch.tensor([[1, self.merge, self.merge]], device=device),
        }

    def rope_index(
        self,
        inner: nn.Module,
        input_ids: Tensor,
        token_types: Tensor,
        vision: Mapping[str, Any],
        items: Mapping[str, list[int]],
    ) -> Tensor:
        grids = {
            f"{m.name}_grid_thw": self._grids(vision, m)[items[m.name]] if items.get(m.name) else None
            for m in self.modalities
        }
        extra = {}
        if self.video_seconds and items.get("video") and "second_per_grid_ts" in vision:
            extra["second_per_grid_ts"] = torch.as_tensor(vision["second_per_grid_ts"])[items["video"]]
        get_rope_index: Any = inner.get_rope_index
        positions, _ = get_rope_index(input_ids[None], mm_token_type_ids=token_types[None], **grids, **extra)
        return positions[:, 0]


class Qwen3VLFamily(QwenVLFamily):
    """Qwen3-VL (and its MoE): Qwen2-VL's patches, grids and mRoPE positions (interleaved by its rotary embedding,
    from the same ``[3, N]`` rows), a video's frames as runs of their own behind timestamp text, and DeepStack: the
    vision tower also returns features of intermediate layers, which the first decoder layers add to their output at
    the placeholders. :meth:`encode` returns them beside the input embedding, ``[rows, (1 + layers) * hidden]``."""

    def __init__(self, modalities: tuple[Modality, ...], merge: int, deepstack_layers: int) -> None:
        super().__init__(modalities, merge, video_seconds=False)
        self.deepstack_layers = deepstack_layers

    def item_runs(self, vision: Mapping[str, Any], modality: Modality) -> list[int]:
        if modality.name == "image":
            return super().item_runs(vision, modality)
        return self._grids(vision, modality)[:, 0].tolist()

    def encode(self, inner: nn.Module, vision: Mapping[str, Any], modality: Modality, items: Sequence[int]) -> Tensor:
        pixels = self.item_pixels(vision, modality, items)
        grids = self._grids(vision, modality)[list(items)]
        features: Any = inner.get_image_features if modality.name == "image" else inner.get_video_features
        out = features(pixels, grids, return_dict=True)
        levels = [out.pooler_output, *out.deepstack_features]  # each a tuple of [item rows, hidden]
        return torch.cat([torch.cat(list(level)) for level in levels], dim=-1)


class LlavaFamily(VisionFamily):
    """LLaVA: ``[images, C, H, W]`` pixels (one size), the same number of projected patch features per image,
    1-D positions."""

    towers = ("vision_tower", "multi_modal_projector")

    def __init__(self, modalities: tuple[Modality, ...], feature_layer: Any, select_strategy: str) -> None:
        super().__init__(modalities)
        self.feature_layer = feature_layer
        self.select_strategy = select_strategy

    def feature_rows(self, vision: Mapping[str, Any], modality: Modality, placeholders: int) -> list[int]:
        images = vision[modality.pixels_key].shape[0]
        if placeholders % images:
            raise ValueError(
                f"The batch has {placeholders} image tokens for {images} images: LLaVA gives every image "
                "the same number; build the batch with the model's processor."
            )
        return [placeholders // images] * images

    def encode(self, inner: nn.Module, vision: Mapping[str, Any], modality: Modality, items: Sequence[int]) -> Tensor:
        get_image_features: Any = inner.get_image_features
        out = get_image_features(
            pixel_values=self.item_pixels(vision, modality, items),
            vision_feature_layer=self.feature_layer,
            vision_feature_select_strategy=self.select_strategy,
            return_dict=True,
        )
        return torch.cat([feature.reshape(-1, feature.shape[-1]) for feature in out.pooler_output])

    def blank_vision(
        self, inner: nn.Module, modality: Modality, device: torch.device, dtype: torch.dtype
    ) -> dict[str, Tensor]:
        model_config: Any = inner.config
        config = model_config.vision_config
        size = (1, config.num_channels, config.image_size, config.image_size)
        return {modality.pixels_key: torch.zeros(size, device=device, dtype=dtype)}


class Gemma3Family(VisionFamily):
    """Gemma 3: ``[images, C, S, S]`` pixels (one size, as its processor makes them: pan-and-scan crops are images
    of their own), ``mm_tokens_per_image`` pooled SigLIP features per image, 1-D positions, and each image's
    placeholders attending to each other bidirectionally (``token_type_ids``)."""

    towers = ("vision_tower", "multi_modal_projector")
    bidirectional_items = True

    def __init__(self, modalities: tuple[Modality, ...], tokens_per_image: int) -> None:
        super().__init__(modalities)
        self.tokens_per_image = tokens_per_image

    def feature_rows(self, vision: Mapping[str, Any], modality: Modality, placeholders: int) -> list[int]:
        images = vision[modality.pixels_key].shape[0]
        if placeholders != images * self.tokens_per_image:
            raise ValueError(
                f"The batch has {placeholders} image tokens for {images} images: Gemma 3 gives every image "
                f"mm_tokens_per_image={self.tokens_per_image}; build the batch with the model's processor."
            )
        return [self.tokens_per_image] * images

    def encode(self, inner: nn.Module, vision: Mapping[str, Any], modality: Modality, items: Sequence[int]) -> Tensor:
        get_image_features: Any = inner.get_image_features
        features = get_image_features(self.item_pixels(vision, modality, items), return_dict=True)
        return features.pooler_output.flatten(0, 1)  # [images * tokens_per_image, hidden]

    def blank_vision(
        self, inner: nn.Module, modality: Modality, device: torch.device, dtype: torch.dtype
    ) -> dict[str, Tensor]:
        model_config: Any = inner.config
        config = model_config.vision_config
        size = (1, config.num_channels, config.image_size, config.image_size)
        return {modality.pixels_key: torch.zeros(size, device=device, dtype=dtype)}


SUPPORTED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "gemma3")

REFUSED = {
    "gemma3n": "has vision and audio towers (MobileNet-v5, USM) that lightning-ulysses does not feed yet",
}


def placeholders(input_ids: Tensor, family: VisionFamily) -> Tensor:
    """``input_ids``-shaped bool: the placeholder tokens of every modality of ``family``."""
    found = torch.zeros_like(input_ids, dtype=torch.bool)
    for modality in family.modalities:
        found |= input_ids == modality.token_id
    return found


def vision_family(model: nn.Module) -> VisionFamily:
    """The :class:`VisionFamily` of a transformers vision-language model, or :class:`UnsupportedModelError` naming
    the model and why its vision inputs cannot run exactly under sequence parallelism."""
    config: Any = model.config  # a transformers vision-language config
    model_type = config.model_type
    if model_type in REFUSED or model_type not in SUPPORTED:
        reason = REFUSED.get(model_type) or (
            "is no vision-language family that lightning-ulysses knows how to feed images"
            if getattr(config, "vision_config", None) is not None
            else "has no vision tower"
        )
        raise UnsupportedModelError(
            f"{type(model).__name__} ({model_type}) {reason}. Vision inputs run under sequence parallelism for "
            f"{', '.join(SUPPORTED)}; train this model on text (CausalLM) or with sp_size=1 outside lightning-ulysses."
        )
    if model_type == "llava":
        image = Modality("image", config.image_token_id, "pixel_values")
        return LlavaFamily((image,), config.vision_feature_layer, config.vision_feature_select_strategy)
    if model_type == "gemma3":
        return Gemma3Family((Modality("image", config.image_token_id, "pixel_values"),), config.mm_tokens_per_image)
    modalities = (
        Modality("image", config.image_token_id, "pixel_values", "image_grid_thw", type_id=1),
        Modality("video", config.video_token_id, "pixel_values_videos", "video_grid_thw", type_id=2),
    )
    vision_config: Any = config.vision_config
    merge = vision_config.spatial_merge_size
    if model_type in ("qwen3_vl", "qwen3_vl_moe"):
        return Qwen3VLFamily(modalities, merge, len(vision_config.deepstack_visual_indexes))
    return QwenVLFamily(modalities, merge, video_seconds=model_type == "qwen2_5_vl")
