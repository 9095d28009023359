"""``lightning-ulysses``: the LightningCLI of :class:`CausalLM` on :class:`LongTextDataModule` by default.

Any LightningModule and LightningDataModule can be named instead (``model.class_path``, ``data.class_path``, as
``configs/sft_*.yaml`` name :class:`~lightning_ulysses.finetune.SFTDataModule`); a config that gives only the
arguments of ``model`` or ``data`` gets the defaults' classes.

Commands (``lightning-ulysses --help`` lists them):

* ``fit``, ``validate``, ``test``, ``predict``: every argument of the Trainer, of
  :class:`~lightning_ulysses.UlyssesStrategy`, of the model and of the data can be set in YAML or on the command
  line (``--trainer.strategy.sp_size 4``); ``--print_config`` prints a complete config to stdout, and nothing
  else. The config is checked before any process starts (:mod:`lightning_ulysses.cli.checks`). ``validate``,
  ``test`` and ``predict`` from a run's checkpoint write into that run's folder (``<run>/<command>/``).
* ``convert-checkpoint SRC DST`` (:func:`~lightning_ulysses.runtime.convert_checkpoint`): a universal copy that
  ``--ckpt_path DST`` resumes on another process count or ZeRO stage.
* ``export CKPT_OR_RUN OUT``: a ``from_pretrained`` folder (:mod:`lightning_ulysses.cli.commands`).
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelSummary, ProgressBar
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI, SaveConfigCallback

from lightning_ulysses import quiet
from lightning_ulysses.cli.checks import (
    ConfigError,
    check_checkpoint_file,
    check_config,
    missing_package,
    run_folder_of,
)
from lightning_ulysses.cli.commands import COMMANDS, command_parser, run_command
from lightning_ulysses.cli.parser import (
    COMMAND_HELP,
    DESCRIPTION,
    PROG,
    HelpFormatter,
    UlyssesArgumentParser,
    link_vocabulary,
    subcommand_kwargs,
)
from lightning_ulysses.cli.run_folder import RunFolderReport
from lightning_ulysses.cli.summary import ModelSummaryWithoutFlops
from lightning_ulysses.prediction import PredictionWriter
from lightning_ulysses.progress import progress_bar

DEFAULT_MODEL = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
"""A small Llama-style model that trains in minutes on CPU (the model of ``configs/quickstart.yaml``)."""


class SaveRunConfig(SaveConfigCallback):
    """Saves ``config.yaml`` into the run's folder (the logger's ``log_dir``). Without a logger
    (``--trainer.logger false``) there is no run folder, and nothing is written (Lightning's callback would write
    into the working directory and refuse the next run)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.logger is None:
            return
        super().setup(trainer, pl_module, stage)


