"""Tiny models, data and reference computations shared by the tests (fp32, CPU)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler
from transformers import CONFIG_MAPPING, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from lightning_ulysses import UlyssesLossMixin
from lightning_ulysses.sharding import IGNORE_INDEX, positions_within_runs

VOCAB = 61
OptimizerName = Literal["sgd", "adamw"]
TINY_LLAMA = dict(  # CausalLM(model=...): tiny_llama's shape as a config dict (vocabulary set by the data)
    model_type="llama",
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def tiny_llama(seed: int = 0, model_type: str = "llama", **overrides: Any) -> PreTrainedModel:
    """A seeded fp32 tiny Llama, or a causal LM of another ``model_type`` with the same sizes (``overrides`` on top:
    a family's own fields, such as DeepSeek's MLA head sizes)."""
    config = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    config.update(overrides)
    torch.manual_seed(seed)
    config_class = CONFIG_MAPPING[model_type]
    return MODEL_FOR_CAUSAL_LM_MAPPING[config_class](config_class(**config))


def cpu_trainer(devices: int, strategy: Any, **kwargs: Any) -> L.Trainer:
    """A Trainer on ``devices`` CPU processes that writes no logs or checkpoints and prints no progress bar or model
    summary, as most tests train; ``kwargs`` add to or override that."""
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**settings, **kwargs})


def make_optimizer(
    params: Iterable[torch.nn.Parameter], name: OptimizerName, lr: float, momentum: float
) -> torch.optim.Optimizer:
    """SGD (with ``momentum``) or AdamW with the usual two param groups: weight decay on the matrices, none on the
    vectors (norms)."""
    if name == "adamw":
        params = list(params)
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def projected_layers(model: torch.nn.Module) -> list[str]:
    """The attention layers of a patched ``model`` planned to run with their projections inside head chunks."""
    return [
        name
        for name, module in model.named_modules()
        if getattr(module.__dict__.get("_ulysses_plan"), "projection_chunks", None) is not None
    ]


class TinyCausalLM(UlyssesLossMixin, L.LightningModule):
    """A causal LM step in its plainest form: forward with position ids, token-weighted loss, SGD or AdamW."""

    def __init__(
        self,
        lr: float = 0.5,
        loss_multiplier: float = 1.0,
        momentum: float = 0.0,
        optimizer: OptimizerName = "sgd",
        **model_overrides: Any,
    ) -> None:
        super().__init__()
        self.model = tiny_llama(**model_overrides)
        self.lr = lr
        self.momentum = momentum
        self.optimizer_name = optimizer
        self.loss_multiplier = loss_multiplier
        self.losses: list[float] = []
        self.projected: list[str] = []
        """The attention layers that ran with their projections inside head chunks (lightning_ulysses.hf.projections),
        read at each training step (the strategy's teardown removes the patch)."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.projected = projected_layers(self.model)
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = self.causal_lm_loss(logits, batch["shift_labels"]) * self.loss_multiplier
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters(), self.optimizer_name, self.lr, self.momentum)


class SaveAndStop(L.Callback):
    """Saves a checkpoint where ``ModelCheckpoint(every_n_train_steps=...)`` would, after step ``step``, then
    stops the run as a preemption would, keeping the weights it saved."""

    def __init__(self, step: int, path: str, zero_stage_3: bool) -> None:
        self.step, self.path, self.zero_stage_3 = step, path, zero_stage_3
        self.saved: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            self.saved = gathered_parameters(pl_module.model, self.zero_stage_3)
            trainer.should_stop = True


