"""LongTextDataModule and CausalLM: the data is what it claims, and SP training/validation equal one process.

The multi-process test trains and validates ``CausalLM`` on ``LongTextDataModule`` batches under
``UlyssesStrategy`` and compares with plain transformers run on every document alone, in one process:
weights after SGD steps (relative update error < 1e-4) and the token-weighted validation loss and
perplexity (rtol 1e-5). A factor of 2 in a gradient, or a mean of per-rank means, fails both.
"""

from __future__ import annotations

import json
import re
import sys
import sysconfig
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM

from lightning_ulysses import SFTDataModule, UlyssesStrategy
from lightning_ulysses.data import (
    LongTextDataModule,
    byte_tokenizer,
    collate_right_padded,
    find_text_files,
    pack_documents,
    split_documents,
    warn_on_empty_shards,
)
from lightning_ulysses.model import CausalLM, build_config
from lightning_ulysses.sharding import IGNORE_INDEX, prepare_batch
from tests.cases import CaseTable
from tests.loaders import check_workers_from_a_fork_server
from tests.tiny import TINY_LLAMA, cpu_trainer, relative_update_error

pytestmark = pytest.mark.distributed

SEQ, LR, STEPS = 32, 0.5, 2
BYTE_VOCAB = 259
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "sequence",
    "parallel",
    "ranks",
    "exchange",
    "heads",
]


