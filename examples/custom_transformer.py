"""Sequence parallelism for your own (non-Hugging Face) transformer: call ``ulysses_attention`` yourself.

Everything outside attention (embeddings, MLP, norms, logits, loss) acts on each token alone, so it
runs unchanged on this rank's ``[B, N/sp]`` tokens. Only attention needs the whole sequence:
``ulysses_attention`` gathers it per head group with two all-to-alls. Positions must be the global
ones (``batch["position_ids"]``), both for RoPE and to keep packed documents apart.

    python examples/custom_transformer.py               # 2 CPU processes, sp_size=2
    python examples/custom_transformer.py --max-steps 5
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import Tensor, nn

from lightning_ulysses import LongTextDataModule, UlyssesLossMixin, UlyssesStrategy, ulysses_attention
from lightning_ulysses.groups import SequenceParallelGroups


def rotate(x: Tensor, position_ids: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary embedding of ``x [B, n, H, D]`` at the global ``position_ids [B, n]``."""
    half = x.shape[-1] // 2
    frequencies = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = (position_ids[..., None].float() * frequencies)[:, :, None, :]  # [B, n, 1, D/2]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], dim=-1).type_as(x)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x: Tensor, position_ids: Tensor, group: SequenceParallelGroups) -> Tensor:
        """``x [B, N/sp, dim]``: this rank's tokens."""
        batch, local_len, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, local_len, 3, self.heads, dim // self.heads).unbind(2)
        q, k = rotate(q, position_ids), rotate(k, position_ids)
        # [B, N/sp, H, D]
        attended = ulysses_attention(q, k, v, group=group, attn_implementation="sdpa", position_ids=position_ids)
        x = x + self.proj(attended.flatten(2))
        return x + self.mlp(self.norm2(x))


class TinyGPT(UlyssesLossMixin, L.LightningModule):
    def __init__(self, vocab_size: int, dim: int = 128, heads: int = 4, layers: int = 4, lr: float = 2e-3) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        group = self.trainer.strategy.groups  # the ranks that hold the other shards of these sequences (ring included)
        x = self.embed(batch["input_ids"])
        for block in self.blocks:
            x = block(x, batch["position_ids"], group)
        loss = self.causal_lm_loss(self.head(self.norm(x)), batch["shift_labels"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-steps", type=int, default=50)
    args = parser.parse_args()

    L.seed_everything(0)
    data = LongTextDataModule(paths=["stdlib"], seq_len=1024, batch_size=2, max_files=100)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=UlyssesStrategy(sp_size=2, stage=2),
        max_steps=args.max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyGPT(data.vocab_size), data)


if __name__ == "__main__":
    main()