def make_samples(
    num: int, seq_len: int, seed: int = 1, masked_spans: list[tuple[int, int]] = (), padding: int = 0
) -> list[dict[str, Tensor]]:
    """Random token rows; ``masked_spans`` set labels to -100; the last ``padding`` columns of odd rows are padding."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num):
        ids = torch.randint(1, VOCAB, (seq_len,), generator=g)
        sample = {"input_ids": ids}
        if masked_spans:
            labels = ids.clone()
            for start, end in masked_spans:
                labels[start:end] = IGNORE_INDEX
            sample["labels"] = labels
        if padding:
            mask = torch.ones(seq_len, dtype=torch.long)
            if i % 2:
                mask[seq_len - padding :] = 0
            sample["attention_mask"] = mask
        samples.append(sample)
    return samples


def make_packed_samples(
    num: int, seq_len: int, seed: int = 1, borders: tuple[int, ...] = ()
) -> list[dict[str, Tensor]]:
    """Rows of 3-5 packed documents of random lengths (``position_ids`` restart at 0 at each document).

    Even rows have a document border at each column of ``borders`` (e.g. shard borders; at most 2), the other
    borders are random.
    """
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num):
        num_documents = int(torch.randint(3, 6, (), generator=g))
        cuts = list(borders) if i % 2 == 0 else []
        cuts += [c for c in (torch.randperm(seq_len - 1, generator=g) + 1).tolist() if c not in cuts]
        starts = torch.zeros(seq_len, dtype=torch.bool)
        starts[[0, *cuts[: num_documents - 1]]] = True
        samples.append(
            {
                "input_ids": torch.randint(1, VOCAB, (seq_len,), generator=g),
                "position_ids": positions_within_runs(starts[None])[0],
            }
        )
    return samples


def reference_loss(model: PreTrainedModel, batch: dict[str, Tensor]) -> Tensor:
    """The standard single-process loss on whole sequences: transformers' forward, shift, token mean.

    Packed rows (``position_ids`` restarting at 0) run every document through the model on its own, so no
    attention can cross a document border whatever our attention code does.
    """
    if "position_ids" in batch:
        return _packed_reference_loss(model, batch)
    labels = batch.get("labels", batch["input_ids"]).clone()
    mask = batch.get("attention_mask")
    if mask is not None:
        labels[mask == 0] = IGNORE_INDEX
    logits = model(input_ids=batch["input_ids"], attention_mask=mask).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)


def _packed_reference_loss(model: PreTrainedModel, batch: dict[str, Tensor]) -> Tensor:
    loss_sum, num_tokens = 0.0, 0
    for ids, positions in zip(batch["input_ids"], batch["position_ids"]):
        bounds = [*(positions == 0).nonzero().flatten().tolist(), len(ids)]
        for start, end in zip(bounds[:-1], bounds[1:]):
            logits = model(input_ids=ids[None, start:end]).logits[0]
            loss_sum = loss_sum + F.cross_entropy(logits[:-1], ids[start + 1 : end], reduction="sum")
            num_tokens += end - start - 1
    return loss_sum / num_tokens


def collate(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def collate_padded(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Right-pad ``input_ids`` rows of different lengths to the longest, with an ``attention_mask``."""
    length = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.zeros(len(samples), length, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), length, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, : len(sample["input_ids"])] = sample["input_ids"]
        attention_mask[row, : len(sample["input_ids"])] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


Collate = Callable[[list[dict[str, Tensor]]], dict[str, Tensor]]


def dp_batches(
    samples: list[dict[str, Tensor]], batch_size: int, dp_size: int = 1, epoch: int = 0, collate_fn: Collate = collate
) -> list[list[dict[str, Tensor]]]:
    """``[dp_rank][batch]``: the collated batches each DP rank's training loader yields in ``epoch``, dealt by the
    DistributedSampler that Lightning puts on a training loader (shuffled, seed 0); the last batch of an epoch
    may be smaller, as with ``drop_last=False``."""
    per_rank = [epoch_order(samples, dp_size, d, epoch) for d in range(dp_size)]
    return [[collate_fn(rank[i : i + batch_size]) for i in range(0, len(rank), batch_size)] for rank in per_rank]


def reference_training(
    samples: list[dict[str, Tensor]],
    *,
    steps: int,
    batch_size: int,
    dp_size: int = 1,
    accumulate: int = 1,
    lr: float = 0.5,
    momentum: float = 0.0,
    epochs: int = 1,
    collate_fn: Collate = collate,
    optimizer: OptimizerName = "sgd",
    skip_steps: tuple[int, ...] = (),
    **model_overrides: Any,
) -> tuple[list[float], dict[str, Tensor]]:
    """SGD (or AdamW) as DDP over ``dp_size`` ranks would run it, one process, whole sequences.

    Returns the micro-batch losses seen by DP rank 0 and the final parameters. Samples are dealt to DP
    ranks as in :func:`dp_batches`; each of ``epochs`` epochs runs ``steps`` steps on that epoch's order.
    The global steps in ``skip_steps`` use up their micro-batches without updating anything.
    """
    model = tiny_llama(**model_overrides)
    step_optimizer = make_optimizer(model.parameters(), optimizer, lr, momentum)
    losses = []
    for epoch in range(epochs):
        per_rank = dp_batches(samples, batch_size, dp_size, epoch, collate_fn)
        for step in range(steps):
            for micro in range(accumulate):
                for d in range(dp_size):
                    loss = reference_loss(model, per_rank[d][step * accumulate + micro])
                    (loss / (accumulate * dp_size)).backward()
                    if d == 0:
                        losses.append(loss.item())
            if epoch * steps + step not in skip_steps:
                step_optimizer.step()
            step_optimizer.zero_grad()
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def epoch_order(samples: list[dict[str, Tensor]], dp_size: int, dp_rank: int, epoch: int) -> list[dict[str, Tensor]]:
    sampler = DistributedSampler(samples, dp_size, dp_rank, shuffle=True)
    sampler.set_epoch(epoch)
    return [samples[i] for i in sampler]


