"""Tiny vision-language models and batches for tests/test_vision.py (built here, nothing from the hub).

Proportions of the real checkpoints, shrunk: Qwen2-VL-7B's text model has head_dim 128 = hidden / heads, 7 query
heads per key/value head and ``mrope_section`` [16, 24, 24] (sums to head_dim / 2); here head_dim 16, [2, 3, 3].
Images are patch grids ``[t, h, w]`` (h, w even: 2 x 2 patches merge into one embedding row). Weights drawn with
std 0.2 and ``rope_theta`` 100, so that positions and images move the loss by percents: with transformers' defaults,
dropping the mRoPE rows changed the loss by 1e-5 relative, under the tolerance.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig, PretrainedConfig

from lightning_ulysses.sharding import IGNORE_INDEX

VOCAB = 128
IMAGE, VIDEO, START, END = 120, 121, 122, 123
TEXT_IDS = 100  # text tokens are drawn from [0, 100)

QWEN_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.2,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 100.0},
)
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)

# Qwen3-VL's rotary layout (mRoPE rows interleaved, as the 4B and 30B-A3B checkpoints) and its vision tower, shrunk:
# DeepStack after vision blocks 1 and 2 (of 4)
QWEN3_ROPE = {"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True, "rope_theta": 100.0}
QWEN3_VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=2,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
    deepstack_visual_indexes=[1, 2],
)

# a ViT tower (CLIP for LLaVA, SigLIP for Gemma 3) on 8 x 8 pixels in 2 x 2 patches
TINY_TOWER = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=2
)

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_vl": dict(
        model_type="qwen2_vl",
        text_config=QWEN_TEXT,
        **TOKENS,
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            patch_size=2,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
    ),
    "qwen2_5_vl": dict(
        model_type="qwen2_5_vl",
        text_config=QWEN_TEXT,
        **TOKENS,
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=64,
            num_heads=2,
            patch_size=2,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=8,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
        ),
    ),
    # Qwen3-VL-4B: text hidden 2560, 32 heads of 128 (not hidden / heads = 80), 8 key/value heads, mrope_section
    # [24, 20, 20] interleaved; vision depth 24 with DeepStack at blocks [5, 11, 17] into the first 3 decoder layers
    "qwen3_vl": dict(
        model_type="qwen3_vl",
        text_config=dict(
            hidden_size=80,
            intermediate_size=160,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            vocab_size=VOCAB,
            pad_token_id=0,
            initializer_range=0.2,
            rope_parameters=QWEN3_ROPE,
        ),
        **TOKENS,
        vision_config=dict(QWEN3_VISION, out_hidden_size=80),
    ),
    # Qwen3-VL-30B-A3B: text hidden 2048, 32 heads of 128 (hidden / heads = 64), 4 key/value heads, 128 experts
    # of 768, 8 per token; its vision tower is Qwen3-VL's
    "qwen3_vl_moe": dict(
        model_type="qwen3_vl_moe",
        text_config=dict(
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=32,
            vocab_size=VOCAB,
            pad_token_id=0,
            initializer_range=0.2,
            rope_parameters=QWEN3_ROPE,
        ),
        **TOKENS,
        vision_config=dict(QWEN3_VISION, out_hidden_size=128),
    ),
    # Gemma 3 4B: text hidden 2560, 8 heads of 256 (not hidden / heads = 320), 4 key/value heads, 5 sliding layers
    # (window 1024) to 1 global, 256 tokens per image (a quarter of the window); SigLIP 896 px in 14 px patches
    "gemma3": dict(
        model_type="gemma3",
        image_token_index=IMAGE,
        boi_token_index=START,
        eoi_token_index=END,
        mm_tokens_per_image=4,
        text_config=dict(
            hidden_size=40,
            intermediate_size=80,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            vocab_size=VOCAB,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            initializer_range=0.2,
        ),
        vision_config=dict(TINY_TOWER, model_type="siglip_vision_model"),
    ),
    "llava": dict(
        model_type="llava",
        image_token_id=IMAGE,
        vision_feature_layer=-1,
        image_seq_length=16,
        text_config=dict(
            model_type="llama",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            head_dim=16,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            initializer_range=0.2,
        ),
        vision_config=dict(TINY_TOWER, model_type="clip_vision_model"),
    ),
}
PATCH_VALUES = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch


def tiny_config(family: str) -> PretrainedConfig:
    fields = dict(CONFIGS[family])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def tiny_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The tiny model of ``family``; ``overrides``: config fields (``vocab_size`` goes to the text config)."""
    from transformers import AutoModelForImageTextToText

    config = tiny_config(family)
    if "vocab_size" in overrides:
        config.get_text_config().vocab_size = overrides.pop("vocab_size")
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")
    if family == "gemma3":  # its projector starts at zero: images would not move the loss
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    if family.startswith("qwen3"):  # DeepStack's projections at std 0.2 (as the decoder's): they move the loss by 1 %
        with torch.no_grad():
            for merger in model.model.visual.deepstack_merger_list:
                for linear in (merger.linear_fc1, merger.linear_fc2):
                    linear.weight.normal_(0.0, 0.2)
    return model


