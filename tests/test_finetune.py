"""Chat SFT: labels on exactly the assistant's tokens, the length policy, packing, and SP training equal to one process.

The multi-process test trains ``CausalLM`` on ``SFTDataModule`` rows under ``UlyssesStrategy(sp_size=2)`` and compares
with plain transformers in one process, every record alone (tokenized by the chat template, cut to ``seq_len``), loss
on the assistant's tokens: the loss of each step and the validation loss (rtol 1e-5), the weights after SGD steps
(relative update error < 1e-4). Packed rows put a sample border exactly on the shard border and a sample across it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_ulysses import UlyssesStrategy
from lightning_ulysses.finetune import (
    DPO,
    PreferenceDataModule,
    SampleTooLongError,
    SFTDataModule,
    TemplateError,
    byte_chat_tokenizer,
    load_records,
    pack_rows,
    tokenize_record,
)
from lightning_ulysses.finetune.packing import trained_tokens
from lightning_ulysses.model import CausalLM, build_config
from lightning_ulysses.sharding import IGNORE_INDEX
from tests.cases import CaseTable
from tests.finetune_data import chat, chat_of_tokens, preference_records, sft_records, write_jsonl
from tests.loaders import check_workers_from_a_fork_server
from tests.tiny import TINY_LLAMA, cpu_trainer, epoch_order, gathered_parameters, relative_update_error

pytestmark = pytest.mark.distributed

SEQ, LR, STEPS = 64, 0.5, 2


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local tokenizer folder with a chat template, as ``save_pretrained`` writes it."""
    folder = tmp_path_factory.mktemp("tokenizer")
    byte_chat_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def data_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sft")
    val = [chat(4, 6, 20 + i, turns=1 + i % 2, system=i % 3 == 0) for i in range(5)]
    return {
        "train": str(write_jsonl(root / "train.jsonl", sft_records(SEQ))),
        "val": str(write_jsonl(root / "val.jsonl", val)),
    }


def sft_data(
    files: dict[str, str], tokenizer: str, mode: str = "packed", batch_size: int = 64, **kwargs: Any
) -> SFTDataModule:
    return SFTDataModule(
        paths=[files["train"]],
        val_paths=[files["val"]],
        tokenizer=tokenizer,
        seq_len=SEQ,
        mode=mode,
        batch_size=batch_size,
        **kwargs,
    )


def labelled_text(tokenizer: Any, ids: list[int], labels: list[int]) -> str:
    assert all(label in (IGNORE_INDEX, token) for token, label in zip(ids, labels))
    return tokenizer.decode([token for token, label in zip(ids, labels) if label != IGNORE_INDEX])


# ---------------------------------------------------------------------------------------------
# labels: exactly the assistant's tokens
# ---------------------------------------------------------------------------------------------
def test_labels_are_the_assistant_tokens_of_the_template(tokenizer_folder: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    record = chat(9, 5, 3, turns=3, system=True)
    ids, labels = tokenize_record(tokenizer, record)
    # as transformers marks the {% generation %} blocks
    marked = tokenizer.apply_chat_template(record["messages"], return_dict=True, return_assistant_tokens_mask=True)
    assert ids == marked["input_ids"]
    assert [label != IGNORE_INDEX for label in labels] == [bool(m) for m in marked["assistant_masks"]]
    answers = [m["content"] + "<|im_end|>\n" for m in record["messages"] if m["role"] == "assistant"]
    assert labelled_text(tokenizer, ids, labels) == "".join(answers)
    # the same template without its markers: the prefix derivation finds the same tokens
    tokenizer.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert tokenize_record(tokenizer, record) == (ids, labels)


def test_prompt_completion_records(tokenizer_folder: str) -> None:
    tokenizer = byte_chat_tokenizer()
    ids, labels = tokenize_record(tokenizer, {"prompt": "Q: 2+2?\nA:", "completion": " 4"})
    assert (
        tokenizer.decode(ids) == "Q: 2+2?\nA: 4<|im_end|>" and labelled_text(tokenizer, ids, labels) == " 4<|im_end|>"
    )
    prompt = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ]
    completion = [{"role": "assistant", "content": "ciao"}]
    ids, labels = tokenize_record(tokenizer, {"prompt": prompt, "completion": completion})
    assert labelled_text(tokenizer, ids, labels) == "ciao<|im_end|>\n"  # the prompt's assistant turn is not trained
    assert ids == tokenize_record(tokenizer, {"messages": prompt + completion})[0]