def relative_update_error(initial: dict[str, Tensor], expected: dict[str, Tensor], got: dict[str, Tensor]) -> float:
    """``|got - expected| / |expected - initial|`` over all parameters: 1.0 would mean a wrong update."""
    diff = torch.cat([(got[k] - expected[k]).flatten() for k in expected])
    update = torch.cat([(expected[k] - initial[k]).flatten() for k in expected])
    assert update.norm() > 0, "the reference update is zero; the comparison would prove nothing"
    return (diff.norm() / update.norm()).item()


def gathered_parameters(model: torch.nn.Module, zero_stage_3: bool) -> dict[str, Tensor]:
    """Full copies of ``model``'s parameters, gathered from their ZeRO-3 partitions when needed."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=zero_stage_3):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


class PlainCausalLM(L.LightningModule):
    """The unpatched model under plain Lightning (no strategy): :func:`reference_loss` on whole sequences, SGD."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.model = tiny_llama()
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = reference_loss(self.model, batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class DPStepSampler(Sampler[int]):
    """The indices that ``dp_size`` DP ranks' shuffled DistributedSamplers deal in an epoch, micro-batch by
    micro-batch: ``batch_size`` of rank 0, then of rank 1, ..., so that one loader of ``batch_size * dp_size`` holds
    each DP micro-batch's rows together."""

    def __init__(self, num: int, dp_size: int, batch_size: int) -> None:
        self.num, self.dp_size, self.batch_size, self.epoch = num, dp_size, batch_size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        per_rank = []
        for rank in range(self.dp_size):
            sampler = DistributedSampler(range(self.num), self.dp_size, rank, shuffle=True)
            sampler.set_epoch(self.epoch)
            per_rank.append(list(sampler))
        for start in range(0, len(per_rank[0]), self.batch_size):
            for rank in per_rank:
                yield from rank[start : start + self.batch_size]

    def __len__(self) -> int:
        return -(-self.num // self.dp_size) * self.dp_size


def plain_lightning_training(
    samples: list[dict[str, Tensor]],
    *,
    batch_size: int,
    dp_size: int,
    accumulate: int,
    epochs: int,
    lr: float,
) -> tuple[list[float], dict[str, Tensor], int]:
    """One process, plain Lightning (no strategy, no DistributedSampler): each micro-batch holds the rows that the
    ``dp_size`` DP ranks train on together, every epoch to its end (the last accumulation window may be shorter).
    With rows of equal valid-token counts its loss equals DDP's average over the ranks.

    Returns the micro-batch losses, the final parameters and Lightning's ``global_step``.
    """
    module = PlainCausalLM(lr)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    sampler = DPStepSampler(len(samples), dp_size, batch_size)
    trainer.fit(module, DataLoader(samples, batch_size=batch_size * dp_size, sampler=sampler, collate_fn=collate))
    return module.losses, {name: p.detach().clone() for name, p in module.model.named_parameters()}, trainer.global_step


class AddAuxiliaryLoss(torch.autograd.Function):
    """DeepSeek-V2's (remote code): returns ``x`` as it is; the backward gives ``loss`` a gradient of 1, so that the
    load-balancing loss's gradient reaches the router without appearing in the model's loss."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, loss: Tensor) -> Tensor:
        ctx.dtype = loss.dtype
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, torch.ones((), dtype=ctx.dtype, device=grad.device)


class AuxiliaryLossMoE(nn.Module):
    """Top-1 mixture of experts, token-wise in its forward; in training its router's inputs are jittered at random
    (as Mixtral's ``router_jitter_noise``) and DeepSeek-V2's load-balancing loss over the call's tokens (each expert's
    mean probability times its share of the tokens) joins the gradient only: computed per tile it would differ."""

    def __init__(self, hidden: int, experts: int = 2, alpha: float = 0.1) -> None:
        super().__init__()
        self.alpha = alpha
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routed = flat * torch.empty_like(flat).uniform_(0.99, 1.01) if self.training else flat
        scores = self.gate(routed).softmax(-1)
        weight, choice = scores.max(-1)
        out = sum((choice == i)[:, None] * weight[:, None] * expert(flat) for i, expert in enumerate(self.experts))
        if self.training:
            share = F.one_hot(choice, len(self.experts)).to(scores.dtype).mean(0)
            out = AddAuxiliaryLoss.apply(out, (scores.mean(0) * share).sum() * len(self.experts) * self.alpha)
        return out.view_as(x)
