"""The commands of ``lightning-ulysses`` next to LightningCLI's: ``convert-checkpoint`` and ``export``.

Both run offline in one process, without DeepSpeed's engine, and print what they wrote and how to use it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import CLI, ArgumentParser

from lightning_ulysses.cli.parser import link_vocabulary
from lightning_ulysses.runtime import convert_checkpoint, export_hf_model, saved_global_step, saved_layout


def convert(checkpoint: str, output: str, overwrite: bool = False) -> None:
    """Convert a checkpoint to DeepSpeed's universal format, which resumes on any process count and ZeRO stage.

    Args:
        checkpoint: the checkpoint directory a run saved (e.g. runs/quickstart/version_0/checkpoints/last.ckpt).
        output: the directory to write, e.g. runs/quickstart/version_0/checkpoints/last-universal.
        overwrite: replace what ``output`` holds.
    """
    convert_checkpoint(checkpoint, output, overwrite)
    processes, stage = saved_layout(checkpoint)
    print(
        f"Wrote {output}: a universal copy of {checkpoint} (global step {saved_global_step(output)}, saved by "
        f"{processes} processes under ZeRO stage {stage}). Resume it on any process count and ZeRO stage with "
        f"--ckpt_path {output}."
    )


def export(checkpoint: str, output: str) -> None:
    """Write a trained model as a Hugging Face from_pretrained folder: config, weights and the run's tokenizer.

    The model and the data module are built from the run's ``config.yaml`` as the run built them (so the
    vocabulary is the tokenizer's), the weights come from the checkpoint (any ZeRO stage and process count, or
    converted), and the data module's tokenizer is saved beside them when it can be (``save_pretrained``).

    Args:
        checkpoint: a run folder (runs/<name>/version_N: its checkpoints/last.ckpt), or a checkpoint inside a run's
            checkpoints/ folder.
        output: the folder to write.
    """
    from transformers import PreTrainedModel

    run, ckpt = _run_and_checkpoint(Path(checkpoint))
    built = build_from_config(yaml.safe_load((run / "config.yaml").read_text()))
    module = built.model
    module.configure_model()
    model = getattr(module, "model", None)
    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"export writes the transformers model that the LightningModule holds as .model; {type(module).__name__} "
            "has none. Call lightning_ulysses.runtime.export_hf_model with your model and its prefix."
        )
    tokenizer: Any = getattr(built.data, "tokenizer", None)  # whatever the data module tokenizes with
    if tokenizer is not None:
        _set_special_token_ids(model, tokenizer)
    export_hf_model(ckpt, model, output)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(output)
        tokenizer_note = " and its tokenizer"
    else:
        tokenizer_note = f"; the tokenizer ({type(tokenizer).__name__}) cannot be saved, tokenize as the run did"
    print(
        f"Wrote {output}: the model of {ckpt} (global step {saved_global_step(ckpt)}){tokenizer_note}. Load it with "
        f"AutoModelForCausalLM.from_pretrained({str(output)!r})."
    )


def _set_special_token_ids(model: Any, tokenizer: Any) -> None:
    """The beginning, end and padding ids of the tokenizer the run trained with, in the model's config and its
    generation config (the config of a model built from ``model_type`` has its family's defaults, e.g. Llama's
    ``bos 1, eos 2``); ``generate`` also stops at the end of an assistant turn, as HF chat models' configs say with
    a list of end ids."""
    from lightning_ulysses.finetune.templates import turn_end_token_id

    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    generation = getattr(model, "generation_config", None)  # None for a model that cannot generate
    for key, value in ids.items():
        for config in (model.config, generation):
            if config is not None:
                setattr(config, key, value)
    if generation is not None:
        ends = list(dict.fromkeys(i for i in (tokenizer.eos_token_id, turn_end_token_id(tokenizer)) if i is not None))
        generation.eos_token_id = ends[0] if len(ends) == 1 else ends or None


def _run_and_checkpoint(path: Path) -> tuple[Path, Path]:
    """``(run folder, checkpoint)`` of a run folder (its ``checkpoints/last.ckpt``) or of a checkpoint in one."""
    if (path / "config.yaml").is_file():
        run, ckpt = path, path / "checkpoints" / "last.ckpt"
        if not ckpt.exists():
            raise FileNotFoundError(
                f"The run {path} has no checkpoints/last.ckpt; give the checkpoint to export instead."
            )
        return run, ckpt
    run = path.parent.parent
    if path.parent.name != "checkpoints" or not (run / "config.yaml").is_file():
        raise FileNotFoundError(
            f"{path} is neither a run folder with a config.yaml (runs/<name>/version_N) nor a checkpoint inside a "
            "run's checkpoints/ folder; export builds the model from the run's config.yaml."
        )
    return run, path


def build_from_config(config: dict[str, Any]) -> Any:
    """The run's LightningModule and data module (``.model``, ``.data``), built as ``lightning-ulysses fit`` built them
    (the saved config names both classes in full)."""
    import lightning as L
    from lightning.pytorch.cli import LightningArgumentParser

    parser = LightningArgumentParser()
    parser.add_lightning_class_args(L.LightningModule, "model", subclass_mode=True)
    parser.add_lightning_class_args(L.LightningDataModule, "data", subclass_mode=True)
    link_vocabulary(parser)
    return parser.instantiate_classes(parser.parse_object({key: config[key] for key in ("model", "data")}))


COMMANDS: dict[str, Callable[..., None]] = {"convert-checkpoint": convert, "export": export}


def command_parser(name: str, function: Callable[..., None]) -> ArgumentParser:
    """The parser of one command (for ``lightning-ulysses --help``)."""
    parser = ArgumentParser(prog=f"lightning-ulysses {name}", description=function.__doc__)
    parser.add_function_arguments(function, as_positional=True)
    return parser


def run_command(name: str, args: list[str], prog: str) -> None:
    CLI(COMMANDS[name], args=args, prog=prog)
