"""Vision-language models under sequence parallelism: images and video merged into sequence-sharded text.

See docs/vision-language.md: :mod:`~lightning_ulysses.vision.families` (what runs, what is refused),
:mod:`~lightning_ulysses.vision.batch` (whole-sequence preparation), :mod:`~lightning_ulysses.vision.embed` (each
rank's merged embeddings) and :mod:`~lightning_ulysses.vision.module` (the LightningModule).
"""

from lightning_ulysses.vision.batch import MROPE_KEY, ROWS_KEY, VISION_KEY, prepare_vision_batch
from lightning_ulysses.vision.embed import MergedInputs, merged_inputs, merged_inputs_embeds
from lightning_ulysses.vision.families import SUPPORTED, VisionFamily, vision_family
from lightning_ulysses.vision.module import VisionLanguageModel

__all__ = [
    "MROPE_KEY",
    "MergedInputs",
    "ROWS_KEY",
    "SUPPORTED",
    "VISION_KEY",
    "VisionFamily",
    "VisionLanguageModel",
    "merged_inputs",
    "merged_inputs_embeds",
    "prepare_vision_batch",
    "vision_family",
]