def _text(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, TEXT_IDS, (n,), generator=generator).tolist()


def qwen_document(
    layout: list[Any], generator: torch.Generator, frames: bool = False
) -> tuple[list[int], list[Tensor], list[Tensor]]:
    """Token ids of one document from ``layout`` (ints: that many text tokens; ("image" | "video", (t, h, w))),
    and the items' ``(kind, grid, pixels)``. ``frames`` (Qwen3-VL): each of a video's ``t`` frames is a run of its
    own behind 2 timestamp tokens, as its processor lays them out."""
    ids: list[int] = []
    items = []
    for part in layout:
        if isinstance(part, int):
            ids += _text(generator, part)
            continue
        kind, grid = part
        rows = grid[0] * grid[1] * grid[2] // 4
        if kind == "video" and frames:
            for _ in range(grid[0]):
                ids += [*_text(generator, 2), START, *[VIDEO] * (rows // grid[0]), END]
        else:
            ids += [START, *[IMAGE if kind == "image" else VIDEO] * rows, END]
        pixels = torch.randn(grid[0] * grid[1] * grid[2], PATCH_VALUES, generator=generator)
        items.append((kind, torch.tensor(grid), pixels))
    return ids, items


def qwen_batch(
    rows: list[list[list[Any]]], seed: int = 0, packed: bool = False, frames: bool = False
) -> dict[str, Any]:
    """A right-padded batch (``packed``: several documents per row, ``position_ids`` restarting per document) with
    ``vision`` holding the items' pixels and grids in batch order (``frames``: see :func:`qwen_document`)."""
    generator = torch.Generator().manual_seed(seed)
    id_rows, position_rows, items = [], [], []
    for documents in rows:
        ids, positions = [], []
        for layout in documents:
            doc_ids, doc_items = qwen_document(layout, generator, frames)
            ids += doc_ids
            positions += list(range(len(doc_ids)))
            items += doc_items
        id_rows.append(ids)
        position_rows.append(positions)
    length = max(map(len, id_rows))
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    position_ids = torch.zeros_like(input_ids)
    for row, (ids, positions) in enumerate(zip(id_rows, position_rows, strict=True)):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        position_ids[row, : len(ids)] = torch.tensor(positions)
        position_ids[row, len(ids) :] = torch.arange(length - len(ids))
    vision: dict[str, Tensor] = {}
    for kind, pixels_key, grid_key in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        chosen = [(grid, pixels) for k, grid, pixels in items if k == kind]
        if chosen:
            vision[pixels_key] = torch.cat([pixels for _, pixels in chosen])
            vision[grid_key] = torch.stack([grid for grid, _ in chosen])
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "vision": vision,
        "labels": plain_labels(input_ids, attention_mask),
    }
    if packed:
        batch["position_ids"] = position_ids
    return batch


def llava_batch(rows: list[list[Any]], seed: int = 0, packed: bool = False, family: str = "llava") -> dict[str, Any]:
    """``rows``: per row, ints (text tokens) and "image" (LLaVA: 16 placeholders; Gemma 3: 4 between its image start
    and end tokens); right-padded; ``[images, 3, 8, 8]``. ``packed``: per row, several such documents,
    ``position_ids`` restarting per document."""
    image = [IMAGE] * 16 if family == "llava" else [START, *[IMAGE] * 4, END]
    generator = torch.Generator().manual_seed(seed)
    id_rows, position_rows, images = [], [], 0
    for documents in rows:
        ids: list[int] = []
        positions: list[int] = []
        for layout in documents if packed else [documents]:
            start = len(ids)
            for part in layout:
                if part == "image":
                    ids += image
                    images += 1
                else:
                    ids += _text(generator, part)
            positions += list(range(len(ids) - start))
        id_rows.append(ids)
        position_rows.append(positions)
    length = max(map(len, id_rows))
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    position_ids = torch.zeros_like(input_ids)
    for row, (ids, positions) in enumerate(zip(id_rows, position_rows, strict=True)):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        position_ids[row, : len(ids)] = torch.tensor(positions)
        position_ids[row, len(ids) :] = torch.arange(length - len(ids))
    vision = {"pixel_values": torch.randn(images, 3, 8, 8, generator=generator)} if images else {}
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "vision": vision,
        "labels": plain_labels(input_ids, attention_mask),
    }
    if packed:
        batch["position_ids"] = position_ids
    return batch


