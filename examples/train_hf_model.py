"""Sequence parallelism for a Hugging Face model from plain Python: ``Trainer(strategy=UlyssesStrategy(...))``.

Each sequence of 1024 tokens is split over 2 CPU processes (512 tokens each); the strategy shards the
batches and swaps the model's attention for Ulysses all-to-all attention, the mixin reduces the loss.

    python examples/train_hf_model.py               # Lightning starts the 2 processes itself
    python examples/train_hf_model.py --max-steps 5

On GPUs: accelerator="gpu", devices=8, sp_size=8 (or fewer), precision="bf16-mixed".
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ulysses import LongTextDataModule, UlyssesLossMixin, UlyssesStrategy


class LitLlama(UlyssesLossMixin, L.LightningModule):
    def __init__(self, vocab_size: int, learning_rate: float = 2e-3) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,  # any head count works with any sp_size (GQA, MQA, heads that do not divide)
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        # batch: this rank's [B, N/sp] shard of input_ids, their global position_ids, and shift_labels
        # (labels shifted before sharding). Without position_ids the model would put RoPE at 0..N/sp-1.
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = self.causal_lm_loss(logits, batch["shift_labels"])  # the SP group's exact token mean
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-steps", type=int, default=50)
    args = parser.parse_args()

    L.seed_everything(0)
    data = LongTextDataModule(paths=["stdlib"], seq_len=1024, batch_size=2, max_files=100)  # Python's own sources
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=UlyssesStrategy(sp_size=2, stage=2),
        max_steps=args.max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(LitLlama(data.vocab_size), data)


if __name__ == "__main__":
    main()
