"""``lightning-ulysses``: the LightningCLI of :class:`CausalLM` on :class:`LongTextDataModule`.

Subcommands ``fit``, ``validate``, ``test`` and ``predict``; every argument of the Trainer, of
:class:`~lightning_ulysses.UlyssesStrategy`, of the model and of the data can be set in YAML or on the
command line (``--trainer.strategy.sp_size 4``). ``--print_config`` shows a complete config.

``lightning-ulysses convert-checkpoint SRC DST`` runs :func:`~lightning_ulysses.convert_checkpoint`, so that
``--ckpt_path DST`` resumes on another process count or ZeRO stage.
"""

from __future__ import annotations

import sys

from jsonargparse import CLI
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from lightning_ulysses.checkpoint import convert_checkpoint
from lightning_ulysses.data import LongTextDataModule
from lightning_ulysses.model import CausalLM


DEFAULT_MODEL = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048, "tie_word_embeddings": True,
}
"""A small Llama-style model that trains in minutes on CPU (the model of ``configs/quickstart.yaml``)."""


class UlyssesCLI(LightningCLI):
    """LightningCLI whose model vocabulary follows the tokenizer, with Ulysses and a small Llama as defaults."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        # the class, not the name "ulysses", so that --trainer.strategy.sp_size works without a config file
        parser.set_defaults({"trainer.strategy": {"class_path": "lightning_ulysses.UlyssesStrategy"}, "model.model": DEFAULT_MODEL})


CONVERT_CHECKPOINT = "convert-checkpoint"


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning-ulysses`` console script and of ``python -m lightning_ulysses``."""
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list) and argv[:1] == [CONVERT_CHECKPOINT]:
        CLI(convert_checkpoint, args=argv[1:], prog=f"lightning-ulysses {CONVERT_CHECKPOINT}")
        return
    UlyssesCLI(CausalLM, LongTextDataModule, args=args, auto_configure_optimizers=False)


if __name__ == "__main__":
    main()
