"""The parser of ``lightning-ulysses``: help that says what the tool is and leads with the keys a run sets, and
errors in a line or two, with the closest valid key for a mistyped one.

jsonargparse prints a parsing error after the whole usage (about 50 lines for ``fit``) and, for a key of a class
given by ``class_path`` (``--data.seq_lem``), inside a report of every type it tried.
:meth:`UlyssesArgumentParser.error` prints the error alone, made one line, with ``did you mean --data.seq_len?``
(``difflib`` over the keys of the command and of the classes it names) and the command's ``--help``.
``JSONARGPARSE_DEBUG=1`` keeps jsonargparse's own report.

:func:`link_vocabulary` is what every parser of a run's model and data shares: the model's vocabulary is the data's.
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from jsonargparse import ArgumentParser, DefaultHelpFormatter
from jsonargparse._common import debug_mode_active
from lightning.pytorch.cli import LightningArgumentParser

from lightning_ulysses.cli.checks import _class_of

PROG = "lightning-ulysses"

DESCRIPTION = (
    "Train and fine-tune transformers on long sequences with Ulysses sequence parallelism (PyTorch Lightning and "
    "DeepSpeed): every sequence is split over sp_size processes, with the loss and gradients of one process that sees "
    "the whole sequence. Start with: lightning-ulysses fit --config configs/quickstart.yaml"
)

COMMAND_HELP = {
    "fit": "Train a model, or resume a run with --ckpt_path, each sequence split over sp_size processes.",
    "validate": "Compute a checkpoint's validation loss (--ckpt_path), logged into its run's folder.",
    "test": "Compute a checkpoint's loss on the held-out test files (--ckpt_path), logged into its run's folder.",
    "predict": "Score every next token of the validation files with a checkpoint (--ckpt_path): predictions.pt.",
}
"""One whole line per LightningCLI command for ``lightning-ulysses --help`` (Lightning's are the first lines of the
Trainer's docstrings, cut mid-sentence) and the first line of its own ``--help``."""

KEYS = """The keys most runs set (every key: the groups below, or --print_config):
  -c, --config FILE                       a YAML config: configs/quickstart.yaml, or a run's config.yaml
  --print_config                          print the complete config (every key and value) and exit
  --trainer.devices N                     processes per machine (--trainer.num_nodes: machines)
  --trainer.strategy UlyssesFSDPStrategy  the FSDP2 engine instead of DeepSpeed (UlyssesStrategy, default)
  --trainer.strategy.init_args.sp_size N  processes that share one sequence; divides devices x num_nodes
  --trainer.strategy.init_args.stage N    DeepSpeed ZeRO stage: 1, 2 or 3
  --data.seq_len N                        tokens per sequence before it is split (seq_len / sp_size each)
  --data.batch_size N                     sequences per micro-batch of each data-parallel group
  --data.paths '[PATH, ...]'              the data's files or folders
  --trainer.max_steps N                   optimizer steps to train
  --ckpt_path PATH                        the checkpoint to resume (fit) or to evaluate"""


def subcommand_kwargs() -> dict[str, dict[str, str]]:
    """``parser_kwargs`` of LightningCLI's commands: a short usage, and the description that names the keys."""
    usage = "[-h] [-c CONFIG] [--print_config] [--KEY VALUE ...]"
    return {
        name: {"description": f"{help_line}\n\n{KEYS}", "usage": f"{PROG} {name} {usage}"}
        for name, help_line in COMMAND_HELP.items()
    }


def link_vocabulary(parser: LightningArgumentParser) -> None:
    """The model's ``vocab_size`` is the data module's (its tokenizer's), given when both are built: by
    LightningCLI's parser and by the one that ``export`` builds a run's classes with."""
    parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")


class HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help formatter, which keeps the lines of a key table (a paragraph whose every line starts with
    ``"  -"``) as written; other text is filled as before."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = text.split("\n\n")
        if not any(_is_key_table(paragraph) for paragraph in paragraphs):
            return super()._fill_text(text, width, indent)
        return "\n\n".join(
            paragraph if _is_key_table(paragraph) else super(HelpFormatter, self)._fill_text(paragraph, width, indent)
            for paragraph in paragraphs
        )


def _is_key_table(paragraph: str) -> bool:
    lines = paragraph.splitlines()[1:]  # after its title line
    return bool(lines) and all(line.startswith("  -") for line in lines)


class UlyssesArgumentParser(LightningArgumentParser):
    """LightningCLI's parser whose errors are short (see the module's docstring)."""

    def parse_args(  # type: ignore[override]  # as jsonargparse's own, which departs from argparse's overloads
        self, args: Sequence[str] | None = None, *more: Any, **kwargs: Any
    ) -> Any:
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, *more, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or debug_mode_active():  # a nested parser's error, caught by its caller
            super().error(message, ex)
        root: Any = self  # jsonargparse sets parent_parser on nested parsers only
        while getattr(root, "parent_parser", None) is not None:
            root = root.parent_parser
        argv = getattr(root, "_argv", [])
        commands = root._subcommands_action._name_parser_map if root._subcommands_action else {}
        command = next((arg for arg in argv if arg in commands), None)
        line = short_error(message, argv, commands.get(command, root))
        help_command = " ".join([PROG, *([command] if command else []), "--help"])
        sys.stderr.write(f"{PROG}: error: {line}\nEvery key: {help_command}\n")
        self.exit(2)


def short_error(message: str, argv: list[str], parser: ArgumentParser) -> str:
    """jsonargparse's ``message`` in one line, with the closest valid key for an unknown one."""
    if message.startswith("unrecognized arguments:"):
        unknown = [arg.split("=")[0] for arg in message.split()[2:] if arg.startswith("--")]
        if unknown:
            keys = _command_keys(parser)
            return "; ".join(f"unknown key {key}{_did_you_mean(key, keys)}" for key in unknown)
    in_config = re.search(r"does not accept option '([^']+)'", message)
    if in_config:  # a key of a config file
        return message + _did_you_mean(in_config[1], [key.lstrip("-") for key in _command_keys(parser)])
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        return message + _did_you_mean(choice[1], re.findall(r"'([^']+)'", choice[2]))
    key = re.match(r'Parser key "([^"]+)":', message)
    problem = re.search(
        r"Problem with given class_path '([^']+)':\n(.*?)(?=\n\s*- |\n\s*Given value|\Z)", message, re.S
    )
    if key and problem:
        inner = " ".join(line.strip() for line in problem[2].splitlines())
        option = re.fullmatch(r"Option '([^']+)' is not accepted", inner)
        if option:
            typed = next(
                (
                    arg.split("=")[0]
                    for arg in argv
                    if re.fullmatch(rf"--{re.escape(key[1])}(\.init_args)?\.{re.escape(option[1])}(=.*)?", arg)
                ),
                f"{key[1]}.{option[1]}",
            )
            prefix = typed[: -len(option[1])]
            names = [prefix + name for name in _init_argument_names(problem[1])]
            cls = problem[1].rpartition(".")[2]
            return f"unknown key {typed}: {cls} has no argument {option[1]!r}" + _did_you_mean(typed, names)
        nested = re.match(r'Parser key "([^"]+)": (.*)', inner)
        return f"{key[1]}.{nested[1]}: {nested[2]}" if nested else f"{key[1]}: {inner}"
    one_line = " ".join(line.strip() for line in message.splitlines())
    return f"{key[1]}: {one_line[key.end() :].strip()}" if key else one_line


def _did_you_mean(typed: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(typed, valid, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _command_keys(parser: ArgumentParser) -> list[str]:
    """The command's options (``--trainer.max_steps``) and the keys of the classes its defaults name
    (``--data.seq_len`` of LongTextDataModule)."""
    keys = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
    try:
        defaults = parser.get_defaults()
    except Exception:  # noqa: BLE001 - an error message is being written: keys of the classes are a bonus
        return keys
    for key, value in defaults.items():
        if key.endswith(".class_path") and isinstance(value, str):
            base = key[: -len(".class_path")]
            keys += [f"--{base}.{name}" for name in _init_argument_names(value)]
    return keys


def _init_argument_names(class_path: str) -> list[str]:
    """The init arguments of ``class_path`` as jsonargparse reads them (also those passed on through ``**kwargs``)."""
    cls = _class_of(class_path)
    parser = ArgumentParser(exit_on_error=False)
    try:
        parser.add_class_arguments(cls, fail_untyped=False)
    except Exception:  # noqa: BLE001 - as above (None, or a class jsonargparse cannot read)
        return []
    return [action.dest for action in parser._actions if action.dest != "help" and not action.dest.endswith(".help")]