def plain_labels(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    vision = (input_ids == IMAGE) | (input_ids == VIDEO)
    return input_ids.masked_fill(vision | (attention_mask == 0), IGNORE_INDEX)


def _plain_inputs(family: str, batch: dict[str, Any]) -> dict[str, Any]:
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    inputs.update(batch["vision"])
    ids = batch["input_ids"]
    if family == "gemma3":
        inputs["token_type_ids"] = (ids == IMAGE).long()
    elif family != "llava":
        inputs["mm_token_type_ids"] = (ids == IMAGE).long() + 2 * (ids == VIDEO).long()
    return inputs


def plain_loss_sum(family: str, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[Tensor, int]:
    """The plain transformers model (no patch): the sum of next-token losses and the count of labelled tokens.
    Packed rows run document by document (each document alone, with its own images)."""
    if "position_ids" not in batch:
        labels = batch["labels"]
        count = int((labels[:, 1:] != IGNORE_INDEX).sum())
        loss = model(**_plain_inputs(family, batch), labels=labels).loss
        return loss * count, count
    total, count = torch.zeros(()), 0
    for document in split_documents(family, batch):
        loss, n = plain_loss_sum(family, model, document)
        total, count = total + loss, count + n
    return total, count


QWEN_ITEMS = (
    ("image", IMAGE, "pixel_values", "image_grid_thw"),
    ("video", VIDEO, "pixel_values_videos", "video_grid_thw"),
)


def split_documents(family: str, batch: dict[str, Any]) -> list[dict[str, Any]]:
    """Each packed document of a batch as a batch of its own, with its items' pixels (and grids)."""
    ids, real, positions = batch["input_ids"], batch["attention_mask"].bool(), batch["position_ids"]
    vision = batch["vision"]
    taken = {"image": 0, "video": 0, "image_patch": 0, "video_patch": 0}
    documents = []
    for row in range(ids.shape[0]):
        starts = [c for c in range(ids.shape[1]) if real[row, c] and positions[row, c] == 0] + [int(real[row].sum())]
        for start, end in zip(starts[:-1], starts[1:], strict=True):
            doc = ids[row, start:end][None]
            doc_vision = {}
            if family in ("llava", "gemma3"):
                images = int((doc == IMAGE).sum()) // (16 if family == "llava" else 4)
                if images:
                    doc_vision["pixel_values"] = vision["pixel_values"][taken["image"] : taken["image"] + images]
                    taken["image"] += images
            qwen_items = () if family in ("llava", "gemma3") else QWEN_ITEMS
            for kind, token, pixels_key, grid_key in qwen_items:
                is_kind = doc[0] == token
                runs = int((is_kind[1:] & ~is_kind[:-1]).sum() + is_kind[0])
                if runs:
                    if kind == "video" and family.startswith("qwen3"):  # one run per frame
                        runs = int((vision[grid_key][taken[kind] :, 0].cumsum(0) <= runs).sum())
                    grids = vision[grid_key][taken[kind] : taken[kind] + runs]
                    patches = int(grids.prod(-1).sum())
                    doc_vision[grid_key] = grids
                    first = taken[f"{kind}_patch"]
                    doc_vision[pixels_key] = vision[pixels_key][first : first + patches]
                    taken[kind] += runs
                    taken[f"{kind}_patch"] += patches
            mask = torch.ones_like(doc)
            documents.append(
                {"input_ids": doc, "attention_mask": mask, "vision": doc_vision, "labels": plain_labels(doc, mask)}
            )
    return documents


GEMMA3_CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<start_of_image>' }}{%- else %}{{- part['text'] }}{%- endif %}{%- endfor %}"
    "{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
"""ChatML with content parts, each image as Gemma 3's ``<start_of_image>`` (its processor expands it to the image's
tokens between image start and end)."""


def save_gemma3_processor(folder: Any) -> dict[str, int]:
    """A tiny Gemma 3 processor in ``folder`` (the byte chat tokenizer with Gemma 3's image tokens, its PIL image
    processor at 8 x 8 pixels, 4 tokens per image); returns the model config fields that must match it."""
    import tempfile

    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    from lightning_ulysses.finetune import byte_chat_tokenizer

    names = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = byte_chat_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *names.values()]})
    with tempfile.TemporaryDirectory() as saved:  # named special tokens are set when a tokenizer is loaded
        tokenizer.save_pretrained(saved)
        tokenizer = AutoTokenizer.from_pretrained(saved, extra_special_tokens=names)
    image_processor = Gemma3ImageProcessorPil(size={"height": 8, "width": 8}, do_pan_and_scan=False)
    processor = Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=GEMMA3_CHATML, image_seq_length=4
    )
    processor.save_pretrained(folder)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in names.items()}
    return dict(
        image_token_id=ids["image_token"],
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        vocab_size=len(tokenizer),
    )


def save_tiny_chats(folder: Any, records: int = 6, seed: int = 0) -> str:
    """PNG images of different sizes and chats about one or two of them (JSONL); returns the file's path."""
    import json
    from pathlib import Path

    import numpy as np
    from PIL import Image

    folder = Path(folder)
    rng = np.random.default_rng(seed)
    sizes = [(8, 12), (16, 8), (8, 8), (12, 16)]
    for i, (h, w) in enumerate(sizes):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"image{i}.png")
    lines = []
    for r in range(records):
        user = [{"type": "image", "image": f"image{r % 4}.png"}, {"type": "text", "text": f"What is in picture {r}?"}]
        if r % 3 == 1:
            user.append({"type": "image", "image": f"image{(r + 1) % 4}.png"})
        answer = [{"type": "text", "text": f"Noise number {r}, {'two pictures' if r % 3 == 1 else 'colourful'}."}]
        lines.append(
            json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
        )
    path = folder / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)