def merging_tokenizer(template: str) -> Any:
    """Characters as tokens, but ``>4`` is one token: a template that puts an answer "4..." right after ``>`` merges
    the border of the assistant's turn into a token."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789 >:\n"))
    vocab = {c: i for i, c in enumerate(chars)} | {">4": len(chars)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[(">", "4")])))
    tokenizer.chat_template = template
    return tokenizer


def test_templates_whose_assistant_tokens_cannot_be_located_are_refused() -> None:
    plain = (
        "{% for m in messages %}{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant>{% endif %}"
    )
    messages = [{"role": "user", "content": "two plus two"}, {"role": "assistant", "content": "4"}]
    with pytest.raises(TemplateError, match="spans the border of an assistant turn"):
        tokenize_record(merging_tokenizer(plain), {"messages": messages})
    ids, labels = tokenize_record(
        merging_tokenizer(plain), {"messages": [messages[0], {"role": "assistant", "content": "four"}]}
    )
    assert labelled_text(merging_tokenizer(plain), ids, labels).replace(" ", "") == "four\n"
    # earlier answers rendered differently once a later turn follows: no prefix locates them
    last_only = (
        "{% for m in messages %}{{ m.role }}>{% if m.role != 'assistant' or loop.last %}{{ m.content }}"
        "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant>{% endif %}"
    )
    turns = [*messages, {"role": "user", "content": "and three"}, {"role": "assistant", "content": "six"}]
    with pytest.raises(TemplateError, match="does not begin the rendering of the whole conversation"):
        tokenize_record(merging_tokenizer(last_only), {"messages": turns})
    no_template = merging_tokenizer("")
    no_template.chat_template = None
    with pytest.raises(TemplateError, match="has no chat template"):
        tokenize_record(no_template, {"messages": messages})
    with pytest.raises(TemplateError, match="'prompt' and 'completion'"):
        tokenize_record(no_template, {"text": "raw"})


# ---------------------------------------------------------------------------------------------
# length policy, packing, the data module
# ---------------------------------------------------------------------------------------------
def test_pack_rows_keeps_every_sample_whole_and_within_the_row() -> None:
    lengths = [5, 64, 33, 31, 32, 32, 1, 60, 17, 40, 24]
    rows = pack_rows(lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert len(rows) == -(-sum(lengths) // 64)  # these lengths pack without a wasted row


@pytest.mark.parametrize("truncation", ["truncate", "drop", "refuse"])
def test_a_sample_longer_than_seq_len_is_cut_dropped_or_refused(data_files: dict[str, str], truncation: str) -> None:
    data = sft_data(data_files, "byte", truncation=truncation)
    if truncation == "refuse":
        with pytest.raises(SampleTooLongError, match=f"Sample 5 has 81 tokens, more than data.seq_len={SEQ}"):
            data.setup("fit")
        return
    data.setup("fit")
    report = data.reports["training"]
    records = sft_records(SEQ)
    assert (report.records, report.truncated, report.dropped_too_long) == (
        (len(records), 1, 0) if truncation == "truncate" else (len(records), 0, 1)
    )
    rows = [data.train_dataset[i] for i in range(len(data.train_dataset))]
    samples = [split_row(row) for row in rows]
    got = sorted((ids.tolist(), labels.tolist()) for row in samples for ids, labels in row)
    expected = []
    for record in records:
        ids, labels = tokenize_record(data.tokenizer, record)
        if len(ids) <= SEQ or truncation == "truncate":  # input ids and labels cut together
            expected.append((ids[:SEQ], labels[:SEQ]))
    assert got == sorted(expected)
    assert report.tokens == sum(len(ids) for ids, _ in expected) and all(len(row["input_ids"]) <= SEQ for row in rows)


def split_row(row: dict[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """The samples of a packed row, cut where its position ids restart."""
    starts = [*(row["position_ids"] == 0).nonzero().flatten().tolist(), len(row["input_ids"])]
    assert (row["position_ids"] == torch.cat([torch.arange(e - s) for s, e in zip(starts[:-1], starts[1:])])).all()
    return [(row["input_ids"][s:e], row["labels"][s:e]) for s, e in zip(starts[:-1], starts[1:])]


def test_samples_without_assistant_tokens_are_dropped_and_counted(tmp_path: Path) -> None:
    records = [chat_of_tokens(30, 1), {"messages": [{"role": "user", "content": "no answer"}]}, chat_of_tokens(50, 2)]
    files = {
        "train": str(write_jsonl(tmp_path / "t.jsonl", records)),
        "val": str(write_jsonl(tmp_path / "v.jsonl", records[:1])),
    }
    data = sft_data(files, "byte", mode="padded")
    data.setup("fit")
    report = data.reports["training"]
    assert (report.kept, report.dropped_no_labels, report.rows) == (2, 1, 2)
    assert "1 dropped with no assistant token" in str(report)


def test_parquet_and_arrow_files_give_the_same_rows(data_files: dict[str, str], tmp_path: Path) -> None:
    records = load_records([data_files["train"]])
    records.to_parquet(str(tmp_path / "train.parquet"))
    records.save_to_disk(str(tmp_path / "saved"))
    rows = {}
    for name, path in (
        ("jsonl", data_files["train"]),
        ("parquet", str(tmp_path / "train.parquet")),
        ("arrow", str(tmp_path / "saved" / "*.arrow")),
    ):
        data = sft_data({**data_files, "train": path}, "byte")
        data.setup("fit")
        rows[name] = [{k: v.tolist() for k, v in data.train_dataset[i].items()} for i in range(len(data.train_dataset))]
    assert rows["jsonl"] == rows["parquet"] == rows["arrow"] and len(rows["jsonl"]) >= 5


# ---------------------------------------------------------------------------------------------
# multi-process: CausalLM on SFTDataModule under UlyssesStrategy vs one process
# ---------------------------------------------------------------------------------------------
class RecordingSGDCausalLM(CausalLM):
    """SGD exposes the gradient's scale in the weights; the step losses are recorded."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def fresh_model(vocab_size: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config(TINY_LLAMA, vocab_size), attn_implementation="sdpa")


