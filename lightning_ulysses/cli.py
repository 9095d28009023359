"""``lightning-ulysses``: the LightningCLI of :class:`CausalLM` on :class:`LongTextDataModule`.

Subcommands ``fit``, ``validate``, ``test`` and ``predict``; every argument of the Trainer, of
:class:`~lightning_ulysses.UlyssesStrategy`, of the model and of the data can be set in YAML or on the
command line (``--trainer.strategy.sp_size 4``). ``--print_config`` shows a complete config.
"""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from lightning_ulysses.data import LongTextDataModule
from lightning_ulysses.model import CausalLM


class UlyssesCLI(LightningCLI):
    """LightningCLI whose model vocabulary follows the tokenizer and whose default strategy is Ulysses."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.set_defaults({"trainer.strategy": "ulysses"})


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning-ulysses`` console script and of ``python -m lightning_ulysses``."""
    UlyssesCLI(CausalLM, LongTextDataModule, args=args, auto_configure_optimizers=False)


if __name__ == "__main__":
    main()