def write_corpus(folder: Path, num_files: int = 12) -> Path:
    """Text files of different lengths (25 to 300 bytes), so rows hold several documents and padding varies."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(num_files):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(4 + (i * 11) % 50)]
        (folder / f"doc{i:02d}.txt").write_text(f"<file {i:02d}> " + " ".join(words) + "\n")
    return folder


def data_module(folder: Path | str, mode: str, batch_size: int) -> LongTextDataModule:
    return LongTextDataModule(
        paths=[str(folder)],
        pattern="*.txt",
        seq_len=SEQ,
        mode=mode,
        batch_size=batch_size,
        val_fraction=0.25,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


# ---------------------------------------------------------------------------------------------
# single-process unit tests
# ---------------------------------------------------------------------------------------------
def test_byte_tokenizer_is_bytes_plus_3_and_saves_with_the_model(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    data = LongTextDataModule()
    text = "def f(x):\n    return 'π ≈ 3.14'  # ünïcode </s> <pad>\n"  # special tokens' text stays bytes
    ids = data._encode(text)
    assert ids.tolist() == [b + 3 for b in text.encode()] + [data.tokenizer.eos_token_id]
    assert (data.tokenizer.pad_token_id, data.tokenizer.eos_token_id, data.vocab_size) == (0, 1, BYTE_VOCAB)
    assert data.tokenizer.decode(ids.tolist(), skip_special_tokens=True) == text
    data.tokenizer.save_pretrained(tmp_path)  # what export writes next to the model
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    source = (Path(sysconfig.get_paths()["stdlib"]) / "os.py").read_text()
    for document in (text, source):  # the data module's ids are those of ByT5's own tokenizer
        assert len(loaded) == BYTE_VOCAB
        assert data._encode(document).tolist() == loaded(document, split_special_tokens=True)["input_ids"]


def test_split_and_pack_restart_positions_at_every_document() -> None:
    documents = [torch.arange(100, 107).numpy(), torch.arange(200, 203).numpy(), torch.arange(300, 310).numpy()]
    pieces = split_documents(documents, max_len=4)
    assert [p.tolist() for p in pieces[:3]] == [[100, 101, 102, 103], [104, 105, 106], [200, 201, 202]]
    input_ids, position_ids = pack_documents(pieces, seq_len=5)
    assert input_ids.shape == position_ids.shape == (4, 5)  # 20 tokens, the last incomplete row dropped
    assert input_ids.flatten().tolist() == [t for p in pieces for t in p.tolist()][:20]
    assert position_ids[0].tolist() == [0, 1, 2, 3, 0]  # a 4-token piece, then the next piece starts
    assert position_ids[1].tolist() == [1, 2, 0, 1, 2]  # the piece cut by the row end continues its count


def test_packed_batch_ignores_the_label_across_document_borders() -> None:
    input_ids, position_ids = pack_documents([torch.arange(10, 13).numpy(), torch.arange(20, 25).numpy()], 8)
    batch = collate_right_padded(
        [{"input_ids": torch.from_numpy(input_ids[0]), "position_ids": torch.from_numpy(position_ids[0])}]
    )
    prepared = prepare_batch(batch, sp_size=2)
    assert prepared["shift_labels"][0].tolist() == [11, 12, IGNORE_INDEX, 21, 22, 23, 24, IGNORE_INDEX]


def decode_all(dataset: Dataset) -> str:
    return byte_tokenizer().decode(
        [t for sample in dataset for t in sample["input_ids"].tolist()], skip_special_tokens=True
    )


def test_collate_pads_right_and_masks_padding() -> None:
    batch = collate_right_padded([{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": torch.tensor([8])}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_data_module_splits_by_file(corpus: Path) -> None:
    """Training, validation and test hold different files; test runs on the test files."""
    for mode in ("packed", "documents"):
        data = data_module(corpus, mode, batch_size=2)
        data.setup("fit")
        datasets = (data.train_dataset, data.val_dataset, data.test_dataset)
        train, val, test = (set(re.findall(r"<file \d+>", decode_all(dataset))) for dataset in datasets)
        assert (len(val), len(test)) == (3, 1) and len(train | val | test) == 12  # val 0.25, test 0.05: at least 1
        assert not train & val and not train & test and not val & test
        assert sorted(sum(data.files.values(), [])) == sorted(corpus.glob("*.txt"))
        assert not set(data.files["test"]) & (set(data.files["train"]) | set(data.files["val"]))
        tested = torch.cat([batch["input_ids"].flatten() for batch in data.test_dataloader()]).tolist()
        assert set(re.findall(r"<file \d+>", byte_tokenizer().decode(tested, skip_special_tokens=True))) == test
        batch = next(iter(data.train_dataloader()))
        assert batch["input_ids"].shape[0] == 2 and batch["input_ids"].shape[1] <= SEQ
        if mode == "packed":
            assert batch["input_ids"].shape[1] == SEQ and (batch["position_ids"] == 0).sum() >= 1


def test_workers_start_from_a_fork_server_where_a_forked_one_can_hang(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = data_module(corpus, "documents", batch_size=2)
    data.setup("fit")
    check_workers_from_a_fork_server(data, monkeypatch)


def test_local_hugging_face_tokenizer(corpus: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["[PAD]", "[UNK]", "[EOS]", *sorted(set(WORDS))])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    ).save_pretrained(tmp_path)
    data = LongTextDataModule(
        paths=[str(corpus)], pattern="*.txt", tokenizer=str(tmp_path), seq_len=SEQ, mode="documents", val_fraction=0.25
    )
    data.setup("fit")
    assert data.vocab_size == len(vocab)
    ids = [t for sample in data.train_dataset for t in sample["input_ids"].tolist()]
    assert ids.count(vocab["[EOS]"]) == 8  # one per training file (12 files, 3 validate, 1 tests)
    assert vocab["quick"] in ids and max(ids) < len(vocab)


def test_files_that_are_not_text_are_skipped_with_one_warning(tmp_path: Path) -> None:
    folder = write_corpus(tmp_path / "mixed", num_files=6)
    (folder / "weights.bin").write_bytes(bytes(range(256)) * 4)
    (folder / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(64))
    (folder / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    data = LongTextDataModule(paths=[str(folder)], pattern="*", seq_len=SEQ, val_fraction=0.2, test_fraction=0.2)
    with pytest.warns(UserWarning, match=r"Skipped 3 of 9 files that are not UTF-8 text") as caught:
        data.setup("fit")
    assert len([w for w in caught if "not UTF-8" in str(w.message)]) == 1
    assert all(name in str(caught[0].message) for name in ("weights.bin", "logo.png", "latin1.txt"))
    assert len(sum(data.files.values(), [])) == 6
    text = "".join(decode_all(d) for d in (data.train_dataset, data.val_dataset, data.test_dataset))
    assert "\ufffd" not in text and text.count("<file") == 6
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "a.bin").write_bytes(bytes(10))
    with pytest.raises(ValueError, match="None of the 1 files .* is UTF-8 text"):
        LongTextDataModule(paths=[str(binary)], pattern="*").setup("fit")


def test_warns_when_sp_size_leaves_ranks_without_a_token(corpus: Path, tmp_path: Path) -> None:
    with pytest.warns(
        UserWarning, match=r"seq_len=5 split over sp_size=4 ranks .* SP rank\(s\) 3 hold no token.*e\.g\. 8"
    ):
        warn_on_empty_shards(5, 4)
    with pytest.warns(UserWarning, match=r"SP rank\(s\) 2-3 hold no token"):
        warn_on_empty_shards(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seq_len in (4, 7, 8, 1024):
            warn_on_empty_shards(seq_len, 4)
    data = LongTextDataModule(paths=[str(corpus)], pattern="*.txt", seq_len=2, val_fraction=0.25)
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(sp_size=4), global_rank=0)  # what setup reads of it
    with pytest.warns(UserWarning, match="data.seq_len=2 split over sp_size=4"):
        data.setup("fit")
    chat = {"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}
    (tmp_path / "chats.jsonl").write_text("\n".join([json.dumps(chat)] * 4))
    chats = SFTDataModule(paths=[str(tmp_path / "chats.jsonl")], seq_len=6, val_fraction=0.25)
    chats.trainer = data.trainer
    # warned at the start of set-up, before the records are read (here they then fail: none fits in 6 tokens)
    with (
        pytest.warns(UserWarning, match=r"data.seq_len=6 split over sp_size=4 .* SP rank\(s\) 3 hold no token"),
        pytest.raises(ValueError, match="No training sample is left"),
    ):
        chats.setup("fit")


@pytest.mark.parametrize("module", ["LongTextDataModule", "SFTDataModule"])
def test_data_modules_refuse_an_empty_micro_batch_when_built(module: str) -> None:
    """In Python, not only in the CLI's check: a micro-batch of no sample is refused naming data.batch_size, where
    torch's DataLoader would fail minutes later without naming it."""
    build = {"LongTextDataModule": LongTextDataModule, "SFTDataModule": SFTDataModule}[module]
    with pytest.raises(ValueError, match=r"data\.batch_size=0: .* must be at least 1"):
        build(paths=["unused.jsonl"] if module == "SFTDataModule" else ["unused"], batch_size=0)