class UlyssesCLI(LightningCLI):
    """LightningCLI whose model vocabulary follows the tokenizer, with Ulysses, :class:`CausalLM` of a small Llama and
    :class:`LongTextDataModule` as defaults, a config checked before any process starts, and the progress bar of
    :mod:`lightning_ulysses.progress`."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        link_vocabulary(parser)
        # classes, not the name "ulysses", so that --trainer.strategy.sp_size works without a config file
        parser.set_defaults(
            {
                "trainer.strategy": {"class_path": "lightning_ulysses.UlyssesStrategy"},
                "model": {"class_path": "lightning_ulysses.CausalLM", "init_args": {"model": DEFAULT_MODEL}},
                "data": {"class_path": "lightning_ulysses.LongTextDataModule"},
            }
        )

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        subcommands = parser._subcommands_action
        assert subcommands is not None  # LightningCLI has just added them
        for choice in subcommands._choices_actions:  # Lightning's are cut mid-sentence
            choice.help = COMMAND_HELP.get(choice.dest, choice.help)
        for name, function in COMMANDS.items():  # listed in --help; main() runs them without LightningCLI
            assert function.__doc__ is not None  # a command's first docstring line is its --help entry
            subcommands.add_subcommand(name, command_parser(name, function), help=function.__doc__.splitlines()[0])

    def _parse_ckpt_path(self) -> None:
        """Lightning unpickles a file ``ckpt_path`` here for its hyperparameters, before any check: a file that is
        no checkpoint is refused first, in one line."""
        if self.config.get("subcommand"):
            check_checkpoint_file(self.config[self.config.subcommand].get("ckpt_path"))
        super()._parse_ckpt_path()

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_config(self.subcommand, config)
        _keep_last_checkpoint_current(config.trainer)
        if self.subcommand in ("validate", "test", "predict"):
            _log_into_the_run(config, self.subcommand)

    def instantiate_classes(self) -> None:
        """Builds the model, the data and the Trainer (in this process, before any other starts); one that needs an
        optional package that is not installed is refused with the ``pip install`` to run."""
        try:
            super().instantiate_classes()
        except Exception as error:  # a missing package is found in the error's chain; any other re-raises
            if (refusal := missing_package(error)) is None:
                raise
            raise refusal from None

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> L.Trainer:
        """The Trainer, with the progress bar of :func:`~lightning_ulysses.progress.progress_bar` and the model summary
        of :mod:`~lightning_ulysses.cli.summary`, unless the config disables them or names its own, and the lines
        that say where a fit writes (:class:`~lightning_ulysses.cli.run_folder.RunFolderReport`)."""
        configured = config.get("callbacks") or []
        configured = [*(configured if isinstance(configured, list) else [configured]), *callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in configured):
            callbacks = [*callbacks, progress_bar()]
        if config.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary) for c in configured):
            callbacks = [*callbacks, ModelSummaryWithoutFlops()]
            config["enable_model_summary"] = False  # else Lightning announces that it skips its own summary
        return super()._instantiate_trainer(config, [*callbacks, RunFolderReport()])

    def before_predict(self) -> None:
        # Lightning's connectors set it on the Trainer, whose class does not declare it (mypy: attr-defined)
        callbacks: list[Callback] = self.trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(callback, PredictionWriter) for callback in callbacks):
            callbacks.append(PredictionWriter())


def _keep_last_checkpoint_current(trainer: Any) -> None:
    """Lightning's ``ModelCheckpoint`` named in a config runs as :class:`lightning_ulysses.ModelCheckpoint` (the same
    arguments), whose ``last.ckpt`` is always the latest step (Lightning's keeps an older one when a validation is not
    the best)."""
    callbacks = trainer.get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if getattr(callback, "class_path", None) == "lightning.pytorch.callbacks.ModelCheckpoint":
            callback.class_path = "lightning_ulysses.ModelCheckpoint"


def _log_into_the_run(config: Any, command: str) -> None:
    """Evaluation from a run's checkpoint logs into ``<run>/<command>/`` instead of a new ``version_N`` of the run's
    name."""
    run = run_folder_of(config.get("ckpt_path"))
    logger = config.trainer.get("logger")
    init_args = getattr(logger, "init_args", None)
    if run is None or init_args is None or "save_dir" not in init_args:
        return
    init_args.save_dir, init_args.name, init_args.version = str(run), "", command


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning-ulysses`` console script and of ``python -m lightning_ulysses``."""
    argv = sys.argv[1:] if args is None else args
    with quiet.installed(quiet.CLI):
        if isinstance(argv, list) and argv[:1] and argv[0] in COMMANDS:
            run_command(argv[0], argv[1:], prog=f"{PROG} {argv[0]}")
            return
        try:
            UlyssesCLI(
                L.LightningModule,
                L.LightningDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                args=args,
                auto_configure_optimizers=False,
                save_config_callback=SaveRunConfig,
                save_config_kwargs={"overwrite": True},
                parser_class=UlyssesArgumentParser,
                parser_kwargs={
                    "prog": PROG,
                    "description": DESCRIPTION,
                    "formatter_class": HelpFormatter,
                    **subcommand_kwargs(),
                },
            )
        except ConfigError as error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
            raise SystemExit(2) from None


if __name__ == "__main__":
    main()
