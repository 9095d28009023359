"""The ``lightning-ulysses`` CLI: every shipped config parses completely, and the quickstart trains and resumes.

The quickstart test runs ``python -m lightning_ulysses fit --config configs/quickstart.yaml`` exactly as a
user does (Lightning starts the second process itself by re-running the command), shortened on the
command line, then resumes from its checkpoint with the config the run saved.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_ulysses.checkpoint_io import check_integrity
from lightning_ulysses.cli import main
from tests.launch import REPO_ROOT

CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))


def print_config(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """``lightning-ulysses fit <args> --print_config``, in this process; returns the printed YAML."""
    monkeypatch.setattr(sys, "argv", ["lightning-ulysses"])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (None, 0)
    out = capsys.readouterr().out
    return out[out.index("# lightning.pytorch=="):]  # DeepSpeed may log a line to stdout first


def test_configs_exist() -> None:
    names = {path.stem for path in CONFIGS}
    assert {"quickstart", "llama8b_1node_zero3", "multinode_slurm", "multinode_torchrun"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_parses_completely(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, path: Path) -> None:
    printed = print_config(capsys, monkeypatch, "--config", str(path))
    config = yaml.safe_load(printed)
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_ulysses.UlyssesStrategy"
    assert {"sp_size", "attn_implementation", "stage", "offload_optimizer", "timeout"} <= set(strategy["init_args"])
    assert config["model"]["init_args"]["model"] and config["data"]["init_args"]["seq_len"] > 0
    # the printed config is itself a complete, valid config
    (tmp_path / "printed.yaml").write_text(printed)
    assert yaml.safe_load(print_config(capsys, monkeypatch, "--config", str(tmp_path / "printed.yaml"))) == config


def test_default_config_is_complete(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    config = yaml.safe_load(print_config(capsys, monkeypatch, "--trainer.strategy.sp_size", "4"))
    assert config["trainer"]["strategy"]["class_path"] == "lightning_ulysses.UlyssesStrategy"
    assert config["trainer"]["strategy"]["init_args"]["sp_size"] == 4
    assert config["model"]["class_path"] == "lightning_ulysses.CausalLM"
    assert config["model"]["init_args"]["model"]["model_type"] == "llama"
    assert config["data"]["class_path"] == "lightning_ulysses.LongTextDataModule"
    assert config["data"]["init_args"]["paths"] == ["stdlib"]


def test_strategy_arguments_from_the_command_line(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    config = yaml.safe_load(print_config(
        capsys, monkeypatch, "--config", str(REPO_ROOT / "configs/quickstart.yaml"), "--trainer.strategy.sp_size", "1",
        "--trainer.strategy.stage", "3",
    ))
    assert config["trainer"]["strategy"]["init_args"]["sp_size"] == 1
    assert config["trainer"]["strategy"]["init_args"]["stage"] == 3


def run_cli(*args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "lightning_ulysses", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"lightning-ulysses {' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"


def logged(run_dir: Path, key: str) -> list[tuple[int, float]]:
    with open(run_dir / "metrics.csv") as file:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(file) if row.get(key)]


def test_quickstart_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    shorten = [
        "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1",
        "--trainer.logger.init_args.save_dir", str(tmp_path), "--data.max_files", "60", "--data.seq_len", "256",
        "--model.warmup_steps", "2",
    ]
    run_cli("fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "8", *shorten)
    first = tmp_path / "quickstart" / "version_0"
    losses = [loss for _, loss in logged(first, "train_loss")]
    assert len(losses) == 8
    assert sum(losses[-2:]) / 2 < 0.9 * losses[0], f"train loss did not fall: {losses}"
    val_losses = [loss for _, loss in logged(first, "val_loss")]
    assert len(val_losses) == 2 and val_losses[1] < val_losses[0]
    checkpoint = first / "checkpoints" / "last.ckpt"
    check_integrity(checkpoint)  # a committed DeepSpeed checkpoint, every file whole

    run_cli("fit", "--config", str(first / "config.yaml"), "--ckpt_path", str(checkpoint), "--trainer.max_steps", "10")
    resumed = tmp_path / "quickstart" / "version_1"
    steps = [step for step, _ in logged(resumed, "train_loss")]
    assert steps == [8, 9], f"the resumed run did not continue at step 8: {steps}"
    check_integrity(resumed / "checkpoints" / "last.ckpt")

    # the 2-process checkpoint, converted, resumes on 1 process (tied embeddings, AdamW)
    universal = tmp_path / "last-universal"
    run_cli("convert-checkpoint", str(checkpoint), str(universal))
    one_process = ["--trainer.devices", "1", "--trainer.strategy.init_args.sp_size", "1", "--trainer.max_steps", "10"]
    run_cli("fit", "--config", str(first / "config.yaml"), "--ckpt_path", str(universal), *one_process)
    steps = [step for step, _ in logged(tmp_path / "quickstart" / "version_2", "train_loss")]
    assert steps == [8, 9], f"the converted checkpoint did not continue at step 8 on one process: {steps}"