SP_CASES = {
    "packed_sp2_zero2": dict(mode="packed", stage=2),
    "padded_sp2_zero3": dict(mode="padded", stage=3),
}
DP_SP_CASES = {"packed_dp2_sp2_zero3": dict(mode="packed", stage=3)}  # on 4 processes


def fit_sft_case(
    name: str, case: dict[str, Any], world_size: int, files: dict[str, str], tokenizer: str
) -> dict[str, Any]:
    data = sft_data(files, tokenizer, mode=case["mode"])
    module = RecordingSGDCausalLM(model=TINY_LLAMA, vocab_size=data.vocab_size)
    module.model, module.losses = fresh_model(data.vocab_size), []
    trainer = cpu_trainer(
        world_size,
        UlyssesStrategy(sp_size=2, stage=case["stage"], attn_implementation="sdpa"),
        max_steps=STEPS,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, data)
    trainer.validate(module, data, verbose=False)
    return {
        "losses": module.losses,
        "val_loss": trainer.callback_metrics["val_loss"].item(),
        "params": gathered_parameters(module.model, case["stage"] == 3),
    }


@pytest.fixture(scope="module")
def sp_results(data_files: dict[str, str], tokenizer_folder: str) -> list[dict[str, Any]]:
    return CaseTable("sp_results", "tests.test_finetune:fit_sft_case", 2, SP_CASES).run(
        {"files": data_files, "tokenizer": tokenizer_folder}
    )


@pytest.fixture(scope="module")
def dp_sp_results(data_files: dict[str, str], tokenizer_folder: str) -> list[dict[str, Any]]:
    return CaseTable("dp_sp_results", "tests.test_finetune:fit_sft_case", 4, DP_SP_CASES).run(
        {"files": data_files, "tokenizer": tokenizer_folder}
    )


def reference_samples(path: str, tokenizer: Any) -> list[tuple[Tensor, Tensor]]:
    """Every record alone, tokenized by the chat template and cut to ``seq_len``: no packing code involved."""
    samples = []
    for record in load_records([path]):
        ids, labels = tokenize_record(tokenizer, {k: v for k, v in record.items() if v is not None})
        samples.append((torch.tensor(ids[:SEQ]), torch.tensor(labels[:SEQ])))
    return samples


def assistant_token_mean(model: torch.nn.Module, samples: list[tuple[Tensor, Tensor]]) -> Tensor:
    total, count = torch.zeros(()), 0
    for ids, labels in samples:
        logits = model(input_ids=ids[None]).logits[0]
        total = total + F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="sum")
        count += int((labels[1:] != IGNORE_INDEX).sum())
    return total / count


