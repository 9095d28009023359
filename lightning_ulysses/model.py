"""``CausalLM``: a Hugging Face causal language model as a LightningModule, ready for sequence parallelism.

The step reads the batch that :class:`~lightning_ulysses.UlyssesStrategy` delivers (this rank's
``[B, N/sp]`` shard of ``input_ids``, global ``position_ids`` and ``shift_labels``) and reduces the
token losses with :class:`~lightning_ulysses.UlyssesLossMixin`, so logged losses and gradients equal
those of one process on whole sequences. Under any other strategy the mixin prepares the batch, whole,
and the model runs the same document-masked attention locally (plain SDPA would let packed
documents attend to each other).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lightning_ulysses.logits import Logits
from lightning_ulysses.loss import UlyssesLossMixin
from lightning_ulysses.metrics import TokenCrossEntropy
from lightning_ulysses.prediction import token_log_probs


class CausalLM(UlyssesLossMixin, L.LightningModule):
    """Next-token training of a transformers causal LM with AdamW and a warmup + cosine schedule.

    Args:
        model: a config as a dict (``model_type`` plus any of its fields, e.g. ``{"model_type": "llama",
            "hidden_size": 256, ...}``; random weights), or the path of a local model folder (its
            ``config.json``; random weights unless ``pretrained``).
        pretrained: load the weights of the folder ``model`` instead of initialising them randomly (any ZeRO stage;
            in the dtype the Trainer's precision sets, not the checkpoint's).
        vocab_size: vocabulary size of the tokenizer (the CLI links it to ``data.vocab_size``). Overrides
            the config's for random weights; pretrained models must already have at least this many.
        learning_rate: peak AdamW learning rate, reached after ``warmup_steps``.
        weight_decay: AdamW weight decay of the matrices (biases, norms and other 1-D weights get none), told
            apart by their real shapes, also under ZeRO-3.
        betas: AdamW betas.
        warmup_steps: linear warmup from 0; then cosine decay to ``min_lr_ratio * learning_rate`` at the
            schedule's last step (:class:`WarmupCosine`).
        min_lr_ratio: final learning rate as a fraction of ``learning_rate``.
        gradient_checkpointing: recompute each layer's activations in backward (long sequences).
        lr_schedule_steps: optimizer steps the schedule decays over. ``None``: the Trainer's total when training
            starts (``max_steps``). The schedule is saved in every checkpoint, so a resumed run continues it, also
            with another ``max_steps`` (which it then says); set this to resume onto a new length.

    Logs ``train_loss`` (each step), ``val_loss`` and ``val_ppl`` (each validation; ``test_loss`` and
    ``test_ppl`` under ``test``): token-weighted means over every valid token, the same numbers one
    process on whole sequences would report. ``predict`` returns, per batch, ``input_ids`` and
    ``token_log_probs`` (the log-probability of each next token, 0 where there is none) ``[B, N]`` in
    whole-sequence order, ``N`` padded to a multiple of ``sp_size``.
    """

    auto_class: Any = AutoModelForCausalLM
    """The transformers auto class that builds (``from_config``) or loads (``from_pretrained``) the model."""

    def __init__(
        self,
        model: dict[str, Any] | str,
        pretrained: bool = False,
        vocab_size: int | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        gradient_checkpointing: bool = False,
        lr_schedule_steps: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if pretrained and not isinstance(model, str):
            raise ValueError(
                "model.pretrained=True needs model.model to be the path of a local model folder, not a dict."
            )
        self.model: PreTrainedModel | None = None
        self.eval_loss = TokenCrossEntropy()

    def configure_model(self) -> None:
        """Build the transformer here, not in ``__init__``: under ZeRO-3 it is then partitioned as it is created.

        Under ZeRO-3, transformers is told so (:func:`_transformers_zero3`): ``from_pretrained`` then loads each
        weight into its partitions and ``from_config`` initialises the partitioned weights.
        """
        if self.model is not None:
            return
        hp: Any = self.hparams  # the constructor's arguments (an AttributeDict; typed as any mutable mapping)
        # the default dtype, as from_config gives it, not the checkpoint's: the Trainer's precision decides
        options = {"attn_implementation": "sdpa", "dtype": torch.get_default_dtype()}
        with _transformers_zero3(self._trainer.strategy if self._trainer is not None else None):
            if hp.pretrained:
                self.model = _load_pretrained(hp.model, self.auto_class, **options)
            else:
                self.model = self.auto_class.from_config(build_config(hp.model, hp.vocab_size), **options)
        self.model.train()  # from_pretrained returns it in eval mode: no dropout, no activation checkpointing
        if hp.pretrained:
            model_vocab = self.model.get_input_embeddings().num_embeddings
            if hp.vocab_size is not None and hp.vocab_size > model_vocab:
                raise ValueError(
                    f"The tokenizer has {hp.vocab_size} ids but the pretrained model embeds only {model_vocab}. Use "
                    "the tokenizer saved with the model (data.tokenizer=<model folder>)."
                )
        if hp.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def _prepared(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The batch as UlyssesStrategy delivers it (:meth:`~lightning_ulysses.UlyssesLossMixin.prepared_batch`)."""
        assert self.model is not None  # configure_model has run
        return dict(self.prepared_batch(self.model, batch))

    def _logits(self, batch: dict[str, Tensor]) -> Logits:
        assert self.model is not None  # configure_model has run
        return self.causal_lm_logits(self.model, batch)  # tiled, never whole, when the strategy's tiled_loss is on

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        assert self.model is not None  # configure_model has run
        loss = self.forward_causal_lm_loss(self.model, self._prepared(batch))  # tiled when the strategy says so
        # the value is already the SP group's mean; sync_dist averages the DP groups, as their gradients are
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._update_eval_loss(self._prepared(batch))

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._update_eval_loss(self._prepared(batch))

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        batch = self._prepared(batch)
        outputs = {
            "input_ids": batch["input_ids"],
            "token_log_probs": token_log_probs(self._logits(batch), batch["shift_labels"]),
        }
        gather = getattr(self.trainer.strategy, "gather_sequence", None)  # UlyssesStrategy: shards -> whole rows
        return {key: gather(value) for key, value in outputs.items()} if gather is not None else outputs

    def on_validation_epoch_end(self) -> None:
        self._log_eval_loss("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval_loss("test")

    def _update_eval_loss(self, batch: dict[str, Tensor]) -> None:
        # sums of token losses and valid tokens, summed over every SP and DP rank: the exact token mean
        self.eval_loss.update(self._logits(batch), batch["shift_labels"])

    def _log_eval_loss(self, prefix: str) -> None:
        loss = self.eval_loss.compute()  # synchronised over all ranks by torchmetrics: the same value everywhere
        self.eval_loss.reset()
        self.log_dict({f"{prefix}_loss": loss, f"{prefix}_ppl": loss.exp()}, prog_bar=True, sync_dist=True)

    def on_train_start(self) -> None:
        """A resumed run has the checkpoint's schedule (restored with the scheduler's state); say what a new
        ``max_steps`` or ``lr_schedule_steps`` changes."""
        scheduler = self.lr_schedulers()
        if isinstance(scheduler, LambdaLR) and isinstance(scheduler.lr_lambdas[0], WarmupCosine):
            # hparams: an AttributeDict of the constructor's arguments, typed as any mutable mapping
            _reconcile_schedule(scheduler, self.hparams.lr_schedule_steps, self.trainer)  # type: ignore[attr-defined]

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        """AdamW, weight decay on the matrices only, and the warmup + cosine schedule, stepped every optimizer step."""
        hp: Any = self.hparams  # the constructor's arguments (an AttributeDict; typed as any mutable mapping)
        trainable = [p for p in self.parameters() if p.requires_grad]
        # by the real shape: ZeRO-3 keeps each parameter as a 1-D partition and its shape in ds_shape
        matrices = [p for p in trainable if len(getattr(p, "ds_shape", p.shape)) >= 2]
        vectors = [p for p in trainable if len(getattr(p, "ds_shape", p.shape)) < 2]
        groups = [{"params": matrices, "weight_decay": hp.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(
            [group for group in groups if group["params"]],  # an empty group would break the LR schedule under ZeRO
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
        )
        total_steps = hp.lr_schedule_steps or max(int(self.trainer.estimated_stepping_batches), 1)
        scheduler = LambdaLR(optimizer, WarmupCosine(hp.warmup_steps, total_steps, hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class WarmupCosine:
    """The learning-rate factor of optimizer step ``step``: linear warmup from 0 over ``warmup_steps``, cosine decay
    to ``min_ratio`` at ``total_steps``, then ``min_ratio`` (transformers' warmup + cosine-with-min-lr schedule up to
    ``total_steps``, held after it instead of rising again).

    A callable object rather than a function, so that ``LambdaLR.state_dict`` saves its attributes: a checkpoint
    holds the schedule's length, and a resumed run continues the schedule it resumes.
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float) -> None:
        self.warmup_steps = min(warmup_steps, total_steps)
        self.total_steps = total_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _reconcile_schedule(scheduler: LambdaLR, requested_steps: int | None, trainer: L.Trainer) -> None:
    """After a resume: apply ``lr_schedule_steps`` if it differs from the checkpoint's schedule, or warn that the
    run's end differs from the end of the schedule it continues."""
    schedule, step = cast(WarmupCosine, scheduler.lr_lambdas[0]), scheduler.last_epoch  # as on_train_start checked
    lr_at = lambda: scheduler.base_lrs[0] * schedule(step)  # noqa: E731
    if requested_steps is not None and requested_steps != schedule.total_steps:
        before, saved = lr_at(), schedule.total_steps
        for fn in scheduler.lr_lambdas:
            fn.total_steps = requested_steps  # type: ignore[attr-defined]  # WarmupCosine's (one object per group)
        for group, base_lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = base_lr * schedule(step)
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
        rank_zero_info(
            f"model.lr_schedule_steps={requested_steps}: the learning-rate schedule of the checkpoint decayed over "
            f"{saved} steps; from step {step} on it decays over {requested_steps} "
            f"(learning rate {before:.3g} -> {lr_at():.3g})."
        )
        return
    end = int(trainer.estimated_stepping_batches) if trainer.max_steps != -1 else None
    if requested_steps is None and end is not None and end != schedule.total_steps:
        final = scheduler.base_lrs[0] * schedule.min_ratio
        after = (  # from the later of the schedule's end and this run's first step
            f"steps {max(schedule.total_steps, step)}-{end - 1} run at its final learning rate {final:.3g}"
            if end > schedule.total_steps
            else f"the run stops at step {end}, before the schedule's end"
        )
        rank_zero_warn(
            f"Resumed at step {step} with the learning-rate schedule saved in the checkpoint, which decays over "
            f"{schedule.total_steps} optimizer steps; this run ends at step {end}, so {after}. To decay over {end} "
            f"steps instead, add --model.lr_schedule_steps {end}."
        )


def build_config(model: dict[str, Any] | str, vocab_size: int | None = None) -> PretrainedConfig:
    """A transformers config from a dict with ``model_type`` or from a local model folder."""
    if isinstance(model, str):
        config = AutoConfig.from_pretrained(_local_folder(model))
    else:
        fields = dict(model)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError(
                "model.model as a dict needs a 'model_type' entry (e.g. 'llama', 'qwen3', 'mistral') next to the "
                f"config fields; got keys {sorted(fields)}."
            )
        config = AutoConfig.for_model(model_type, **fields)
    if vocab_size is not None:
        config.get_text_config().vocab_size = vocab_size  # a vision-language config's decoder holds it
    return config


def _load_pretrained(folder: str, auto_class: Any = AutoModelForCausalLM, **options: Any) -> PreTrainedModel:
    """``auto_class.from_pretrained`` that refuses a partial load.

    transformers initialises a weight the folder lacks (or holds in another shape, when told to ignore sizes) at
    random and only logs it: fine-tuning would then start from a model that is not the pretrained one. Under ZeRO-3
    it reports missing weights but not unused ones (``unexpected_keys`` stays empty there), so those are checked
    under ZeRO 1/2 and on one process only.
    """
    model, info = auto_class.from_pretrained(_local_folder(folder), output_loading_info=True, **options)
    problems = {
        "missing from the folder (would be initialised at random)": info["missing_keys"],
        "of another shape in the folder": [str(key) for key in info["mismatched_keys"]],
        "not used by the model": info["unexpected_keys"],
        "load errors": info["error_msgs"],
    }
    found = {what: sorted(keys) for what, keys in problems.items() if keys}
    if found:
        listed = "; ".join(
            f"{what}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}" for what, keys in found.items()
        )
        raise ValueError(
            f"model.model={folder!r} does not hold exactly the weights of {type(model).__name__} ({listed}). Use the "
            "folder saved with this architecture, or train from the config (model.pretrained=false)."
        )
    return model


@contextmanager
def _transformers_zero3(strategy: Strategy | None) -> Iterator[None]:
    """While a model is built under a ZeRO-3 DeepSpeed strategy, let transformers know (``HfDeepSpeedConfig``).

    Otherwise ``from_pretrained`` builds the model on the meta device inside the strategy's ``zero.Init`` and
    loads into empty partitions, and ``from_config`` initialises the partitions instead of the weights; told,
    both gather one module at a time. Only for the build: the setting is global to the process, and a later
    model (another Trainer, another strategy) must not inherit it.
    """
    if not getattr(strategy, "zero_stage_3", False):
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    config = cast(DeepSpeedStrategy, strategy).config  # zero_stage_3 is DeepSpeedStrategy's
    hf_deepspeed_config = HfDeepSpeedConfig(config)  # noqa: F841 - transformers holds only a weak reference
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


def _local_folder(path: str) -> Path:
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model.model={path!r} is not a local model folder with a config.json. Nothing is downloaded at run time: "
            "save the model first (AutoModelForCausalLM.from_pretrained(name).save_pretrained(folder)), or give the "
            "config as a dict."
        )
    return folder
