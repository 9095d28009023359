"""Vision-language models under sequence parallelism (lightning_ulysses.vision) against the plain transformers model.

One process: the patched path (whole-sequence preparation, merged embeddings, mRoPE ``[4, B, N]`` positions) equals
the plain model; each shard's merged embeddings equal the whole sequence's columns. Several processes: SP training
(sp=2, sp=4, dp x sp, ZeRO-2 and 3) equals one process of the plain model (loss and update), on batches with images
of different sizes, an image cut by a shard border, a video and packed documents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_ulysses.hf import apply_ulysses_attention, remove_ulysses_attention
from lightning_ulysses.hf.state import UnsupportedModelError
from lightning_ulysses.loss import token_cross_entropy
from lightning_ulysses.sharding import prepare_batch, shard_batch
from lightning_ulysses.vision import VisionLanguageModel, merged_inputs_embeds, prepare_vision_batch, vision_family
from tests.cases import CaseTable
from tests.loaders import check_workers_from_a_fork_server
from tests.vision_data import (
    CONFIGS,
    IMAGE,
    TINY_TOWER,
    VOCAB,
    llava_batch,
    plain_loss_sum,
    qwen_batch,
    tiny_config,
    tiny_model,
)

# row 0: three images of different sizes and a video; row 1: one image. 56 columns: at sp=2 the border (28) falls
# inside row 0's video, at sp=4 (14, 28, 42) inside its second image and its video (test_the_shard_border_cuts_an_image)
QWEN_ROWS = [
    [[3, ("image", (1, 4, 4)), 2, ("image", (1, 6, 4)), 1, ("image", (1, 2, 2)), 3, ("video", (2, 4, 4)), 20]],
    [[5, ("image", (1, 2, 6)), 9]],
]
# packed: row 0 holds two documents (the second starts inside a shard), each with images
QWEN_PACKED_ROWS = [
    [[2, ("image", (1, 4, 2)), 5], [3, ("image", (1, 4, 4)), 1, ("video", (2, 2, 4)), 2]],
    [[4, ("image", (1, 2, 2)), 6], [7]],
]
LLAVA_ROWS = [[3, "image", 2, "image", 4], [6, "image", 5]]
# packed: row 0's second document starts at column 21 and its image crosses the sp=2 border (column 32)
LLAVA_PACKED_ROWS = [[[2, "image", 3], [4, "image", 2, "image", 3]], [[5, "image", 4], [9]]]
# at sp=2 the border (24) cuts the third image, at sp=4 (12, 24, 36) too; the window (16) cuts into the last one's keys
GEMMA_ROWS = [[3, "image", 2, "image", 4, "image", 9, "image", 3], [6, "image", 5]]
# packed: row 0's second document starts at column 11 and its first image crosses the sp=2 border (column 16)
GEMMA_PACKED_ROWS = [[[2, "image", 3], [3, "image", 2, "image", 3]], [[5, "image", 4], [9]]]
TEXT_ONLY_ROWS = {"qwen": [[[21]], [[9]]], "llava": [[14], [5, 3]]}  # a batch of chats without any image


def family_batch(family: str, packed: bool = False, seed: int = 0, text_only: bool = False) -> dict[str, Any]:
    if family == "llava":
        if packed and not text_only:
            return llava_batch(LLAVA_PACKED_ROWS, seed, packed=True)
        return llava_batch(TEXT_ONLY_ROWS["llava"] if text_only else LLAVA_ROWS, seed)
    if family == "gemma3":
        if packed and not text_only:
            return llava_batch(GEMMA_PACKED_ROWS, seed, packed=True, family=family)
        return llava_batch(TEXT_ONLY_ROWS["llava"] if text_only else GEMMA_ROWS, seed, family=family)
    rows = TEXT_ONLY_ROWS["qwen"] if text_only else QWEN_PACKED_ROWS if packed else QWEN_ROWS
    return qwen_batch(rows, seed, packed=packed, frames=family.startswith("qwen3"))


def vision_module(family: str, model: torch.nn.Module, encoding: str = "shard") -> VisionLanguageModel:
    module = VisionLanguageModel(model=CONFIGS[family], vision_encoding=encoding)
    module.model = model
    module.configure_model()  # the family, and DeepStack's feeding of the language model
    return module


def sp_prepared(module: VisionLanguageModel, batch: dict[str, Any], sp: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s shard at ``sp``, the sequence padded to a multiple of 4 for every ``sp``."""
    whole = prepare_vision_batch(batch, module.family, module.model.model)
    return shard_batch(prepare_batch(whole, 4), rank, sp)