def test_packed_rows_put_sample_borders_on_and_across_the_shard_border(data_files: dict[str, str]) -> None:
    """The equivalence below covers both cases: at sp=2 the batch (every row, padded to ``SEQ``) splits at SEQ / 2."""
    data = sft_data(data_files, "byte")
    data.setup("fit")
    rows = [data.train_dataset[i] for i in range(len(data.train_dataset))]
    half = SEQ // 2
    assert max(len(row["input_ids"]) for row in rows) == SEQ
    assert any(len(row["position_ids"]) > half and row["position_ids"][half] == 0 for row in rows)
    assert any(
        row["position_ids"][half] > 0 and (row["labels"][half - 1 : half + 1] != IGNORE_INDEX).all()
        for row in rows
        if len(row["input_ids"]) > half
    )


@pytest.mark.parametrize("name", SP_CASES)
def test_sft_under_sp_equals_one_process(
    sp_results: list[dict[str, Any]], data_files: dict[str, str], tokenizer_folder: str, name: str
) -> None:
    tokenizer = byte_chat_tokenizer()
    train, val = (reference_samples(data_files[split], tokenizer) for split in ("train", "val"))
    model = fresh_model(len(tokenizer))
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):  # one batch holds every row: each step is full-batch, whatever the row order
        loss = assistant_token_mean(model, train)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        val_loss = assistant_token_mean(model, val).item()
    expected = {n: p.detach() for n, p in model.named_parameters()}
    for rank, result in enumerate(sp_results):
        got = result[name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
        assert got["val_loss"] == pytest.approx(val_loss, rel=1e-5), f"rank {rank}"
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"


# ---------------------------------------------------------------------------------------------
# DPO: sequence log-probabilities summed over the SP group, frozen reference, vs one process
# ---------------------------------------------------------------------------------------------
BETA = 0.5
DPO_CASES = {"dpo_sp2_zero2": dict(stage=2), "dpo_sp2_zero3": dict(stage=3)}
# dp=2, one pair a batch, one epoch, then validation on 5 pairs: DP rank 1's third batch is a repeat of pair 0
DPO_ODD_VAL_CASES = {"dpo_dp2_zero2_odd_val": dict(stage=2, sp=1)}
ODD_VAL_PAIRS = 5


class SGDDPO(DPO):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR)


