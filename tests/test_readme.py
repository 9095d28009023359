"""The README's "Using it from Python" module and Trainer, run as written but for their sizes: 2 CPU processes
(sp 2) instead of 8 GPUs, a tiny saved Llama and a few text files for the placeholder folders, 2 steps."""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from lightning_ulysses.data import byte_tokenizer, find_text_files
from tests.launch import REPO_ROOT, launch
from tests.tiny import tiny_llama

pytestmark = pytest.mark.distributed

SHRINK = {
    'accelerator="cuda"': 'accelerator="cpu"',
    "devices=8": "devices=2",
    "sp_size=8": "sp_size=2",
    "max_steps=1000": "max_steps=2",
    "val_check_interval=100": "val_check_interval=2, limit_val_batches=1, enable_progress_bar=False",
    'precision="bf16-mixed"': 'precision="32-true"',
    "seq_len=131072": "seq_len=64, max_files=6",
}
"""What in the README's code changes to run here; every other character runs as written."""


def readme_python_example() -> str:
    """The first Python block after the README's heading "Using it from Python"."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("## Using it from Python") :]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL)[1]


def shrunk(code: str, folders: dict[str, str]) -> str:
    for old, new in {**SHRINK, **folders}.items():
        assert old in code, f"the README's example no longer has {old!r}: update SHRINK in tests/test_readme.py"
        code = code.replace(old, new)
    return code


def readme_worker(args: dict[str, Any]) -> dict[str, Any]:
    os.chdir(args["cwd"])  # where a user runs the script: Lightning writes its logs and checkpoints there
    namespace: dict[str, Any] = {"__name__": "readme"}
    exec(compile(args["code"], "README.md", "exec"), namespace)
    trainer = namespace["trainer"]
    return {
        "global_step": trainer.global_step,
        **{key: float(value) for key, value in trainer.callback_metrics.items()},
    }


def test_the_readme_python_example_trains(tmp_path: Path) -> None:
    model, texts = tmp_path / "model", tmp_path / "texts"
    tiny_llama(vocab_size=len(byte_tokenizer())).save_pretrained(model)
    byte_tokenizer().save_pretrained(model)
    texts.mkdir()
    for path in find_text_files(["stdlib"], "*.py")[:20]:
        shutil.copy(path, texts / f"{len(list(texts.iterdir()))}.py")
    code = shrunk(readme_python_example(), {'"path/to/model"': repr(str(model)), '"path/to/texts"': repr(str(texts))})
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for rank, result in enumerate(launch("tests.test_readme:readme_worker", 2, {"code": code, "cwd": str(cwd)})):
        assert result["global_step"] == 2, (rank, result)
        assert math.isfinite(result["train_loss"]) and math.isfinite(result["val_loss"]), (rank, result)
        # a random model on bytes: about log(259) per token, not a factor of sp_size away
        assert result["val_loss"] == pytest.approx(math.log(259), rel=0.2), (rank, result)
    assert list((cwd / "lightning_logs").glob("version_0/checkpoints/*")), "no checkpoint in the working directory"
