"""The ``lightning-ulysses`` CLI: every shipped config parses completely, and the commands of the README and of
docs/ run as written.

The quickstart test runs the README's commands in order, exactly as a user does (Lightning starts the second
process itself by re-running the command), shrunk on the command line: ``--print_config > my.yaml`` and ``fit
--config my.yaml``; the resume with a larger ``max_steps`` (the learning rate continues the saved schedule), into
the new run folder it prints, which the rest acts on: ``validate`` and ``predict`` from its checkpoint (into its
folder); ``export`` (loaded with ``from_pretrained``, its validation loss equals the run's, ``generate`` stops at the
end token); the conversion and the one-process resume. Bad configs are refused before
any process starts, in one line naming the key; Ctrl-C saves a checkpoint that the printed command resumes.
"""

from __future__ import annotations

import csv
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from lightning_ulysses.cli import UlyssesCLI, main
from lightning_ulysses.cli.commands import build_from_config
from lightning_ulysses.model import WarmupCosine
from lightning_ulysses.runtime.integrity import check_integrity
from tests.launch import REPO_ROOT, free_port, interpreter

pytestmark = pytest.mark.cli

CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))


def print_config(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """``lightning-ulysses fit <args> --print_config``, in this process; returns the printed YAML."""
    monkeypatch.setattr(sys, "argv", ["lightning-ulysses"])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (None, 0)
    out = capsys.readouterr().out
    assert out.startswith("# lightning.pytorch=="), out[:300]  # nothing else on stdout: the YAML loads as printed
    return out


def test_configs_exist() -> None:
    names = {path.stem for path in CONFIGS}
    assert {"quickstart", "llama8b_1node_zero3", "multinode_slurm", "multinode_torchrun"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_parses_completely(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, path: Path
) -> None:
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


def test_strategy_arguments_from_the_command_line(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = yaml.safe_load(
        print_config(
            capsys,
            monkeypatch,
            "--config",
            str(REPO_ROOT / "configs/quickstart.yaml"),
            "--trainer.strategy.sp_size",
            "1",
            "--trainer.strategy.stage",
            "3",
        )
    )
    assert config["trainer"]["strategy"]["init_args"]["sp_size"] == 1
    assert config["trainer"]["strategy"]["init_args"]["stage"] == 3


def help_text(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """What ``lightning-ulysses <args> --help`` prints."""
    monkeypatch.setattr(sys, "argv", ["lightning-ulysses"])
    with pytest.raises(SystemExit):
        main([*args, "--help"])
    return capsys.readouterr().out


def test_help_says_what_the_tool_is_and_lists_every_command_in_whole(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    listed = help_text(capsys, monkeypatch)
    assert "Lightning Trainer command line tool" not in listed
    assert "Ulysses sequence parallelism" in " ".join(listed.split()), listed
    # each command's line, its wrapped continuation lines joined: one whole sentence
    entries = dict(re.findall(r"^    (\S+) +(.+(?:\n {20,}\S.*)*)", listed, re.MULTILINE))
    assert set(entries) == {"fit", "validate", "test", "predict", "convert-checkpoint", "export"}, listed
    for command, text in entries.items():
        text = " ".join(text.split())
        assert text.endswith("."), f"the description of {command} is cut: {text!r}"
    assert "sp_size" in " ".join(entries["fit"].split())


def test_fit_help_leads_with_the_keys_a_run_sets(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fit --help`` names sp_size, seq_len, --config and --print_config in its first lines, and still lists every
    key of LightningCLI's help."""
    text = help_text(capsys, monkeypatch, "fit")
    head = "\n".join(text.splitlines()[:25])
    for key in ("--trainer.strategy.init_args.sp_size", "--data.seq_len", "--config", "--print_config", "--ckpt_path"):
        assert key in head, f"{key} is not in the first lines of fit --help:\n{head}"
    for key in ("--trainer.max_epochs", "--trainer.accumulate_grad_batches", "--model.help", "--data.help"):
        assert key in text, key
    assert "--data.seq_len" in help_text(capsys, monkeypatch, "validate")


def test_lr_schedule_is_saved_with_the_scheduler() -> None:
    """The schedule's length travels in the scheduler's state (what a checkpoint holds), and it equals transformers'
    warmup + cosine-with-min-lr schedule up to its end, then holds the final rate."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    def lambda_lr(total: int) -> torch.optim.lr_scheduler.LambdaLR:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(3, total, 0.1))

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    reference = get_cosine_with_min_lr_schedule_with_warmup(optimizer, 3, 10, min_lr_rate=0.1)
    ours = lambda_lr(10)
    for step in range(10):
        assert math.isclose(ours.get_last_lr()[0], reference.get_last_lr()[0], rel_tol=1e-12), step
        optimizer.step(), ours.optimizer.step(), reference.step(), ours.step()
    for _ in range(5):  # past the end: the final rate (transformers' rises again)
        assert math.isclose(ours.get_last_lr()[0], 0.2, rel_tol=1e-12)
        ours.optimizer.step(), ours.step()
    resumed = lambda_lr(400)  # a resumed run rebuilds the schedule for another max_steps, then loads the state
    resumed.load_state_dict(ours.state_dict())
    assert resumed.lr_lambdas[0].total_steps == 10


def test_a_resume_onto_a_new_schedule_length_changes_the_rate_at_the_resumed_step() -> None:
    """``--model.lr_schedule_steps 20`` on a run resumed at step 10 of a 10-step schedule: the rate of the next step
    is the 20-step schedule's at step 10, set on the optimizer before it steps; without it, a warning."""
    from types import SimpleNamespace

    from lightning_ulysses.model import _reconcile_schedule

    def resumed(step: int = 10) -> torch.optim.lr_scheduler.LambdaLR:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(2, 10, 0.1))
        for _ in range(step):
            optimizer.step(), scheduler.step()
        return scheduler

    trainer = SimpleNamespace(max_steps=20, estimated_stepping_batches=20)
    scheduler = resumed()
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    with pytest.warns(
        UserWarning,
        match="decays over 10 optimizer steps; this run ends at step 20, so steps 10-19 run "
        "at its final learning rate 0.2. To decay over 20 steps instead, add "
        "--model.lr_schedule_steps 20",
    ):
        _reconcile_schedule(scheduler, None, trainer)
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    # the README's one-process resume: a second resume, at step 20 of the 10-step schedule, names its own first step
    with pytest.warns(UserWarning, match="Resumed at step 20 .* this run ends at step 30, so steps 20-29 run at its"):
        _reconcile_schedule(resumed(20), None, SimpleNamespace(max_steps=30, estimated_stepping_batches=30))
    scheduler = resumed()
    _reconcile_schedule(scheduler, 20, trainer)
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(2.0 * WarmupCosine(2, 20, 0.1)(10))
    scheduler.optimizer.step(), scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(2.0 * WarmupCosine(2, 20, 0.1)(11))


def test_progress_bar_counts_optimizer_steps_of_max_steps() -> None:
    """A step-limited run resumed at step 200 of 400, inside an epoch of 199 batches: ``Step``, 400 in all (Lightning's
    bar reads ``Epoch 0/-2`` and counts the epoch's batches against the 200 steps left)."""
    from types import SimpleNamespace

    from lightning_ulysses.progress import StepProgressBar

    bar = StepProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1, max_steps=400, global_step=200, num_training_batches=199)
    assert bar.total_train_batches == 400 and bar._get_train_description(0).strip() == "Step"
    bar._trainer = SimpleNamespace(max_epochs=3, max_steps=-1, global_step=0, num_training_batches=199)
    assert bar.total_train_batches == 199 and bar._get_train_description(1).strip() == "Epoch 1/2"


def test_progress_bar_unless_the_config_disables_or_names_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.callbacks import TQDMProgressBar

    from lightning_ulysses.progress import LogLines

    monkeypatch.setattr(sys, "argv", ["lightning-ulysses"])

    def trainer(*args: str) -> L.Trainer:
        return UlyssesCLI(
            L.LightningModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            run=False,
            args=["--config", str(REPO_ROOT / "configs/quickstart.yaml"), *args],
        ).trainer

    assert isinstance(trainer().progress_bar_callback, LogLines)  # stdout is not a terminal under pytest
    assert trainer("--trainer.enable_progress_bar", "false").progress_bar_callback is None
    named = trainer("--trainer.callbacks+=TQDMProgressBar")
    assert isinstance(named.progress_bar_callback, TQDMProgressBar)


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    env["MASTER_PORT"] = str(free_port())  # Lightning's own pick races the other xdist worker's connections
    return env


def run_cli(
    *args: str, cwd: Path = REPO_ROOT, env: dict[str, str] | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """``lightning-ulysses <args>`` as a user runs it (``env``: added to the environment); its stdout is not a
    terminal (plain progress lines). Its processes are forked from the session's fork server (:mod:`tests.forkserver`)
    unless ``fresh``: a fresh process also prints what its imports print."""
    result = subprocess.run(
        [sys.executable if fresh else interpreter(), "-m", "lightning_ulysses", *args],
        cwd=cwd,
        env={**cli_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (
        f"lightning-ulysses {' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    )
    return result


def refusal(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """Run ``lightning-ulysses <args>`` in this process, which must refuse it before building anything (the model,
    the data, the Trainer: so before any process starts), with one error line and no traceback; returns that line."""
    monkeypatch.setattr(sys, "argv", ["lightning-ulysses"])

    def built(cli: UlyssesCLI) -> None:
        raise AssertionError(f"lightning-ulysses {' '.join(args)} built its classes instead of refusing the config")

    with monkeypatch.context() as scoped, pytest.raises(SystemExit) as exit_info:
        scoped.setattr(UlyssesCLI, "instantiate_classes", built)
        main(list(args))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("lightning-ulysses: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def logged(run_dir: Path, key: str) -> list[tuple[int, float]]:
    with open(run_dir / "metrics.csv") as file:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(file) if row.get(key)]


def test_bad_configs_are_refused_before_any_process_starts(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    quickstart = ["fit", "--config", str(REPO_ROOT / "configs/quickstart.yaml")]
    line = refusal(capsys, monkeypatch, *quickstart, "--trainer.strategy.init_args.sp_size", "3")
    assert "trainer.strategy.init_args.sp_size=3" in line and "Valid sp_size values for this world size: [1, 2]" in line
    line = refusal(capsys, monkeypatch, *quickstart, "--trainer.strategy.init_args.attn_implementation", "eager")
    assert "attn_implementation" in line and "'eager'" in line and "'sdpa'" in line and len(line) < 500
    line = refusal(capsys, monkeypatch, *quickstart, "--data.batch_size", "0")
    assert "data.batch_size=0" in line and "--data.batch_size 1" in line
    line = refusal(capsys, monkeypatch, *quickstart, "--ckpt_path", "no/such/checkpoint")
    assert "ckpt_path='no/such/checkpoint' does not exist" in line
    line = refusal(capsys, monkeypatch, *quickstart, "--ckpt_path", "configs/quickstart.yaml")  # not a checkpoint
    assert "ckpt_path='configs/quickstart.yaml': not a checkpoint" in line and "weights_only" not in line
    line = refusal(
        capsys,
        monkeypatch,
        "test",
        "--config",
        str(REPO_ROOT / "configs/quickstart.yaml"),
        "--data",
        "tests.test_cli.TrainOnlyData",
    )
    assert "TrainOnlyData has no test_dataloader(), so it has no split for test" in line
    # the data module's own checks of its values: rows too short, paths and a tokenizer folder that are not there
    line = refusal(capsys, monkeypatch, *quickstart, "--data.seq_len", "1")
    assert "data.seq_len=1" in line and "--data.seq_len" in line
    line = refusal(capsys, monkeypatch, *quickstart, "--data.tokenizer", "no/such/tokenizer")
    assert "data.tokenizer='no/such/tokenizer' is neither 'byte' nor a local tokenizer folder" in line
    sft = ["fit", "--config", str(REPO_ROOT / "configs/sft_quickstart.yaml")]
    line = refusal(capsys, monkeypatch, *sft, "--data.paths", "[no/such/chats.jsonl]")
    assert "data.paths: 'no/such/chats.jsonl' does not exist" in line
    line = refusal(capsys, monkeypatch, *sft, "--data.val_paths", "[no/such/*.jsonl]")
    assert "data.val_paths: 'no/such/*.jsonl' does not exist" in line
    line = refusal(
        capsys,
        monkeypatch,
        "fit",
        "--config",
        str(REPO_ROOT / "configs/dpo_quickstart.yaml"),
        "--data.tokenizer",
        "byte",
        "--data.seq_len",
        "3",
    )
    assert "data.seq_len=3" in line and "4 (2 per sequence of a pair)" in line


def test_a_missing_data_folder_is_refused_in_one_line_before_start_up(tmp_path: Path) -> None:
    """As a user types it: the whole output is the one line (it was two processes' tracebacks, 76 lines)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_ulysses",
            "fit",
            "--config",
            "configs/quickstart.yaml",
            "--data.paths",
            f"[{tmp_path / 'no-such-folder'}]",
        ],
        cwd=REPO_ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 2 and output == (
        f"lightning-ulysses: error: data.paths: '{tmp_path / 'no-such-folder'}' does not exist. Give existing files or "
        "folders (--data.paths '[path/to/data]')."
    ), output


UNINSTALL = """
import importlib.metadata
import sys

MODULES, DISTRIBUTIONS = ("PIL", "matplotlib"), ("pillow", "matplotlib")


class Uninstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in MODULES:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


installed = importlib.metadata.distribution
importlib.metadata.distribution = lambda name: (
    installed(name) if name.lower() not in DISTRIBUTIONS else installed("no-such-distribution")
)
sys.meta_path.insert(0, Uninstalled())
"""
"""A ``sitecustomize`` that makes Pillow (and matplotlib, the dev extra's, which needs it) absent as if uninstalled."""


def test_a_missing_optional_package_is_refused_in_one_line_naming_the_pip_install(tmp_path: Path) -> None:
    """The vision quickstart as a user types it where Pillow is not installed: one line naming the ``pip install``
    (it was jsonargparse's 40-line traceback). Pillow is a dependency, so the README's install has it: the image
    processors of transformers have a PIL backend, and torchvision (which must match the torch build) is not needed."""
    (tmp_path / "sitecustomize.py").write_text(UNINSTALL)
    result = subprocess.run(
        [sys.executable, "-m", "lightning_ulysses", "fit", "--config", "configs/vlm_sft_quickstart.yaml"],
        cwd=REPO_ROOT,
        env={**cli_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 2 and output == (
        "lightning-ulysses: error: Could not load any image processor class for examples/data/vlm/processor: none of "
        "torchvision, Pillow is installed. Install it: pip install Pillow"
    ), output
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"pillow\b", requirement, re.IGNORECASE) for requirement in declared), declared


def test_a_mistyped_key_gets_the_closest_valid_one(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two lines instead of the usage (about 50 lines) and jsonargparse's report: the error with the closest key,
    and where every key is listed."""
    quickstart = ["fit", "--config", str(REPO_ROOT / "configs/quickstart.yaml")]
    (tmp_path / "typo.yaml").write_text("trainer:\n  max_stepz: 4\n")
    for args, expected in [
        (
            [*quickstart, "--data.seq_lem", "512"],
            "unknown key --data.seq_lem: LongTextDataModule has no argument 'seq_lem'; did you mean --data.seq_len?",
        ),
        ([*quickstart, "--seq_len", "512"], "unknown key --seq_len; did you mean --data.seq_len?"),
        (
            [*quickstart, "--trainer.max_stepz", "4"],
            "unknown key --trainer.max_stepz; did you mean --trainer.max_steps?",
        ),
        (
            [*quickstart, "--trainer.strategy.init_args.sp_sise", "2"],
            "did you mean --trainer.strategy.init_args.sp_size?",
        ),
        (
            ["fit", "--config", str(REPO_ROOT / "configs/sft_quickstart.yaml"), "--data.truncaton", "drop"],
            "SFTDataModule has no argument 'truncaton'; did you mean --data.truncation?",
        ),
        (["fit", "--config", str(tmp_path / "typo.yaml")], "'trainer.max_stepz'; did you mean trainer.max_steps?"),
        ([*quickstart, "--data.seq_len", "many"], "data.seq_len: Expected a <class 'int'>. Got value: many"),
        (["fitt"], "invalid choice: 'fitt'"),
    ]:
        monkeypatch.setattr(sys, "argv", ["lightning-ulysses"])
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        assert exit_info.value.code == 2 and captured.out == "" and len(lines) == 2, captured.err
        assert lines[0].startswith("lightning-ulysses: error: ") and expected in lines[0], (expected, lines[0])
        assert lines[1] == f"Every key: lightning-ulysses {'fit ' if args[0] == 'fit' else ''}--help", lines[1]


class TrainOnlyData(L.LightningDataModule):
    """A data module with a training split only."""

    vocab_size = 259

    def train_dataloader(self) -> list[dict[str, torch.Tensor]]:
        return [{"input_ids": torch.zeros(1, 8, dtype=torch.long)}]


def test_no_logger_writes_no_config_into_the_working_directory(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    no_logger = ["--trainer.logger", "false"]
    line = refusal(capsys, monkeypatch, "fit", "--config", str(REPO_ROOT / "configs/quickstart.yaml"), *no_logger)
    assert "LearningRateMonitor" in line  # it would fail at the start of training, after the set-up
    config = yaml.safe_load((REPO_ROOT / "configs/quickstart.yaml").read_text())
    callbacks = config["trainer"]["callbacks"]
    config["trainer"]["callbacks"] = [c for c in callbacks if not c["class_path"].endswith("LearningRateMonitor")]
    (tmp_path / "no-lr-monitor.yaml").write_text(yaml.safe_dump(config))
    one_step = [
        *no_logger,
        "--trainer.max_steps",
        "1",
        "--trainer.devices",
        "1",
        "--trainer.strategy.init_args.sp_size",
        "1",
        "--trainer.limit_val_batches",
        "0",
        "--data.max_files",
        "20",
        "--data.seq_len",
        "128",
    ]
    run_cli("fit", "--config", str(tmp_path / "no-lr-monitor.yaml"), *one_step, cwd=tmp_path)
    assert not (tmp_path / "config.yaml").exists(), (
        "a run without a logger wrote config.yaml into the working directory"
    )


def readme_follow_up_block() -> list[str]:
    """The README's block after the quickstart (the one that sets ``R``), one entry per command or assignment."""
    readme = (REPO_ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(R=runs/quickstart/.*?)```", readme, re.DOTALL)[1]
    return [line.split("#")[0].strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_quickstart_commands_as_documented(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # the README's follow-up block, in the order this test runs it: resume, then R is the resumed run for the rest
    block = readme_follow_up_block()
    assert [line.split()[:2] for line in block] == [
        ["R=runs/quickstart/version_0"],
        ["lightning-ulysses", "fit"],
        ["R=runs/quickstart/version_1"],
        ["lightning-ulysses", "validate"],
        ["lightning-ulysses", "predict"],
        ["lightning-ulysses", "export"],
        ["lightning-ulysses", "convert-checkpoint"],
        ["lightning-ulysses", "fit"],
    ], block
    assert all("$R/" in line or line.startswith(("R=", "lightning-ulysses export $R ")) for line in block), block
    shrink = [
        "--trainer.max_steps",
        "8",
        "--trainer.val_check_interval",
        "4",
        "--trainer.limit_val_batches",
        "2",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "runs"),
        "--data.max_files",
        "60",
        "--data.seq_len",
        "256",
        "--model.warmup_steps",
        "2",
    ]
    # lightning-ulysses fit --config configs/quickstart.yaml --print_config > my.yaml
    # lightning-ulysses fit --config my.yaml
    printed = run_cli("fit", "--config", "configs/quickstart.yaml", *shrink, "--print_config").stdout
    (tmp_path / "my.yaml").write_text(printed)
    trained = run_cli("fit", "--config", str(tmp_path / "my.yaml"), fresh=True)  # the imports' noise too
    run = tmp_path / "runs" / "quickstart" / "version_0"
    losses = [loss for _, loss in logged(run, "train_loss")]
    assert len(losses) == 8
    assert sum(losses[-2:]) / 2 < 0.9 * losses[0], f"train loss did not fall: {losses}"
    val_losses = [loss for _, loss in logged(run, "val_loss")]
    assert len(val_losses) == 2 and val_losses[1] < val_losses[0]
    # stdout is a pipe here: plain progress lines with the optimizer step out of max_steps, no "Epoch 0/-2", no v_num
    assert re.search(r"^step 4/8 \| .*train_loss [0-9.]+ \| sp/tokens_per_sec", trained.stdout, re.MULTILINE), (
        trained.stdout
    )
    assert "validation at step 8 | val_loss" in trained.stdout and "v_num" not in trained.stdout
    assert_no_noise(trained)
    for kept in ("Total params", "Sequence-parallel training summary", "validation at step 8"):
        assert (trained.stdout + trained.stderr).count(kept) == 1, kept  # the summaries are still there, once
    checkpoint = run / "checkpoints" / "last.ckpt"
    check_integrity(checkpoint)  # a committed DeepSpeed checkpoint, every file whole

    # the README's resume, with a larger max_steps: the learning rate continues the schedule saved in the checkpoint
    # (which ended at step 8: its final rate), and the run says so. Rebuilt for 12 steps it would be 6.6e-4 at step 8.
    resumed_run = run_cli(
        "fit", "--config", str(run / "config.yaml"), "--ckpt_path", str(checkpoint), "--trainer.max_steps", "12"
    )
    # it writes a new run folder and says which, at its start and its end; the README sets R to it
    said = re.findall(r"^.*Run folder (\S+): (.*)$", resumed_run.stdout + resumed_run.stderr, re.MULTILINE)
    assert len(said) == 2, said
    resumed = tmp_path / "runs" / "quickstart" / "version_1"
    assert [Path(folder) for folder, _ in said] == [resumed, resumed]
    assert said[0][1] == f"config.yaml, metrics.csv; checkpoints in {resumed / 'checkpoints'}"
    assert said[1][1] == f"ended at global step 12; latest checkpoint {resumed / 'checkpoints' / 'last.ckpt'}"
    assert [step for step, _ in logged(resumed, "train_loss")] == [8, 9, 10, 11], "not continued at step 8"
    lrs = [lr for _, lr in logged(resumed, "lr-AdamW/pg1")]
    assert lrs == pytest.approx([0.002 * 0.1] * 4, rel=1e-6), lrs
    assert_no_noise(resumed_run)
    assert "decays over 8 optimizer steps; this run ends at step 12" in resumed_run.stderr
    # the summary counts the steps this run made, beside its tokens (it said 12)
    assert re.search(r"optimizer steps +4, global steps 8 -> 12\n", resumed_run.stdout + resumed_run.stderr)
    assert "--model.lr_schedule_steps 12" in resumed_run.stderr
    assert "step 12/12" in resumed_run.stdout
    R, checkpoint = resumed, resumed / "checkpoints" / "last.ckpt"  # R=runs/quickstart/version_1
    ((_, resumed_val_loss),) = logged(R, "val_loss")  # at step 12

    # validate and predict from the resumed run's checkpoint write into its folder, not a new version_N
    assert_no_noise(run_cli("validate", "--config", str(R / "config.yaml"), "--ckpt_path", str(checkpoint)))
    ((_, validated),) = logged(R / "validate", "val_loss")
    assert validated == pytest.approx(resumed_val_loss, rel=1e-5)  # the step-12 validation, on the same weights
    predicted = run_cli("predict", "--config", str(R / "config.yaml"), "--ckpt_path", str(checkpoint))
    assert_no_noise(predicted)
    predictions = torch.load(R / "predict" / "predictions.pt")
    assert f"to {R / 'predict' / 'predictions.pt'}" in predicted.stdout
    first = predictions["predictions"][0]
    assert first["token_log_probs"].shape == first["input_ids"].shape == (4, 256)
    assert (first["token_log_probs"][:, :-1] < 0).all()  # every next token scored

    # export: a from_pretrained folder of step 12; its validation loss (one process, without this package) is the run's
    exported = tmp_path / "model"
    main(["export", str(R), str(exported)])
    assert f"Wrote {exported}: the model of {checkpoint} (global step 12)" in capsys.readouterr().out
    assert_export_equals_the_run(exported, R, validated)

    # the 2-process checkpoint, converted, resumes on 1 process (tied embeddings, AdamW)
    universal = R / "checkpoints" / "last-universal"
    main(["convert-checkpoint", str(checkpoint), str(universal)])
    assert f"Wrote {universal}: a universal copy of {checkpoint} (global step 12" in capsys.readouterr().out
    one_process = ["--trainer.devices", "1", "--trainer.strategy.init_args.sp_size", "1"]
    line = refusal(
        capsys, monkeypatch, "fit", "--config", str(R / "config.yaml"), "--ckpt_path", str(universal), *one_process
    )  # the saved config's max_steps is reached: it says so and how to go on
    assert "saved at global step 12 and trainer.max_steps=12: nothing is left to train" in line
    assert "--trainer.max_steps 24" in line
    one_process_run = run_cli(
        "fit",
        "--config",
        str(R / "config.yaml"),
        "--ckpt_path",
        str(universal),
        *one_process,
        "--trainer.max_steps",
        "14",
    )
    # its warning names its own first step (it said "steps 8-13" in a run that starts at 12)
    assert "this run ends at step 14, so steps 12-13 run at its final learning rate" in one_process_run.stderr
    steps = [step for step, _ in logged(tmp_path / "runs" / "quickstart" / "version_2", "train_loss")]
    assert steps == [12, 13], f"the converted checkpoint did not continue at step 12 on one process: {steps}"
    folders = sorted(path.name for path in (tmp_path / "runs" / "quickstart").iterdir())
    assert folders == ["version_0", "version_1", "version_2"]

    # a damaged shard is refused before any process starts, naming the file
    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(checkpoint, damaged)
    shard = next(damaged.glob("*/zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with open(shard, "r+b") as file:
        file.truncate(shard.stat().st_size // 2)
    line = refusal(
        capsys,
        monkeypatch,
        "fit",
        "--config",
        str(R / "config.yaml"),
        "--ckpt_path",
        str(damaged),
        "--trainer.max_steps",
        "14",
    )
    assert f"{shard}: truncated" in line


NOISE = (
    "Setting accelerator to CPU",
    "💡 Tip",
    "all_gather_into_tensor",
    "LeafSpec",
    "Total Flops",
    "Total FLOPs",
    "nn.functional.all_gather",
    "Skipping setting a default",
    "Seed set to",
    "GPU available:",
    "TPU available:",
    "initializing deepspeed distributed",
    "The dirpath has changed",
    "TokenCrossEntropy",
)
"""Lines that a run printed (most of them once per rank) and that say nothing its user needs."""


def assert_no_noise(result: subprocess.CompletedProcess) -> None:
    for noise in NOISE:
        assert noise not in result.stdout + result.stderr, noise


def assert_export_equals_the_run(exported: Path, run: Path, val_loss: float) -> None:
    """Validate the exported folder with a plain HF model on the run's validation batches (the local reference
    attention masks the packed documents as the run did)."""
    from transformers import AutoModelForCausalLM

    from lightning_ulysses import CausalLM

    data = build_from_config(yaml.safe_load((run / "config.yaml").read_text())).data
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.get_input_embeddings().num_embeddings == data.vocab_size
    module = CausalLM(model=str(exported), pretrained=True, vocab_size=data.vocab_size)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        limit_val_batches=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    (metrics,) = trainer.validate(module, datamodule=data, verbose=False)
    assert metrics["val_loss"] == pytest.approx(val_loss, rel=1e-4)
    if hasattr(data.tokenizer, "save_pretrained"):  # the data module's tokenizer is saved with the model
        from transformers import AutoTokenizer

        assert (
            AutoTokenizer.from_pretrained(exported)("def f():")["input_ids"] == data.tokenizer("def f():")["input_ids"]
        )
    assert_generation_stops_at(exported, data.tokenizer.eos_token_id)  # ByT5's </s>, 1
    assert_readable_as_any_model_folder(exported)


def assert_readable_as_any_model_folder(exported: Path) -> None:
    """Every file ``export`` wrote has the permissions of a new file under the umask (0644 under 022); transformers
    wrote the weights 0600."""
    umask = os.umask(0)
    os.umask(umask)
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in exported.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o666 & ~umask)}, modes


def assert_generation_stops_at(exported: Path, end_token_id: int) -> None:
    """The exported folder as transformers loads it: the special ids of its config are its tokenizer's, and
    ``generate`` stops at the end token (forced as the third new token, after two others: a model trained for a
    few steps seldom writes it by itself)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(exported), AutoTokenizer.from_pretrained(exported)
    special = ("bos_token_id", "eos_token_id", "pad_token_id")
    assert [getattr(model.config, key) for key in special] == [getattr(tokenizer, key) for key in special]
    prompt = tokenizer("2+2=", add_special_tokens=False, return_tensors="pt")
    start = prompt["input_ids"].shape[1]
    others = [i for i in range(len(tokenizer)) if i != end_token_id]

    def allowed(batch_id: int, ids: torch.Tensor) -> list[int]:
        return [end_token_id] if len(ids) >= start + 2 else others

    out = model.generate(**prompt, max_new_tokens=10, do_sample=False, prefix_allowed_tokens_fn=allowed)
    assert out[0, start:].tolist()[-1] == end_token_id and out.shape[1] == start + 3, out[0, start:].tolist()


def test_sft_export_holds_what_the_dpo_quickstart_loads(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """The fine-tuning commands of the README: the SFT quickstart (shrunk to 2 steps), then ``export`` of its run,
    which configs/dpo_quickstart.yaml loads as ``model.model`` (pretrained, every weight) and ``data.tokenizer``."""
    trained = run_cli(
        "fit",
        "--config",
        "configs/sft_quickstart.yaml",
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--data.seq_len",
        "256",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "runs"),
        env={"HF_DATASETS_CACHE": str(tmp_path / "datasets")},  # not cached: bars shown
    )
    assert_no_noise(trained)
    # datasets' progress bars of one rank, not two ranks' interleaved: one bar starts at 0/N (a slow machine may
    # also print 0% at 1/N, so the start is told by its count, not by its percentage)
    starts = re.findall(r"Tokenizing the training records: +0%\|[^|]*\| 0/", trained.stdout + trained.stderr)
    assert len(starts) == 1, trained.stderr
    run, exported = tmp_path / "runs" / "sft_quickstart" / "version_0", tmp_path / "sft_model"
    main(["export", str(run), str(exported)])
    assert f"Wrote {exported}: the model of {run / 'checkpoints' / 'last.ckpt'} (global step 2) and its tokenizer" in (
        capsys.readouterr().out
    )
    from lightning_ulysses import CausalLM
    from lightning_ulysses.finetune.tokenizer import load_tokenizer

    sft = build_from_config(yaml.safe_load((run / "config.yaml").read_text())).data
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert load_tokenizer(str(exported)).apply_chat_template(chat) == sft.tokenizer.apply_chat_template(chat)
    dpo = yaml.safe_load((REPO_ROOT / "configs/dpo_quickstart.yaml").read_text())
    assert dpo["model"]["init_args"]["model"] == dpo["data"]["init_args"]["tokenizer"] == "runs/sft_model"
    module = CausalLM(model=str(exported), pretrained=True, vocab_size=len(sft.tokenizer))
    module.configure_model()  # refuses a folder that lacks or mismatches any weight
    assert_generation_stops_at(exported, sft.tokenizer.convert_tokens_to_ids("<|im_end|>"))  # the chat's end, 256
    assert_readable_as_any_model_folder(exported)


def test_export_stops_generation_at_the_end_of_a_turn_that_is_not_eos() -> None:
    """A chat template that ends the assistant's turn in its own token (as Llama 3's <|eot_id|>, not its eos):
    the exported generation config ends at both, the config keeps the tokenizer's eos."""
    from lightning_ulysses.cli.commands import _set_special_token_ids
    from lightning_ulysses.finetune.tokenizer import byte_chat_tokenizer
    from tests.tiny import tiny_llama

    tokenizer = byte_chat_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|eot|>"]})
    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_end|>", "<|eot|>")
    model = tiny_llama(vocab_size=len(tokenizer))
    _set_special_token_ids(model, tokenizer)
    eos, eot = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eot|>")
    assert eot != eos and model.generation_config.eos_token_id == [eos, eot] and model.config.eos_token_id == eos


def test_ctrl_c_saves_a_checkpoint_that_the_printed_command_resumes(tmp_path: Path) -> None:
    """Ctrl-C as a terminal sends it (SIGINT to the whole process group) during a 2-process fit."""
    args = [
        "fit",
        "--config",
        "configs/quickstart.yaml",
        "--trainer.max_steps",
        "200",
        "--trainer.val_check_interval",
        "100",
        "--trainer.limit_val_batches",
        "1",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "runs"),
        "--data.max_files",
        "60",
        "--data.seq_len",
        "256",
    ]
    process = subprocess.Popen(
        [interpreter(), "-m", "lightning_ulysses", *args],
        cwd=REPO_ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output = []
    try:
        for line in process.stdout:
            output.append(line)
            if line.startswith("step 3/200"):
                os.killpg(process.pid, signal.SIGINT)
                break
        output += process.stdout.readlines()
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = "".join(output)
    run = tmp_path / "runs" / "quickstart" / "version_0"
    found = re.search(
        r"Interrupted \(Ctrl-C\): saved (\S+) at global step (\d+), before its next batch\. "
        r"Resume with: (lightning-ulysses fit .*)",
        text,
    )
    assert found, text[-6000:]
    path, step, command = Path(found[1]), int(found[2]), found[3].split()
    assert path == run / "checkpoints" / "interrupted.ckpt" and step >= 3
    assert command == ["lightning-ulysses", "fit", "--config", str(run / "config.yaml"), "--ckpt_path", str(path)]
    check_integrity(path)
    run_cli(*command[1:], "--trainer.max_steps", str(step + 2))
    steps = [s for s, _ in logged(tmp_path / "runs" / "quickstart" / "version_1", "train_loss")]
    assert steps == [step, step + 1], steps


def test_strategy_names_are_registered_by_importing_the_package() -> None:
    """Lightning has no entry point for strategy names: ``Trainer(strategy="ulysses")`` needs ``import
    lightning_ulysses`` first (README), and says so through Lightning's own error otherwise."""
    script = (
        "import lightning as L\n"
        "try:\n    L.Trainer(strategy='ulysses', accelerator='cpu', devices=1, logger=False)\n"
        "except ValueError as error:\n    print('refused:', error)\n"
        "import lightning_ulysses\n"
        "trainer = L.Trainer(strategy='ulysses', accelerator='cpu', devices=1, logger=False)\n"
        "print('after import:', type(trainer.strategy).__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True, timeout=300
    )
    assert "refused: You selected an invalid strategy name: `strategy='ulysses'`" in result.stdout, (
        result.stdout + result.stderr
    )
    assert "after import: UlyssesStrategy" in result.stdout, result.stdout + result.stderr


def test_the_engine_is_chosen_with_trainer_strategy(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--trainer.strategy UlyssesFSDPStrategy`` (or its name, ``strategy="ulysses_fsdp"``) runs FSDP2 instead of
    DeepSpeed: the config carries the FSDP2 engine's arguments, its layout is checked like DeepSpeed's, and the
    Trainer the CLI builds holds it."""
    from lightning_ulysses import UlyssesFSDPStrategy
    from lightning_ulysses.cli import UlyssesCLI

    fsdp = ["--trainer.strategy", "UlyssesFSDPStrategy", "--trainer.strategy.sp_size", "2"]
    strategy = yaml.safe_load(print_config(capsys, monkeypatch, *fsdp))["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_ulysses.UlyssesFSDPStrategy"
    assert strategy["init_args"]["sp_size"] == 2 and "reshard_after_forward" in strategy["init_args"]
    assert "stage" not in strategy["init_args"]  # DeepSpeed's
    line = refusal(capsys, monkeypatch, "fit", "--trainer.devices", "2", *fsdp[:2], "--trainer.strategy.sp_size", "3")
    assert "trainer.strategy.init_args.sp_size=3" in line, line
    monkeypatch.setattr(sys, "argv", ["lightning-ulysses"])
    cli = UlyssesCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        auto_configure_optimizers=False,
        args=["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.logger", "false", *fsdp],
    )
    assert type(cli.trainer.strategy) is UlyssesFSDPStrategy and cli.trainer.strategy.sp_size == 2
    by_name = L.Trainer(strategy="ulysses_fsdp", accelerator="cpu", devices=2, logger=False)
    assert type(by_name.strategy) is UlyssesFSDPStrategy and by_name.strategy.sp_size == 2