@pytest.fixture(scope="module")
def dpo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny saved model (policy and reference start from it) and preference pairs."""
    root = tmp_path_factory.mktemp("dpo")
    fresh_model(len(byte_chat_tokenizer())).save_pretrained(root / "model")
    path = str(write_jsonl(root / "pairs.jsonl", preference_records()))
    odd = str(write_jsonl(root / "odd_pairs.jsonl", preference_records()[:ODD_VAL_PAIRS]))
    return {"model": str(root / "model"), "train": path, "val": path, "odd_val": odd}


def test_sft_and_dpo_workers_start_from_a_fork_server_where_a_forked_one_can_hang(
    data_files: dict[str, str], tokenizer_folder: str, dpo_files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sft = sft_data(data_files, tokenizer_folder, batch_size=2)
    dpo = PreferenceDataModule(paths=[dpo_files["train"]], val_paths=[dpo_files["val"]], seq_len=SEQ * 4, batch_size=2)
    for data in (sft, dpo):
        data.setup("fit")
        check_workers_from_a_fork_server(data, monkeypatch)


def fit_dpo_case(
    name: str, case: dict[str, Any], world_size: int, model: str, train: str, val: str, odd_val: str
) -> dict[str, Any]:
    """DPO_CASES: sp=2, every pair in one batch, STEPS steps, no validation. DPO_ODD_VAL_CASES: dp=2, one pair a
    batch, one epoch, then the validation of the odd pairs."""
    odd = name in DPO_ODD_VAL_CASES
    data = PreferenceDataModule(
        paths=[train],
        val_paths=[odd_val if odd else val],
        seq_len=SEQ * 4,
        batch_size=1 if odd else 64,
    )
    module = SGDDPO(model=model, pretrained=True, beta=BETA, vocab_size=data.vocab_size)
    trainer = cpu_trainer(
        world_size,
        UlyssesStrategy(sp_size=case.get("sp", 2), stage=case["stage"], attn_implementation="sdpa"),
        max_steps=-1 if odd else STEPS,
        max_epochs=1 if odd else None,
        limit_val_batches=None if odd else 0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, data)
    prefix = "val" if odd else "train"  # the validation at the epoch's end sees the final weights
    result = {key: trainer.callback_metrics[f"{prefix}_{key}"].item() for key in DPO_METRICS}
    result["console"] = sorted(trainer.progress_bar_metrics)  # what the progress lines show
    result["params"] = gathered_parameters(module.model, case["stage"] == 3)
    result["reference"] = gathered_parameters(module.reference, case["stage"] == 3)
    return result


DPO_METRICS = ("loss", "rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy")


@pytest.fixture(scope="module")
def dpo_results(dpo_files: dict[str, str]) -> list[dict[str, Any]]:
    return CaseTable("dpo_results", "tests.test_finetune:fit_dpo_case", 2, {**DPO_CASES, **DPO_ODD_VAL_CASES}).run(
        dpo_files
    )


def completion_log_prob(model: torch.nn.Module, ids: Tensor, labels: Tensor) -> Tensor:
    log_probs = model(input_ids=ids[None]).logits[0, :-1].log_softmax(-1)
    valid = labels[1:] != IGNORE_INDEX
    return log_probs[valid].gather(-1, labels[1:][valid, None]).sum()


def reference_dpo(
    folder: str, records: list[dict[str, Any]]
) -> tuple[dict[str, float], dict[str, Tensor], dict[str, Tensor]]:
    """One process, plain transformers: each sequence alone, SGD on the mean DPO loss over every pair; the metrics of
    the last step, the initial and the final weights."""
    from transformers import AutoModelForCausalLM

    policy, reference = (AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa") for _ in range(2))
    initial = {n: p.detach().clone() for n, p in policy.named_parameters()}
    optimizer = torch.optim.SGD(policy.parameters(), lr=LR)
    for _ in range(STEPS):
        loss, metrics = dpo_metrics(policy, reference, records)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return metrics, initial, {n: p.detach() for n, p in policy.named_parameters()}


def dpo_metrics(
    policy: torch.nn.Module, reference: torch.nn.Module, records: list[dict[str, Any]]
) -> tuple[Tensor, dict[str, float]]:
    """One process, each sequence alone: the mean DPO loss over every pair (differentiable) and the metrics."""
    tokenizer = byte_chat_tokenizer()
    sequences = [
        [
            tuple(map(torch.tensor, tokenize_record(tokenizer, {"prompt": r["prompt"], "completion": r[side]})))
            for side in ("chosen", "rejected")
        ]
        for r in records
    ]
    rewards = torch.stack(
        [
            torch.stack(
                [
                    BETA
                    * (completion_log_prob(policy, ids, labels) - completion_log_prob(reference, ids, labels).detach())
                    for ids, labels in pair
                ]
            )
            for pair in sequences
        ]
    )
    loss = -F.logsigmoid(rewards[:, 0] - rewards[:, 1]).mean()
    chosen, rejected = rewards.detach()[:, 0], rewards.detach()[:, 1]
    return loss, {
        "loss": loss.item(),
        "rewards_chosen": chosen.mean().item(),
        "rewards_rejected": rejected.mean().item(),
        "rewards_margin": (chosen - rejected).mean().item(),
        "rewards_accuracy": (chosen > rejected).float().mean().item(),
    }


def test_dpo_pairs_cross_the_shard_border(dpo_files: dict[str, str]) -> None:
    """At sp=2 the batch (every pair, padded to the longest) splits in the middle: some chosen sequence ends before
    it and some runs across it, so both the per-rank sums and their reduction are exercised."""
    data = PreferenceDataModule(paths=[dpo_files["train"]], val_paths=[dpo_files["val"]], seq_len=SEQ * 4)
    data.setup("fit")
    rows = [data.train_dataset[i] for i in range(len(data.train_dataset))]
    half = -(-max(len(row["input_ids"]) for row in rows) // 2)
    chosen_ends = [int((row["sequence_ids"] == 0).sum()) for row in rows]
    assert any(end <= half for end in chosen_ends) and any(end > half for end in chosen_ends)
    assert all(row["position_ids"][end] == 0 for row, end in zip(rows, chosen_ends))


@pytest.mark.parametrize("name", DPO_CASES)
def test_dpo_under_sp_equals_one_process(
    dpo_results: list[dict[str, Any]], dpo_files: dict[str, str], name: str
) -> None:
    metrics, initial, expected = reference_dpo(dpo_files["model"], preference_records())
    assert metrics["rewards_margin"] != 0 and metrics["loss"] != pytest.approx(torch.log(torch.tensor(2.0)).item())
    for rank, result in enumerate(dpo_results):
        got = result[name]
        for key in DPO_METRICS:
            assert got[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), f"{name} rank {rank}: {key}"
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"
        assert all(torch.equal(got["reference"][n], initial[n]) for n in initial), "the reference model changed"
        assert "train_loss" in got["console"], got["console"]


def test_dpo_validation_counts_each_pair_once_over_dp_ranks(
    dpo_results: list[dict[str, Any]], dpo_files: dict[str, str]
) -> None:
    """dp=2, 5 validation pairs of one a batch: the repeat of pair 0 that evens out the DP ranks must not count (it
    would log a loss of log 2, zero rewards and a wrong preference)."""
    from transformers import AutoModelForCausalLM

    policy, reference = (
        AutoModelForCausalLM.from_pretrained(dpo_files["model"], attn_implementation="sdpa") for _ in range(2)
    )
    for name in DPO_ODD_VAL_CASES:
        policy.load_state_dict(dpo_results[0][name]["params"])
        with torch.no_grad():
            _, expected = dpo_metrics(policy, reference, preference_records()[:ODD_VAL_PAIRS])
        assert 0 < expected["rewards_accuracy"] < 1 and expected["rewards_margin"] != 0, "the pairs must tell apart"
        for rank, result in enumerate(dpo_results):
            for key in DPO_METRICS:
                assert result[name][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), f"{name} {rank}: {key}"


@pytest.mark.parametrize("name", DP_SP_CASES)
def test_sft_under_dp_and_sp_equals_one_process(
    dp_sp_results: list[dict[str, Any]], data_files: dict[str, str], name: str
) -> None:
    """dp=2 x sp=2: each DP group trains on its half of the packed rows (the distributed sampler's order, one batch
    per epoch); the update is the mean of the two groups' assistant-token means, as DDP averages them."""
    data = sft_data(data_files, "byte", mode=DP_SP_CASES[name]["mode"])
    data.setup("fit")
    rows = [data.train_dataset[i] for i in range(len(data.train_dataset))]
    model = fresh_model(data.vocab_size)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses: list[list[float]] = [[], []]
    for step in range(STEPS):
        group_losses = [
            assistant_token_mean(model, [s for row in epoch_order(rows, 2, d, step) for s in split_row(row)])
            for d in range(2)
        ]
        for d, loss in enumerate(group_losses):
            losses[d].append(loss.item())
        torch.stack(group_losses).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = {n: p.detach() for n, p in model.named_parameters()}
    for rank, result in enumerate(dp_sp_results):
        got = result[name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses[rank // 2]), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["params"])
        assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"


@pytest.mark.parametrize("truncation", ["truncate", "drop", "refuse"])
def test_preference_rows_hold_the_pair_labelled_on_the_completions(dpo_files: dict[str, str], truncation: str) -> None:
    """Each row is prompt + chosen then prompt + rejected, labelled on the completions only; a sequence longer than
    seq_len / 2 is cut (with its labels), drops its pair, or is refused."""
    records, seq_len = preference_records(), 110
    data = PreferenceDataModule(
        paths=[dpo_files["train"]], val_paths=[dpo_files["val"]], seq_len=seq_len, truncation=truncation
    )
    if truncation == "refuse":
        with pytest.raises(
            SampleTooLongError, match=rf"more than data.seq_len // 2 \(the chosen sequence of a pair\)={seq_len // 2}"
        ):
            data.setup("fit")
        return
    data.setup("fit")
    tokenizer = data.tokenizer
    expected = []
    for record in records:
        pair = [
            tokenize_record(tokenizer, {"prompt": record["prompt"], "completion": record[side]})
            for side in ("chosen", "rejected")
        ]
        cut = [(ids[: seq_len // 2], labels[: seq_len // 2]) for ids, labels in pair]
        fits = all(len(ids) <= seq_len // 2 for ids, _ in pair)
        if (truncation == "truncate" or fits) and all(trained_tokens(labels) for _, labels in cut):
            expected.append((record, cut))
    got = []
    for i in range(len(data.train_dataset)):
        row = data.train_dataset[i]
        got.append(
            [
                (row["input_ids"][row["sequence_ids"] == s].tolist(), row["labels"][row["sequence_ids"] == s].tolist())
                for s in (0, 1)
            ]
        )
    assert got == [cut for _, cut in expected] and 0 < len(expected) < len(records)
    report = data.reports["training"]
    assert report.kept + report.truncated == len(expected)
    assert report.dropped_too_long == (0 if truncation == "truncate" else len(records) - len(expected))
    assert report.truncated > 0 if truncation == "truncate" else report.truncated == 0
    record, [(ids, labels), _] = expected[0]
    prompt_text = tokenizer.apply_chat_template(record["prompt"], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode([t for t, label in zip(ids, labels) if label == IGNORE_INDEX]) == prompt_text