def test_default_corpus_is_the_standard_library() -> None:
    """The standard library alone, the same list on every machine with this Python: every top-level module of the
    files is a standard one, every standard module with a source file is there, nothing from site-packages (whose
    third-party packages made most of the interpreter's library folder), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = find_text_files(["stdlib"], "*.py")
    assert files == sorted(files) and any(f.name == "os.py" for f in files)
    third_party = [f for f in files if {"site-packages", "dist-packages"} & set(f.relative_to(root).parts)]
    assert not third_party, f"{len(third_party)} of {len(files)} files are installed packages, e.g. {third_party[:3]}"
    top_level = {f.relative_to(root).parts[0].removesuffix(".py") for f in files}
    # besides the modules: the test suite, the frozen-module samples, the build's sysconfig data and Makefile folder
    extras = ("test", "__hello__", "__phello__")
    not_modules = {
        name
        for name in top_level - set(sys.stdlib_module_names)
        if name not in extras and not name.startswith(("_sysconfigdata", "config-"))
    }
    assert not not_modules, f"not standard-library modules: {sorted(not_modules)}"
    with_sources = {
        name
        for name in sys.stdlib_module_names
        if (root / f"{name}.py").is_file() or (root / name / "__init__.py").is_file()
    }
    assert with_sources <= top_level, sorted(with_sources - top_level)


def test_bad_data_paths_fail_with_what_to_change(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_text_files([str(tmp_path / "missing")], "*.txt")
    with pytest.raises(FileNotFoundError, match="data.pattern"):
        find_text_files([str(tmp_path)], "*.txt")
    with pytest.raises(FileNotFoundError, match="local tokenizer folder"):
        LongTextDataModule(tokenizer="gpt2")
    with pytest.raises(ValueError, match="Need at least 3 text files .* found 2"):
        data_module(write_corpus(tmp_path / "two", num_files=2), "packed", 1).setup("fit")
    with pytest.raises(ValueError, match="data.test_fraction must be at least 0 and leave files for training"):
        LongTextDataModule(val_fraction=0.5, test_fraction=0.5)
    data = data_module(write_corpus(tmp_path / "small", num_files=3), "packed", 1)
    data.seq_len = 4096
    with pytest.raises(ValueError, match="lower data.seq_len"):
        data.setup("fit")


# ---------------------------------------------------------------------------------------------
# multi-process: CausalLM on LongTextDataModule under UlyssesStrategy vs one process
# ---------------------------------------------------------------------------------------------
class SGDCausalLM(CausalLM):
    """SGD exposes the gradient's scale in the weights (AdamW would normalise a factor of 2 away)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def fresh_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config(TINY_LLAMA, BYTE_VOCAB), attn_implementation="sdpa")