CASES = [
    ("qwen2_vl", False),
    ("qwen2_vl", True),
    ("qwen2_5_vl", False),
    ("qwen2_5_vl", True),
    ("qwen3_vl", False),
    ("qwen3_vl", True),
    ("qwen3_vl_moe", False),
    ("llava", False),
    ("llava", True),
    ("gemma3", False),
    ("gemma3", True),
]


def patched_loss_sum(module, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed token loss and token count of ``batch`` through the patched model at sp=1 (then unpatched)."""
    apply_ulysses_attention(model, group=None, attn_implementation="sdpa")
    try:
        prepared = sp_prepared(module, batch, 1, 0)
        logits = model(**module.model_inputs(model, prepared)).logits
        return token_cross_entropy(logits, prepared["shift_labels"])
    finally:
        remove_ulysses_attention(model)


@pytest.mark.parametrize(("family", "packed"), CASES)
def test_one_process_equals_the_plain_model(family: str, packed: bool) -> None:
    model = tiny_model(family)
    batch = family_batch(family, packed)
    expected_sum, expected_count = plain_loss_sum(family, model, batch)
    got_sum, got_count = patched_loss_sum(vision_module(family, model), model, batch)
    assert int(got_count) == expected_count
    torch.testing.assert_close(got_sum, expected_sum, rtol=1e-5, atol=0)


@pytest.mark.parametrize("encoding", ["shard", "all"])
@pytest.mark.parametrize(("family", "packed"), CASES)
def test_each_shard_merges_the_rows_of_the_whole_sequence(family: str, packed: bool, encoding: str) -> None:
    """At sp=2 and 4, every shard's merged embeddings are the whole sequence's columns (images cut by a border too),
    and with ``"shard"`` a rank encodes only the items with a placeholder in its shard."""
    model = tiny_model(family)
    module = vision_module(family, model, encoding)
    batch = family_batch(family, packed)
    with torch.no_grad():
        whole = merged_inputs_embeds(model, module.family, sp_prepared(module, batch, 1, 0), "all")
        for sp in (2, 4):
            local = whole.shape[1] // sp
            for rank in range(sp):
                shard = merged_inputs_embeds(model, module.family, sp_prepared(module, batch, sp, rank), encoding)
                torch.testing.assert_close(shard, whole[:, rank * local : (rank + 1) * local], rtol=1e-5, atol=1e-6)


def test_the_shard_border_cuts_an_image() -> None:
    """The batches above put a shard border inside an image at sp=2 and sp=4 (what the equivalence tests rely on)."""
    for family, packed in CASES:
        ids = prepare_batch(family_batch(family, packed), 4)["input_ids"]
        for sp in (2, 4):
            local = ids.shape[1] // sp
            placeholders = (ids == 120) | (ids == 121)
            cut = any(bool((placeholders[:, b * local - 1] & placeholders[:, b * local]).any()) for b in range(1, sp))
            assert cut, f"{family} packed={packed}: no image crosses a shard border at sp={sp}"


def test_mrope_positions_restart_per_document_and_rows_are_numbered_in_batch_order() -> None:
    model = tiny_model("qwen2_vl")
    family = vision_family(model)
    batch = family_batch("qwen2_vl", packed=True)
    prepared = prepare_vision_batch(batch, family, model.model)
    mrope, rows = prepared["mrope_position_ids"], prepared["vision_rows"]
    starts = (batch["position_ids"] == 0) & batch["attention_mask"].bool()
    assert (mrope[starts] == 0).all()  # every document's first token (text) is at 0 in all three rows
    images = batch["input_ids"] == 120
    assert rows[images].tolist() == list(range(1, int(images.sum()) + 1))
    assert (prepared["labels"][images] == -100).all()
    # an image of grid (1, 4, 2) after 3 tokens (2 text + vision_start): t = 3, h = 3 + [0, 1], w = 3 + [0]
    first = images[0].nonzero()[:2, 0]  # the first document's image
    assert mrope[0, first].tolist() == [[3, 3, 3], [3, 4, 3]]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_mrope_positions_of_unpacked_rows_are_get_rope_index_of_the_whole_batch(family: str) -> None:
    from tests.vision_data import _plain_inputs

    model = tiny_model(family)
    batch = family_batch(family)
    inputs = _plain_inputs(family, batch)
    expected, _ = model.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        inputs["image_grid_thw"],
        inputs["video_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )
    got = prepare_vision_batch(batch, vision_family(model), model.model)["mrope_position_ids"].permute(2, 0, 1)
    real = batch["attention_mask"].bool()
    assert torch.equal(got[:, real], expected[:, real])


def test_other_vision_families_are_refused_with_the_reason() -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(
        "paligemma",
        image_token_index=IMAGE,
        vision_config=dict(TINY_TOWER, model_type="siglip_vision_model", num_hidden_layers=1, projection_dim=32),
        text_config=dict(
            model_type="gemma",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=VOCAB,
        ),
    )
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    with pytest.raises(
        UnsupportedModelError, match="PaliGemmaForConditionalGeneration .paligemma. is no vision-language"
    ):
        vision_family(model)


def test_a_document_holding_part_of_a_qwen3_video_is_refused() -> None:
    """Qwen3-VL lays a video out as one run per frame: a document boundary between two frames is refused."""
    model = tiny_model("qwen3_vl")
    batch = qwen_batch([[[3, ("video", (2, 2, 4)), 5]]], frames=True, packed=True)
    video = (batch["input_ids"][0] == 121).nonzero()[:, 0]
    second_frame = int(video[video.diff(prepend=video[:1]) > 1][0])  # first column of the second frame's run
    batch["position_ids"][0, second_frame:] -= batch["position_ids"][0, second_frame].clone()
    with pytest.raises(ValueError, match="part of a video"):
        prepare_vision_batch(batch, vision_family(model), model.model)


def test_the_set_up_check_reads_the_image_spans_from_the_masks_gemma_3_builds() -> None:
    from lightning_ulysses.hf.apply import patch_of

    model = tiny_model("gemma3")
    apply_ulysses_attention(model, group=None, attn_implementation="sdpa")
    try:
        plan = patch_of(model).plan
        assert plan.token_types == "spans"
        assert [(layer.pattern.window, layer.pattern.spans) for _, layer in plan.layers] == [
            (16, True),
            (16, True),
            (None, True),
        ]
    finally:
        remove_ulysses_attention(model)


def test_token_type_ids_that_the_masks_read_otherwise_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3 changed to let every image token see every other (one block per row, not one per image): the set-up
    check finds no span pattern, and a forward given token_type_ids is refused; text alone still runs."""
    from transformers.models.gemma3 import modeling_gemma3

    from lightning_ulysses.hf.apply import patch_of

    def one_block(token_type_ids: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        return torch.where(token_type_ids == 1, 0, -1).to(device)

    monkeypatch.setattr(modeling_gemma3, "get_block_sequence_ids_for_mask", one_block)
    model = tiny_model("gemma3")
    apply_ulysses_attention(model, group=None, attn_implementation="sdpa")
    try:
        assert "no causal pattern with image spans" in patch_of(model).plan.token_types
        ids = torch.randint(3, 100, (1, 8))
        positions = torch.arange(8)[None]
        with pytest.raises(ValueError, match="was given token_type_ids"):
            model(input_ids=ids, position_ids=positions, token_type_ids=torch.zeros_like(ids))
        model(input_ids=ids, position_ids=positions)
    finally:
        remove_ulysses_attention(model)


def test_a_text_model_is_refused() -> None:
    from transformers import AutoModelForCausalLM

    config = tiny_config("llava").text_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match="has no vision tower"):
        vision_family(model)


def test_placeholders_that_do_not_match_the_images_are_refused() -> None:
    model = tiny_model("qwen2_vl")
    batch = family_batch("qwen2_vl")
    batch["vision"] = dict(batch["vision"], image_grid_thw=batch["vision"]["image_grid_thw"] * 2)
    with pytest.raises(ValueError, match="embedding rows but it has"):
        prepare_vision_batch(batch, vision_family(model), model.model)


# ---------------------------------------------------------------------------------------------
# multi-process: VisionLanguageModel under UlyssesStrategy vs one process of the plain model
# ---------------------------------------------------------------------------------------------
STEPS, LR = 2, 0.1


class SGDVisionLanguageModel(VisionLanguageModel):
    """SGD exposes the gradient's scale in the weights; the step losses are recorded."""

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def case_batches(case: dict[str, Any]) -> list[dict[str, Any]]:
    """Item ``d + dp * s`` is DP rank ``d``'s batch of step ``s`` (Lightning's sampler, moved onto the DP ranks);
    with ``text_only_rank``, that DP rank's batches hold no image."""
    dp, text_only = case.get("dp", 1), case.get("text_only_rank")
    return [
        family_batch(case["family"], case.get("packed", False), seed=i, text_only=i % dp == text_only)
        for i in range(STEPS * dp)
    ]


def fit_case(name: str, case: dict[str, Any], world_size: int) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    from lightning_ulysses import UlyssesStrategy
    from tests.tiny import cpu_trainer, gathered_parameters

    module = SGDVisionLanguageModel(
        model=CONFIGS[case["family"]],
        vision_encoding=case.get("encoding", "shard"),
        gradient_checkpointing=case.get("checkpointing", False),
    )
    module.model, module.losses = tiny_model(case["family"]), []
    if module.hparams.gradient_checkpointing:
        module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        module.configure_model()  # the vision tower stays unchecked
    loader = DataLoader(case_batches(case), batch_size=1, collate_fn=lambda items: items[0])
    trainer = cpu_trainer(
        world_size,
        UlyssesStrategy(
            sp_size=case["sp"],
            stage=case["stage"],
            attn_implementation="sdpa",
            ring_size=case.get("ring", 1),
            head_chunks=case.get("head_chunks"),
        ),
        max_steps=STEPS,
        num_sanity_val_steps=0,
    )
    if case.get("refused"):
        with pytest.raises(ValueError) as refusal:
            trainer.fit(module, loader)
        return {"refusal": str(refusal.value), "losses": module.losses}
    trainer.fit(module, loader)
    return {"losses": module.losses, "params": gathered_parameters(module.model, case["stage"] == 3)}


TWO_PROCESS_CASES = {
    "qwen2_vl_sp2_zero2": dict(family="qwen2_vl", sp=2, stage=2),
    "qwen2_vl_packed_sp2_zero3": dict(family="qwen2_vl", sp=2, stage=3, packed=True, encoding="all"),
    "qwen2_5_vl_sp2_zero2": dict(family="qwen2_5_vl", sp=2, stage=2),
    "qwen2_5_vl_packed_sp2_zero3": dict(family="qwen2_5_vl", sp=2, stage=3, packed=True),
    "llava_sp2_zero3": dict(family="llava", sp=2, stage=3),
    "qwen2_vl_ring2_zero2": dict(family="qwen2_vl", sp=2, ring=2, stage=2),  # zigzag shards: each rank two blocks
    "qwen2_5_vl_checkpointed_sp2_zero3": dict(family="qwen2_5_vl", sp=2, stage=3, checkpointing=True),
    "qwen2_vl_exchange_sp2_zero2": dict(family="qwen2_vl", sp=2, stage=2, encoding="exchange"),
    "llava_exchange_sp2_zero3": dict(family="llava", sp=2, stage=3, encoding="exchange"),
    "qwen3_vl_sp2_zero2": dict(family="qwen3_vl", sp=2, stage=2),
    "qwen3_vl_packed_exchange_sp2_zero3": dict(family="qwen3_vl", sp=2, stage=3, packed=True, encoding="exchange"),
    "qwen3_vl_moe_sp2_zero3": dict(family="qwen3_vl_moe", sp=2, stage=3),
    "llava_packed_sp2_zero2": dict(family="llava", sp=2, stage=2, packed=True),
    "gemma3_sp2_zero2": dict(family="gemma3", sp=2, stage=2),
    "gemma3_packed_head_chunks_sp2_zero3": dict(family="gemma3", sp=2, stage=3, packed=True, head_chunks=2),
    # the decoder checkpointed: DeepStack's rows and the image spans in the recomputation
    "qwen3_vl_checkpointed_sp2_zero3": dict(family="qwen3_vl", sp=2, stage=3, checkpointing=True),
    "gemma3_checkpointed_sp2_zero2": dict(family="gemma3", sp=2, stage=2, checkpointing=True),
}
FOUR_PROCESS_CASES = {
    "qwen2_vl_sp4_zero2": dict(family="qwen2_vl", sp=4, stage=2),
    "qwen2_vl_packed_dp2_sp2_zero3": dict(family="qwen2_vl", sp=2, dp=2, stage=3, packed=True),
    "qwen2_5_vl_sp4_zero3": dict(family="qwen2_5_vl", sp=4, stage=3),
    "llava_dp2_sp2_zero2": dict(family="llava", sp=2, dp=2, stage=2),
    # one DP rank's batches hold images, the other's none: ZeRO-3 gathers the vision tower's weights on every rank
    "llava_dp2_sp2_zero3_text_only_rank": dict(family="llava", sp=2, dp=2, stage=3, text_only_rank=1),
    "qwen2_vl_dp2_sp2_zero3_text_only_rank": dict(family="qwen2_vl", sp=2, dp=2, stage=3, text_only_rank=1),
    # one video for 4 ranks: 3 of them encode a blank one
    "qwen2_5_vl_exchange_sp4_zero3": dict(family="qwen2_5_vl", sp=4, stage=3, encoding="exchange"),
    "qwen2_vl_exchange_packed_dp2_sp2_zero3_text_only_rank": dict(
        family="qwen2_vl", sp=2, dp=2, stage=3, packed=True, encoding="exchange", text_only_rank=1
    ),
    "qwen3_vl_sp4_zero3": dict(family="qwen3_vl", sp=4, stage=3),
    "qwen3_vl_exchange_sp4_zero2": dict(family="qwen3_vl", sp=4, stage=2, encoding="exchange"),
    "llava_packed_exchange_dp2_sp2_zero3": dict(family="llava", sp=2, dp=2, stage=3, packed=True, encoding="exchange"),
    "qwen3_vl_packed_dp2_sp2_zero3_text_only_rank": dict(
        family="qwen3_vl", sp=2, dp=2, stage=3, packed=True, text_only_rank=1
    ),
    "gemma3_sp4_zero3": dict(family="gemma3", sp=4, stage=3),
    "gemma3_packed_exchange_dp2_sp2_zero3_text_only_rank": dict(
        family="gemma3", sp=2, dp=2, stage=3, packed=True, encoding="exchange", text_only_rank=1
    ),
}


REFUSED_CASES = {"gemma3_ring2_zero2": dict(family="gemma3", sp=2, ring=2, stage=2, refused=True)}


two_process_results = CaseTable(
    "two_process_results", "tests.test_vision:fit_case", 2, {**TWO_PROCESS_CASES, **REFUSED_CASES}
).fixture()
four_process_results = CaseTable("four_process_results", "tests.test_vision:fit_case", 4, FOUR_PROCESS_CASES).fixture()


def reference_training(
    case: dict[str, Any],
) -> tuple[list[list[float]], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, plain model: each step the mean over DP ranks of their batch's token-mean loss, SGD. Returns
    each DP rank's step losses and the weights before and after."""
    family, dp = case["family"], case.get("dp", 1)
    model = tiny_model(family)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = case_batches(case)
    losses: list[list[float]] = [[] for _ in range(dp)]
    for step in range(STEPS):
        total = torch.zeros(())
        for rank in range(dp):
            loss_sum, count = plain_loss_sum(family, model, batches[rank + dp * step])
            losses[rank].append((loss_sum / count).item())
            total = total + loss_sum / count / dp
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses, initial, {n: p.detach() for n, p in model.named_parameters()}


def check_against_reference(name: str, case: dict[str, Any], results: list[dict[str, Any]]) -> None:
    from tests.tiny import relative_update_error

    losses, initial, expected = reference_training(case)
    sp, dp = case["sp"], case.get("dp", 1)
    # which DP group trains which of a step's batches is the sampler's choice: compare each step's losses as a set
    got_losses = torch.tensor([result[name]["losses"] for result in results]).view(dp, sp, STEPS)
    torch.testing.assert_close(got_losses, got_losses[:, :1].expand_as(got_losses), rtol=0, atol=0)  # one SP group
    torch.testing.assert_close(
        got_losses[:, 0].sort(dim=0).values, torch.tensor(losses).sort(dim=0).values, rtol=1e-5, atol=0
    )
    for rank, result in enumerate(results):
        got = result[name]
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"


@pytest.mark.parametrize("name", TWO_PROCESS_CASES)
def test_sp2_equals_one_process_of_the_plain_model(two_process_results: list[dict[str, Any]], name: str) -> None:
    check_against_reference(name, TWO_PROCESS_CASES[name], two_process_results)


def test_gemma3_images_under_the_ring_are_refused_before_any_step(two_process_results: list[dict[str, Any]]) -> None:
    for result in two_process_results:
        refused = result["gemma3_ring2_zero2"]
        assert "attend to themselves bidirectionally" in refused["refusal"] and "ring_size=1" in refused["refusal"]
        assert refused["losses"] == []


@pytest.mark.parametrize("name", FOUR_PROCESS_CASES)
def test_sp4_and_dp_x_sp_equal_one_process_of_the_plain_model(
    four_process_results: list[dict[str, Any]], name: str
) -> None:
    check_against_reference(name, FOUR_PROCESS_CASES[name], four_process_results)


# ---------------------------------------------------------------------------------------------
# VisionChatDataModule: local chats with image paths, a processor folder made here
# ---------------------------------------------------------------------------------------------
TOKENS_PER_IMAGE = {"llava": 16, "gemma3": 4}


@pytest.fixture(scope="module", params=["llava", "gemma3"])
def chat_files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from examples.make_vlm_data import save_llava_processor
    from tests.vision_data import save_gemma3_processor, save_tiny_chats

    family = request.param
    root = tmp_path_factory.mktemp(f"vision_chats_{family}")
    (root / "processor").mkdir()
    save = save_llava_processor if family == "llava" else save_gemma3_processor
    fields = save(root / "processor")
    return {
        "chats": save_tiny_chats(root),
        "processor": str(root / "processor"),
        "media": str(root),
        "fields": fields,
        "family": family,
    }


def chat_data(files: dict[str, Any], mode: str, batch_size: int = 2) -> Any:
    from lightning_ulysses.finetune import VisionChatDataModule

    data = VisionChatDataModule(
        [files["chats"]],
        files["processor"],
        media_root=files["media"],
        seq_len=256,
        mode=mode,
        batch_size=batch_size,
        val_fraction=0.3,
    )
    data.setup("fit")
    return data


@pytest.mark.parametrize("chat_files", ["llava"], indirect=True)  # the families share the dataset and collate
def test_workers_start_from_a_fork_server_where_a_forked_one_can_hang(
    chat_files: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    check_workers_from_a_fork_server(chat_data(chat_files, "packed"), monkeypatch)


def test_the_shipped_vision_example_is_what_its_script_makes(tmp_path: Path) -> None:
    """examples/data/vlm (configs/vlm_sft_quickstart.yaml's data) equals a fresh run of examples/make_vlm_data.py,
    and the config's ``image_token_id`` is the processor's."""
    import numpy as np
    import yaml
    from PIL import Image

    from examples.make_vlm_data import FOLDER, make

    fields = make(tmp_path)
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert made == sorted(p.relative_to(FOLDER) for p in FOLDER.rglob("*") if p.is_file())
    for path in made:
        if path.suffix == ".png":
            assert np.array_equal(np.asarray(Image.open(tmp_path / path)), np.asarray(Image.open(FOLDER / path))), path
        else:
            assert (tmp_path / path).read_text() == (FOLDER / path).read_text(), path
    config = yaml.safe_load((FOLDER.parent.parent.parent / "configs" / "vlm_sft_quickstart.yaml").read_text())
    assert config["model"]["init_args"]["model"]["image_token_id"] == fields["image_token_id"]


def test_chat_rows_label_the_assistant_and_carry_their_images(chat_files: dict[str, Any]) -> None:
    data = chat_data(chat_files, "packed")
    image = chat_files["fields"]["image_token_id"]
    for row in (data.train_dataset[i] for i in range(len(data.train_dataset))):
        ids, labels, positions = row["input_ids"], row["labels"], row["position_ids"]
        starts = (positions == 0).nonzero()[:, 0].tolist() + [len(ids)]
        spans = zip(starts[:-1], starts[1:], strict=True)
        answers = [data.tokenizer.decode(ids[s:e][labels[s:e] != -100]) for s, e in spans]
        assert all(a.startswith("Noise number ") and a.endswith(".<|im_end|>\n") for a in answers), answers
        tokens_per_image = TOKENS_PER_IMAGE[chat_files["family"]]
        assert int((ids == image).sum()) == tokens_per_image * row["vision"]["pixel_values"].shape[0]
        assert (labels[ids == image] == -100).all()
    assert any(len(data.train_dataset.rows[i]) > 1 for i in range(len(data.train_dataset)))  # packing happened


def test_a_chat_batch_trains_as_the_plain_model(chat_files: dict[str, Any]) -> None:
    """A padded batch of the data module, the VisionLanguageModel path at sp=1 vs each row alone in the plain model."""
    fields, family = chat_files["fields"], chat_files["family"]
    batch = next(iter(chat_data(chat_files, "padded", batch_size=3).train_dataloader()))
    model = tiny_model(family, **fields)
    expected_sum, expected_count, taken = torch.zeros(()), 0, 0
    for row in range(batch["input_ids"].shape[0]):
        length = int(batch["attention_mask"][row].sum())
        ids, labels = batch["input_ids"][row : row + 1, :length], batch["labels"][row : row + 1, :length]
        placeholders = ids == fields["image_token_id"]
        images = int(placeholders.sum()) // TOKENS_PER_IMAGE[family]
        inputs = {"pixel_values": batch["vision"]["pixel_values"][taken : taken + images]}
        if family == "gemma3":
            inputs["token_type_ids"] = placeholders.long()
        taken += images
        count = int((labels[:, 1:] != -100).sum())
        expected_sum = expected_sum + model(input_ids=ids, labels=labels, **inputs).loss * count
        expected_count += count
    got_sum, got_count = patched_loss_sum(vision_module(family, model), model, batch)
    assert int(got_count) == expected_count
    torch.testing.assert_close(got_sum, expected_sum, rtol=1e-5, atol=0)


def test_exchange_balances_the_items_over_the_ranks() -> None:
    """``balanced_owners`` on the test batches and on many random ones: every item owned once, and no rank more
    than the largest item above the least loaded one (largest-first greedy). Measured on QWEN_ROWS (images of 4, 6,
    1 and 3 rows, a video of 8): rows per rank [22] at sp=1, [11, 11] at sp=2, [8, 6, 4, 4] at sp=4 (patches: x4;
    images and video through the same tower, balanced together)."""
    from lightning_ulysses.vision.embed import balanced_owners, owners_by_modality

    rows = [4, 6, 1, 3]  # QWEN_ROWS' images (grids / 4); its video (8 rows) is a modality of its own
    loads = {}
    for sp in (1, 2, 4):
        owners = owners_by_modality({"image": rows, "video": [8]}, sp)
        loads[sp] = [
            sum(r for r, o in zip([*rows, 8], [*owners["image"], *owners["video"]], strict=True) if o == rank)
            for rank in range(sp)
        ]
    assert loads == {1: [22], 2: [11, 11], 4: [8, 6, 4, 4]}
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        items = torch.randint(1, 50, (int(torch.randint(1, 12, (1,), generator=generator)),), generator=generator)
        sp = int(torch.randint(2, 9, (1,), generator=generator))
        owners = balanced_owners(items.tolist(), sp)
        per_rank = torch.zeros(sp, dtype=torch.long).index_add_(0, torch.tensor(owners), items)
        assert int(per_rank.sum()) == int(items.sum())
        assert int(per_rank.max() - per_rank.min()) <= int(items.max())


def test_shard_encoding_runs_the_vision_tower_on_the_items_of_each_shard() -> None:
    """Measured: the patches each rank's vision tower receives, against the items with a placeholder in its shard
    (read from the token runs here; a shard without any item of a modality encodes its smallest one), and with
    "all" every patch on every rank."""
    model = tiny_model("qwen2_vl")
    module = vision_module("qwen2_vl", model)
    batch = family_batch("qwen2_vl")
    seen: list[int] = []
    visual_forward = model.model.visual.forward
    model.model.visual.forward = lambda pixels, **kw: seen.append(pixels.shape[0]) or visual_forward(pixels, **kw)
    ids = prepare_batch(batch, 4)["input_ids"]
    patches = {
        "image": batch["vision"]["image_grid_thw"].prod(-1).tolist(),
        "video": batch["vision"]["video_grid_thw"].prod(-1).tolist(),
    }
    total = sum(map(sum, patches.values()))
    for encoding, sp in (("shard", 4), ("all", 4), ("shard", 2)):
        module.hparams.vision_encoding = encoding
        per_rank = []
        for rank in range(sp):
            seen.clear()
            with torch.no_grad():
                merged_inputs_embeds(model, module.family, sp_prepared(module, batch, sp, rank), encoding)
            per_rank.append(sum(seen))
        local = ids.shape[1] // sp
        expected = []
        for rank in range(sp):
            needed = 0
            for kind, token in (("image", 120), ("video", 121)):
                flat = (ids == token).flatten()
                item = (flat & ~torch.cat([flat.new_zeros(1), flat[:-1]])).cumsum(0) - 1  # item of each placeholder
                columns = torch.arange(ids.numel()) % ids.shape[1]
                here = flat & (columns >= rank * local) & (columns < (rank + 1) * local)
                # a shard without any of a modality still encodes its smallest item (every rank runs the tower)
                items = item[here].unique().tolist() or [min(range(len(patches[kind])), key=patches[kind].__getitem__)]
                needed += sum(patches[kind][i] for i in items)
            expected.append(needed if encoding == "shard" else total)
        assert per_rank == expected, (encoding, sp, per_rank, expected)
        if encoding == "shard":
            assert sum(per_rank) < sp * total
