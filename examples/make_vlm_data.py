"""Make the data of ``configs/vlm_sft_quickstart.yaml``: a tiny LLaVA processor and chats about coloured pictures.

    python examples/make_vlm_data.py            # writes examples/data/vlm/ (already in the repository)

The pictures are noise around one of four colours, of different sizes; each chat asks for the colour of one or two
of them. The answer is in the pixels only, so the loss on the colour words falls only if the vision tower, the
projector and the language model learn together. The processor is transformers' ``LlavaProcessor`` on the built-in
byte tokenizer plus ``<image>``: CLIP's PIL image processor (no torchvision) resizes a picture to 8 x 8 pixels, whose
2 x 2 patches become 16 ``<image>`` tokens. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

FOLDER = Path(__file__).resolve().parent / "data" / "vlm"
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SIZES = [(8, 8), (8, 12), (16, 8), (12, 16), (16, 16)]  # (height, width) in pixels
VISION_CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<image>' }}{%- else %}{{- part['text'] }}{%- endif %}{%- endfor %}"
    "{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
"""ChatML with content parts, each image as one ``<image>`` (the processor expands it to the image's 16 tokens)."""


def save_llava_processor(folder: Path) -> dict[str, int]:
    """The processor in ``folder``; returns the model config fields that must match it (``image_token_id``,
    ``vocab_size``)."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from lightning_ulysses.finetune import byte_chat_tokenizer

    tokenizer = byte_chat_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<image>"]})
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=2,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=VISION_CHATML,
    )
    folder.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(folder)
    return dict(image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vocab_size=len(tokenizer))


def save_pictures(folder: Path, count: int = 20, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` PNG pictures in ``folder/images``; their (path relative to ``folder``, colour)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    pictures = []
    for i in range(count):
        colour = list(COLOURS)[i % len(COLOURS)]
        height, width = SIZES[i % len(SIZES)]
        pixels = np.clip(np.array(COLOURS[colour]) + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8)
        path = f"images/{colour}{i}.png"
        Image.fromarray(pixels).save(folder / path)
        pictures.append((path, colour))
    return pictures


def colour_chats(pictures: list[tuple[str, str]], count: int = 160, seed: int = 0) -> list[dict[str, Any]]:
    """Chats asking for the colour of one picture, or (every third) of two."""
    rng = np.random.default_rng(seed)
    chats = []
    for i in range(count):
        shown = [pictures[j] for j in rng.choice(len(pictures), 2 if i % 3 == 2 else 1, replace=False)]
        user = [{"type": "image", "image": path} for path, _ in shown]
        question = "What colours are these pictures?" if len(shown) == 2 else "What colour is this picture?"
        answer = " and ".join(colour for _, colour in shown).capitalize() + "."
        chats.append(
            {
                "messages": [
                    {"role": "user", "content": [*user, {"type": "text", "text": question}]},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                ]
            }
        )
    return chats


def make(folder: Path = FOLDER) -> dict[str, int]:
    """Everything in ``folder``: ``processor/``, ``images/``, ``chats.jsonl``; returns the processor's fields."""
    fields = save_llava_processor(folder / "processor")
    chats = colour_chats(save_pictures(folder))
    (folder / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    return fields


if __name__ == "__main__":
    print(f"{FOLDER}: {make()}")