def test_causal_lm_outside_ulysses_keeps_packed_documents_apart(corpus: Path) -> None:
    """Under any other strategy CausalLM prepares whole sequences itself and still masks at document borders."""
    data = data_module(corpus, "packed", batch_size=4)
    data.setup("fit")
    batch = next(iter(data.val_dataloader()))
    assert (batch["position_ids"][:, 1:] == 0).any(), "the batch should hold several documents per row"
    module = SGDCausalLM(model=TINY_LLAMA, vocab_size=BYTE_VOCAB)
    module.model = fresh_model()
    with torch.no_grad():
        loss = module.training_step(dict(batch), 0)
        samples = [
            {"input_ids": ids, "position_ids": pos} for ids, pos in zip(batch["input_ids"], batch["position_ids"])
        ]
        expected = token_mean_loss(fresh_model(), samples)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def fit_case(name: str, case: dict[str, Any], world_size: int, folder: str) -> dict[str, Any]:
    module = SGDCausalLM(model=TINY_LLAMA, vocab_size=BYTE_VOCAB)
    module.model = fresh_model()
    trainer = cpu_trainer(
        world_size,
        UlyssesStrategy(sp_size=case["sp"], stage=2, attn_implementation="sdpa"),
        max_steps=STEPS,
        num_sanity_val_steps=0,
    )
    data = data_module(folder, case["mode"], batch_size=case["batch_size"])
    if case["fit"]:
        trainer.fit(module, data)
    else:
        trainer.validate(module, data, verbose=False)
    result = {key: trainer.callback_metrics[key].item() for key in ("val_loss", "val_ppl")}
    if case.get("test"):
        trainer.test(module, data, verbose=False)
        result.update({key: trainer.callback_metrics[key].item() for key in ("test_loss", "test_ppl")})
        result["predictions"] = trainer.predict(module, data)
    result["params"] = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    return result


CASES = {
    # full-batch training (one batch holds every packed row): the step does not depend on the sample order
    "fit_sp2_packed": dict(sp=2, mode="packed", batch_size=64, fit=True),
    "validate_sp2_documents": dict(sp=2, mode="documents", batch_size=2, fit=False, test=True),
    "validate_dp2_documents": dict(sp=1, mode="documents", batch_size=2, fit=False),
}


