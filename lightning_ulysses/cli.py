"""``lightning-ulysses``: the LightningCLI of :class:`CausalLM` on :class:`LongTextDataModule` by default.

Any LightningModule and LightningDataModule can be named instead (``model.class_path``, ``data.class_path``, as
``configs/sft_*.yaml`` name :class:`~lightning_ulysses.finetune.SFTDataModule`); a config that gives only the
arguments of ``model`` or ``data`` gets the defaults' classes.

Subcommands ``fit``, ``validate``, ``test`` and ``predict``; every argument of the Trainer, of
:class:`~lightning_ulysses.UlyssesStrategy`, of the model and of the data can be set in YAML or on the
command line (``--trainer.strategy.sp_size 4``). ``--print_config`` shows a complete config.

``lightning-ulysses convert-checkpoint SRC DST`` runs :func:`~lightning_ulysses.convert_checkpoint`, so that
``--ckpt_path DST`` resumes on another process count or ZeRO stage.
"""

from __future__ import annotations

import sys

import lightning as L
from jsonargparse import CLI
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from lightning_ulysses.checkpoint import convert_checkpoint


DEFAULT_MODEL = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048, "tie_word_embeddings": True,
}
"""A small Llama-style model that trains in minutes on CPU (the model of ``configs/quickstart.yaml``)."""


class UlyssesCLI(LightningCLI):
    """LightningCLI whose model vocabulary follows the tokenizer, with Ulysses, :class:`CausalLM` of a small Llama and
    :class:`LongTextDataModule` as defaults."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
        # classes, not the name "ulysses", so that --trainer.strategy.sp_size works without a config file
        parser.set_defaults({
            "trainer.strategy": {"class_path": "lightning_ulysses.UlyssesStrategy"},
            "model": {"class_path": "lightning_ulysses.CausalLM", "init_args": {"model": DEFAULT_MODEL}},
            "data": {"class_path": "lightning_ulysses.LongTextDataModule"},
        })


CONVERT_CHECKPOINT = "convert-checkpoint"


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning-ulysses`` console script and of ``python -m lightning_ulysses``."""
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list) and argv[:1] == [CONVERT_CHECKPOINT]:
        CLI(convert_checkpoint, args=argv[1:], prog=f"lightning-ulysses {CONVERT_CHECKPOINT}")
        return
    UlyssesCLI(
        L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, args=args,
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":
    main()