def document_losses(model: torch.nn.Module, sample: dict[str, Tensor]) -> tuple[Tensor, int]:
    """Sum and count of next-token losses of every document of one sample, each run alone through the model."""
    input_ids = sample["input_ids"]
    position_ids = sample.get("position_ids", torch.arange(len(input_ids)))
    starts = [0] + [i for i in range(1, len(input_ids)) if position_ids[i] == 0] + [len(input_ids)]
    total, count = torch.zeros(()), 0
    for start, end in zip(starts[:-1], starts[1:]):
        if end - start < 2:
            continue
        logits = model(input_ids=input_ids[None, start:end], position_ids=position_ids[None, start:end]).logits[0]
        total = total + F.cross_entropy(logits[:-1], input_ids[start + 1 : end], reduction="sum")
        count += end - start - 1
    return total, count


def token_mean_loss(model: torch.nn.Module, samples: list[dict[str, Tensor]]) -> Tensor:
    sums, counts = zip(*(document_losses(model, s) for s in samples))
    return torch.stack(sums).sum() / sum(counts)


def reference(folder: Path, case: dict[str, Any]) -> tuple[float, float, dict[str, Tensor]]:
    """One process, plain transformers: SGD on the token mean of all training rows; validation and test token means."""
    data = data_module(folder, case["mode"], case["batch_size"])
    data.setup("fit")
    model = fresh_model()
    if case["fit"]:
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for _ in range(STEPS):
            token_mean_loss(model, list(data.train_dataset)).backward()
            optimizer.step()
            optimizer.zero_grad()
    # every validation sample once: the repeats that even out the DP ranks do not count
    with torch.no_grad():
        val_loss, test_loss = (
            token_mean_loss(model, list(dataset)).item() for dataset in (data.val_dataset, data.test_dataset)
        )
    return val_loss, test_loss, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def sp_results(corpus: Path) -> list[dict[str, Any]]:
    return CaseTable("sp_results", "tests.test_data:fit_case", 2, CASES).run({"folder": str(corpus)})


@pytest.mark.parametrize("name", CASES)
def test_causal_lm_under_sp_equals_one_process(sp_results: list[dict[str, Any]], corpus: Path, name: str) -> None:
    case = CASES[name]
    expected_val_loss, expected_test_loss, expected = reference(corpus, case)
    initial = {n: p.detach() for n, p in fresh_model().named_parameters()}
    for rank, result in enumerate(sp_results):
        got = result[name]
        assert got["val_loss"] == pytest.approx(expected_val_loss, rel=1e-5), f"rank {rank}"
        assert got["val_ppl"] == pytest.approx(torch.tensor(expected_val_loss).exp().item(), rel=1e-5)
        if case.get("test"):  # the test files, not the validation files
            assert got["test_loss"] == pytest.approx(expected_test_loss, rel=1e-5)
            assert got["test_ppl"] == pytest.approx(torch.tensor(expected_test_loss).exp().item(), rel=1e-5)
            assert abs(expected_test_loss - expected_val_loss) > 1e-3  # different files, different losses
            check_predictions(got["predictions"], corpus, case)
        if case["fit"]:
            error = relative_update_error(initial, expected, got["params"])
            assert error < 1e-4, f"{name} rank {rank}: relative weight-update error {error:.2e}"


def check_predictions(predictions: list[dict[str, Tensor]], folder: Path, case: dict[str, Any]) -> None:
    """``predict`` gives every rank whole rows, in order: each next token's log-probability equals the one a
    single process computes on the whole document."""
    data = data_module(folder, case["mode"], case["batch_size"])
    data.setup("predict")
    rows = [(ids, logp) for batch in predictions for ids, logp in zip(batch["input_ids"], batch["token_log_probs"])]
    assert len(rows) == len(data.val_dataset)
    model = fresh_model()
    for sample, (ids, log_probs) in zip(data.val_dataset, rows):
        n = len(sample["input_ids"])
        assert torch.equal(ids[:n], sample["input_ids"]) and (log_probs[n - 1 :] == 0).all()
        with torch.no_grad():
            expected = model(input_ids=sample["input_ids"][None]).logits[0, :-1].log_softmax(-1)
        expected = expected.gather(-1, sample["input_ids"][1:, None])[:, 0]
        torch.testing.assert_close(log_probs[: n - 1], expected, rtol=1e-5, atol=1e-5)
