"""Callbacks for sequence-parallel training: what it is doing, and whether its loss is right.

* :class:`SequenceParallelMonitor` logs tokens/s, samples/s, padding, the valid tokens of every SP rank
  and their imbalance, peak memory, FLOPs per token, TFLOP/s and MFU (CUDA), and optionally the share
  of each step spent in the all-to-alls.
* :class:`SequenceParallelParityCheck` recomputes the loss of a global batch without sequence
  parallelism and compares it with the loss that training returned: a guard against losses that are
  off by a factor of ``sp_size``.

Token definitions, per rank and per micro-batch (the rank's ``[B, N/sp]`` shard as the step receives it):

* ``positions``: ``B * N/sp``, every token the model computes, padding included;
* ``tokens``: the positions that are not padding. Padding is what the batch marks as such with
  ``attention_mask == 0`` (``UlyssesStrategy`` pads the mask too when it aligns ``N`` to ``sp_size``);
  a batch without ``attention_mask`` has no padding by this definition, so the up to ``sp - 1``
  alignment columns the strategy appends then count as tokens;
* ``valid_tokens``: tokens with a target, ``shift_labels != -100`` (what the loss averages over).

Lightning's ``ThroughputMonitor`` counts rank 0's batch and multiplies by the world size: under SP
that counts every sample ``sp_size`` times and assumes balanced shards. Here every rank's own counts
are all-gathered each step (one collective of nine numbers per rank) and summed; the FLOP count adds
an all-gather of the position ids over the SP group (the attention does one per layer).
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from rich import box
from rich.console import Console
from rich.table import Table
from torch import Tensor
from transformers import PreTrainedModel

from lightning_ulysses.attention import gather_sequence
from lightning_ulysses.engines.lightning import plugin_to_compute_dtype
from lightning_ulysses.flops import TransformerFlops, dense_peak_flops
from lightning_ulysses.groups import CollectiveObserver, SequenceParallelGroupLike
from lightning_ulysses.hf import outermost_models, unpatched
from lightning_ulysses.loss import token_cross_entropy
from lightning_ulysses.sequence_parallel import SequenceParallelMixin
from lightning_ulysses.sharding import IGNORE_INDEX

GIB = 2**30

# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _require_ulysses(trainer: L.Trainer, callback: Callback) -> SequenceParallelMixin:
    if not isinstance(trainer.strategy, SequenceParallelMixin):
        raise ValueError(
            f"{type(callback).__name__} reports on sequence-parallel training and needs "
            f"Trainer(strategy=UlyssesStrategy(...)) (or strategy='ulysses', or UlyssesFSDPStrategy); got "
            f"{type(trainer.strategy).__name__}."
        )
    return trainer.strategy


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def available_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of a CUDA device for matrix products in ``dtype`` (fp32: TF32 unless the matmul precision is
    "highest"): the dense figure of :func:`~lightning_ulysses.flops.dense_peak_flops`, which knows "NVIDIA H200",
    else Lightning's table (``None``, with Lightning's warning, for a device that neither knows)."""
    tf32 = torch.get_float32_matmul_precision() != "highest"
    return dense_peak_flops(torch.cuda.get_device_name(device), dtype, tf32) or get_available_flops(device, dtype)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's allocator statistics, or the process's RSS high-water mark on CPU
    (``/proc/self/clear_refs``; where that is not permitted the peak is the process's lifetime peak)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory(device: torch.device) -> tuple[int, int]:
    """Bytes since the last :func:`reset_peak_memory`: CUDA ``(max allocated, max reserved)``;
    on CPU the peak resident set size (``VmHWM``) twice."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
                return peak, peak
    import resource  # POSIX only; reached where /proc is absent (macOS, whose lifetime peak this is)

    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = max_rss if sys.platform == "darwin" else max_rss * 1024  # bytes on macOS, kilobytes elsewhere
    return peak, peak


def shard_token_counts(batch: Mapping[str, Any]) -> tuple[int, int, int]:
    """``(positions, tokens, valid_tokens)`` of one rank's shard (definitions in the module docstring)."""
    input_ids: Tensor = batch["input_ids"]
    mask = batch.get("attention_mask")
    tokens = int(mask.bool().sum()) if isinstance(mask, Tensor) else input_ids.numel()
    return input_ids.numel(), tokens, int((batch["shift_labels"] != IGNORE_INDEX).sum())


class AllToAllTimer:
    """Times the all-to-alls of an SP group (forward and backward) while installed as the ``all_to_all`` of its
    :class:`~lightning_ulysses.groups.CollectiveObserver` (``strategy.groups.observer``).

    Each call is bracketed by device synchronisations, which serialise the step: leave this off
    unless you are measuring.
    """

    def __init__(self, device: torch.device, observer: CollectiveObserver) -> None:
        self.device = device
        self.observer = observer
        self.seconds = 0.0

    def install(self) -> None:
        self.observer.all_to_all = self._timed

    def remove(self) -> None:
        if self.observer.all_to_all == self._timed:
            self.observer.all_to_all = None

    def _timed(self, run: Callable[[], Tensor]) -> Tensor:
        _synchronize(self.device)
        start = time.perf_counter()
        out = run()
        _synchronize(self.device)
        self.seconds += time.perf_counter() - start
        return out


# ------------------------------------------------------------------------------------------------
# SequenceParallelMonitor
# ------------------------------------------------------------------------------------------------
FIELDS = (
    "seconds",
    "samples",
    "positions",
    "tokens",
    "valid_tokens",
    "flops",
    "all_to_all_seconds",
    "peak_memory",
    "peak_reserved",
)
"""Per-rank numbers gathered every step; a gathered step is a ``[world, len(FIELDS)]`` table."""
_COLUMN = {name: i for i, name in enumerate(FIELDS)}
_PEAKS = [_COLUMN["peak_memory"], _COLUMN["peak_reserved"]]


def accumulate(total: Tensor | None, step: Tensor) -> Tensor:
    """Add a gathered step ``[world, F]`` to a running total: counts add up, peaks take the maximum, and
    every rank's seconds become the step's slowest rank (the step lasts until the slowest rank is done)."""
    step = step.clone()
    step[:, _COLUMN["seconds"]] = step[:, _COLUMN["seconds"]].max()
    if total is None:
        return step
    out = total + step
    out[:, _PEAKS] = torch.maximum(total[:, _PEAKS], step[:, _PEAKS])
    return out


def token_imbalance(valid_tokens: Tensor) -> float:
    """``valid_tokens [dp, sp]``: the largest over SP groups of ``max / mean`` over the group's ranks
    (1.0 is balanced; a group without valid tokens counts as balanced)."""
    mean = valid_tokens.mean(dim=1)
    ratio = torch.where(mean > 0, valid_tokens.max(dim=1).values / mean.clamp(min=1e-12), torch.ones_like(mean))
    return float(ratio.max())


def summarize(
    table: Tensor, sp_size: int, *, available_flops: float | None, count_flops: bool, cuda: bool, timed: bool
) -> dict[str, float]:
    """Metrics of a gathered step or of accumulated steps, ``table [world, F]`` (rank order)."""
    column = {name: table[:, i] for name, i in _COLUMN.items()}
    world = table.shape[0]
    seconds = float(column["seconds"].max())
    tokens, positions = float(column["tokens"].sum()), float(column["positions"].sum())
    valid = column["valid_tokens"].view(world // sp_size, sp_size)
    metrics = {
        "tokens_per_sec": tokens / seconds,
        "tokens_per_sec_per_device": tokens / seconds / world,
        "samples_per_sec": float(column["samples"].sum()) / seconds,
        "seq_len": positions / float(column["samples"].sum()),
        "padding_fraction": 1.0 - tokens / positions,
        "tokens": tokens,
        "valid_tokens": float(valid.sum()),
        **{f"valid_tokens_sp_rank_{r}": float(valid[:, r].sum()) for r in range(sp_size)},
        "token_imbalance": token_imbalance(valid),
        "peak_memory_gib": float(column["peak_memory"].max()) / GIB,
    }
    if cuda:
        metrics["peak_reserved_gib"] = float(column["peak_reserved"].max()) / GIB
    if count_flops:
        metrics["flops_per_token"] = float(column["flops"].sum()) / positions
        if cuda:
            device_flops_per_sec = float(column["flops"].mean()) / seconds
            metrics["tflops_per_sec_per_device"] = device_flops_per_sec / 1e12
            if available_flops:
                metrics["mfu"] = device_flops_per_sec / available_flops
    if timed:
        metrics["all_to_all_fraction"] = float(column["all_to_all_seconds"].mean()) / seconds
    return metrics


class SequenceParallelMonitor(Callback):
    """Throughput, memory, token balance and FLOPs of sequence-parallel training.

    Logged through the Trainer's loggers under ``prefix``: per training batch (as often as the Trainer's
    ``log_every_n_steps`` lets through) and, with the suffix ``_epoch``, over each epoch's training batches
    (validation time excluded); tokens/s, token imbalance and peak memory also in the progress bar. All values
    are global (every rank's counts gathered) unless named per device:

    * ``tokens_per_sec`` (``_per_device``), ``samples_per_sec``, ``seq_len`` (padded, whole sequence),
      ``padding_fraction``, ``tokens``, ``valid_tokens`` and ``valid_tokens_sp_rank_{r}`` (summed over
      DP groups);
    * ``token_imbalance``: ``max / mean`` of valid tokens over the ranks of an SP group, worst group;
    * ``peak_memory_gib``: the largest peak over devices (CUDA max allocated, plus ``peak_reserved_gib``;
      CPU peak resident set size);
    * ``flops_per_token`` (:mod:`lightning_ulysses.flops`, when the module holds one transformers model),
      and on CUDA ``tflops_per_sec_per_device`` and ``mfu`` (against the dense peak of
      :func:`~lightning_ulysses.flops.dense_peak_flops`, Lightning's table for devices it does not know);
    * ``all_to_all_fraction`` of step time, with ``time_all_to_all=True`` (synchronises around every
      all-to-all, so it slows training: for measurements only).

    At the end of fit rank 0 prints a summary table of the whole run; :attr:`summary` holds it.

    Args:
        prefix: metric name prefix.
        time_all_to_all: time the all-to-alls (off by default because it synchronises).
    """

    PROGRESS_BAR = ("tokens_per_sec", "token_imbalance", "peak_memory_gib")

    def __init__(self, prefix: str = "sp/", time_all_to_all: bool = False) -> None:
        super().__init__()
        self.prefix = prefix
        self.time_all_to_all = time_all_to_all
        self.summary: dict[str, float] = {}
        self._strategy: SequenceParallelMixin | None = None
        self._flops: TransformerFlops | None = None
        self._available_flops: float | None = None
        self._timer: AllToAllTimer | None = None
        self._mark = 0.0
        self._epoch: Tensor | None = None
        self._fit: Tensor | None = None
        self._first_step = 0  # the global step this fit started at (a resumed fit's checkpoint step)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._strategy = _require_ulysses(trainer, self)
        device = trainer.strategy.root_device
        if device.type == "cuda":
            self._available_flops = available_flops(device, plugin_to_compute_dtype(trainer.precision_plugin))
        self._timer = AllToAllTimer(device, self._strategy.groups.observer) if self.time_all_to_all else None

    @property
    def _metric_options(self) -> dict[str, Any]:
        assert self._strategy is not None  # set by setup('fit'); these hooks run in a fit
        device = self._strategy.root_device
        return dict(
            available_flops=self._available_flops,
            count_flops=self._flops is not None,
            cuda=device.type == "cuda",
            timed=self._timer is not None,
        )

    # -- clocks and the all-to-all timer ---------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        models = outermost_models(pl_module)  # here, not in setup: configure_model may have built them since
        self._flops = TransformerFlops.from_model(models[0]) if len(models) == 1 else None
        if self._flops is None:
            rank_zero_warn(
                f"{type(self).__name__} counts FLOPs for a LightningModule holding exactly one transformers model; "
                f"found {len(models)}, so FLOPs, TFLOP/s and MFU are not logged."
            )
        self._fit = None
        self._first_step = trainer.global_step
        if self._timer is not None:
            self._timer.install()
        # here too: a fit resumed inside an epoch does not call on_train_epoch_start for that epoch
        self._start_epoch()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_epoch()

    def _start_epoch(self) -> None:
        self._epoch = None
        self._restart_clock()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._restart_clock()  # validation time is not training time

    def _restart_clock(self) -> None:
        assert self._strategy is not None  # set by setup('fit'); these hooks run in a fit
        _synchronize(self._strategy.root_device)
        self._mark = time.perf_counter()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self._strategy is not None  # set by setup('fit'); these hooks run in a fit
        reset_peak_memory(self._strategy.root_device)
        if self._timer is not None:
            self._timer.seconds = 0.0

    # -- per step --------------------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = self._strategy
        assert strategy is not None  # set by setup('fit'); these hooks run in a fit
        _synchronize(strategy.root_device)
        now = time.perf_counter()
        seconds, self._mark = now - self._mark, now
        positions, tokens, valid = shard_token_counts(batch)
        flops = 0.0
        if self._flops is not None:
            sharded = strategy.sharded_batch  # this batch, with its whole rows of positions: no all-gather
            assert sharded is not None  # transferred before this hook
            whole = sharded.position_ids
            flops = self._flops.batch_flops(whole) / strategy.sp_size  # heads are split: 1/sp of the group's work
        samples = batch["input_ids"].shape[0] if strategy.sp_rank == 0 else 0  # each SP group counts its samples once
        peak, reserved = peak_memory(strategy.root_device)
        timed = self._timer.seconds if self._timer is not None else 0.0
        row = torch.tensor(
            [seconds, samples, positions, tokens, valid, flops, timed, peak, reserved],
            dtype=torch.float64,
            device=strategy.root_device,
        )
        step = strategy.all_gather(row).view(-1, len(FIELDS)).cpu()  # [world, F]
        self._epoch = accumulate(self._epoch, step)
        self._fit = accumulate(self._fit, step)
        self._log(pl_module, summarize(step, strategy.sp_size, **self._metric_options), per_epoch=False)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._epoch is not None:
            assert self._strategy is not None  # set by setup('fit'); these hooks run in a fit
            metrics = summarize(self._epoch, self._strategy.sp_size, **self._metric_options)
            self._log(pl_module, metrics, per_epoch=True)

    def _log(self, pl_module: L.LightningModule, metrics: dict[str, float], per_epoch: bool) -> None:
        suffix = "_epoch" if per_epoch else ""
        for name, value in metrics.items():
            # the values are already global and equal on every rank; for epoch values Lightning insists on a
            # sync, and the max of equal values keeps them exact
            pl_module.log(
                f"{self.prefix}{name}{suffix}",
                value,
                on_step=not per_epoch,
                on_epoch=per_epoch,
                prog_bar=not per_epoch and name in self.PROGRESS_BAR,
                batch_size=1,
                sync_dist=per_epoch,
                reduce_fx="max",
            )

    # -- end of fit ------------------------------------------------------------------------------
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_timer()
        if self._fit is None:
            return
        assert self._strategy is not None  # set by setup('fit'); these hooks run in a fit
        self.summary = summarize(self._fit, self._strategy.sp_size, **self._metric_options)
        rank_zero_info(format_summary(self.summary, self._strategy, trainer.global_step, self._first_step))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._remove_timer()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._remove_timer()

    def _remove_timer(self) -> None:
        if self._timer is not None:
            self._timer.remove()


def format_summary(metrics: dict[str, float], strategy: SequenceParallelMixin, steps: int, first_step: int = 0) -> str:
    """A run's :func:`summarize` metrics as a two-column table (rendered by ``rich``, as plain text): the optimizer
    steps of this fit, from ``first_step`` (where it resumed) to the global step ``steps``, which its metrics count."""
    table = Table(
        title="Sequence-parallel training summary", title_justify="left", show_header=False, box=box.HORIZONTALS
    )
    table.add_column()
    table.add_column(justify="right")
    table.add_row("world (dp x sp)", f"{strategy.dp_size} x {strategy.sp_size}")
    resumed = f", global steps {first_step} -> {steps}" if first_step else ""
    table.add_row("optimizer steps", f"{steps - first_step}{resumed}")
    if skipped := strategy.nonfinite_loss.skipped_steps:
        table.add_row("skipped (non-finite loss)", f"{len(skipped)}: steps {skipped}")
    for name, value in metrics.items():
        table.add_row(name, f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}")
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(table)
    return "\n".join(line.rstrip() for line in cast(io.StringIO, console.file).getvalue().splitlines())


# ------------------------------------------------------------------------------------------------
# SequenceParallelParityCheck
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParityResult:
    """One check on this rank: the loss training returned and the loss without SP of its group's batch."""

    step: int
    sp_loss: float
    reference_loss: float


class SequenceParallelParityCheck(Callback):
    """Recompute the loss of a global batch without sequence parallelism and compare it with the SP loss.

    On the first training batch of a fit (and, with ``every_n_steps=k``, on the first micro-batch of every
    ``k``-th optimizer step) each rank gathers its SP group's whole sequences, runs the transformers model
    of the LightningModule on them **as plain transformers** (its original attention implementation and the
    masks transformers builds for it, no lightning-ulysses hook; ``no_grad``, the weights of that step) and
    computes the reference: next-token cross entropy averaged over the valid tokens of the group's batch.
    That is the loss :class:`~lightning_ulysses.UlyssesLossMixin` returns on every rank of the group; a
    loss summed over the SP ranks, a dropped window, a per-shard RoPE, any error in the hook differs from it.
    Every rank computes the reference of its own group: under ZeRO-3 DeepSpeed's parameter gathering is
    collective, and the peak memory per device is that of one whole-sequence forward either way.

    Requirements: the LightningModule holds exactly one transformers model, ``training_step`` returns the
    loss computed from ``input_ids`` / ``position_ids`` / ``shift_labels``, and the forward is
    deterministic (dropout 0). Cost: one ``no_grad`` forward of the whole sequence (including its
    ``[B, N, vocab]`` logits) per check; with packed or padded rows transformers also builds a ``[B, N, N]``
    mask for it, so keep the check to the first batch (``every_n_steps=0``) on long packed sequences.

    Args:
        every_n_steps: also check every ``k`` optimizer steps; 0 checks only the first batch.
        rtol, atol: the check passes when ``|sp_loss - reference| <= atol + rtol * |reference|``. ``rtol=None``
            (default) follows the training precision: ``1e-4`` in fp32 (float rounding is ~1e-6; every
            silently wrong model family seen so far is off by more), ``2e-2`` in bf16/fp16 (their rounding).
        on_mismatch: ``"raise"`` (every rank raises the same error) or ``"warn"`` (rank 0 warns, training
            goes on).
    """

    def __init__(
        self,
        every_n_steps: int = 0,
        rtol: float | None = None,
        atol: float = 1e-6,
        on_mismatch: Literal["raise", "warn"] = "raise",
    ) -> None:
        super().__init__()
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0 (0 checks the first batch only), got {every_n_steps}.")
        if on_mismatch not in ("raise", "warn"):
            raise ValueError(f"on_mismatch must be 'raise' or 'warn', got {on_mismatch!r}.")
        if not ((rtol is None or rtol >= 0) and atol >= 0):
            raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}.")
        self.every_n_steps = every_n_steps
        self.requested_rtol = rtol
        self.rtol = rtol
        self.atol = atol
        self.on_mismatch = on_mismatch
        self.results: list[ParityResult] = []
        self._model: PreTrainedModel | None = None
        self._checked = False
        self._pending: tuple[int, Tensor] | None = None  # (step, reference loss) awaiting the SP loss

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _require_ulysses(trainer, self)
        full_precision = str(trainer.precision).startswith(("32", "64"))
        self.rtol = self.requested_rtol if self.requested_rtol is not None else 1e-4 if full_precision else 2e-2

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        models = outermost_models(pl_module)  # here, not in setup: configure_model may have built them since
        if len(models) != 1:
            raise ValueError(
                f"{type(self).__name__} recomputes the loss with the LightningModule's transformers model and needs "
                f"exactly one; {type(pl_module).__name__} holds {len(models)}. Remove the callback for this module."
            )
        self._model = models[0]
        self._checked = False

    def _due(self, trainer: L.Trainer, batch_idx: int) -> bool:
        if not self._checked:
            return True
        k = self.every_n_steps
        return k > 0 and trainer.global_step % k == 0 and batch_idx % trainer.accumulate_grad_batches == 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._due(trainer, batch_idx):  # before the step, so that the weights are those of the SP loss
            self._checked = True
            strategy = cast(SequenceParallelMixin, trainer.strategy)  # setup has required it
            self._pending = (trainer.global_step, self.reference_loss(batch, strategy.groups))

    def reference_loss(self, batch: Mapping[str, Tensor], sp_group: SequenceParallelGroupLike) -> Tensor:
        """The token-mean loss of the SP group's whole sequences without SP (a scalar; collective over ``sp_group``, the
        strategy's groups: the zigzag of a ring undone)."""
        assert self._model is not None  # set by on_train_start
        whole = {key: gather_sequence(batch[key], sp_group) for key in ("input_ids", "position_ids", "shift_labels")}
        with torch.no_grad(), unpatched(self._model):
            # without a KV cache transformers masks packed documents (position ids restarting at 0), as training does
            logits = self._model(
                input_ids=whole["input_ids"], position_ids=whole["position_ids"], use_cache=False
            ).logits
        loss_sum, num_tokens = token_cross_entropy(logits, whole["shift_labels"])
        return loss_sum / num_tokens.clamp(min=1)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._pending is None:
            return
        (step, reference), self._pending = self._pending, None
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, Tensor):
            raise ValueError(
                f"{type(self).__name__} compares the loss that training_step returns, but it returned {outputs!r}. "
                "Return the loss (a tensor, or a dict with a 'loss' entry)."
            )
        if pl_module.automatic_optimization:
            loss = loss * trainer.accumulate_grad_batches  # Lightning hands callbacks the loss / accumulate
        strategy = cast(SequenceParallelMixin, trainer.strategy)  # setup has required it
        assert self.rtol is not None  # set by setup("fit")
        pair = torch.stack([loss.detach().float().reshape(()), reference.float()]).to(strategy.root_device)
        losses = strategy.all_gather(pair).view(-1, 2).cpu()  # [world, 2]: every rank decides on the same numbers
        self.results.append(ParityResult(step, *losses[strategy.global_rank].tolist()))
        if losses_agree(losses, self.rtol, self.atol):
            return
        message = mismatch_message(losses, strategy.sp_size, step, self.rtol, self.atol)
        if self.on_mismatch == "raise":
            raise RuntimeError(message)
        rank_zero_warn(message)


def losses_agree(losses: Tensor, rtol: float, atol: float) -> bool:
    """Whether every row of ``losses [world, 2]`` (SP loss, reference) agrees. NaN with NaN agrees: a batch that is
    non-finite without SP too is for ``UlyssesStrategy(nonfinite_loss=...)`` to handle, not a parity failure."""
    return bool(torch.isclose(losses[:, 0], losses[:, 1], rtol=rtol, atol=atol, equal_nan=True).all())


def mismatch_message(losses: Tensor, sp_size: int, step: int, rtol: float, atol: float) -> str:
    """Explain the worst mismatch of ``losses [world, 2]`` (SP loss, reference) with both numbers."""
    error = (losses[:, 0] - losses[:, 1]).abs() / losses[:, 1].abs().clamp(min=atol or 1e-12)
    rank = int(torch.nan_to_num(error, nan=float("inf")).argmax())
    sp_loss, reference = losses[rank].tolist()
    ratio = sp_loss / reference if reference else float("nan")
    hint = ""
    if abs(ratio - sp_size) < 0.02 * sp_size:
        hint = f" The ratio is sp_size={sp_size}: the loss is summed over the SP ranks or multiplied by sp_size."
    elif abs(ratio * sp_size - 1) < 0.02:
        hint = f" The ratio is 1/sp_size: the loss is divided by sp_size={sp_size} once too often."
    return (
        f"Sequence-parallel loss check failed at step {step}: rank {rank} (sp_rank {rank % sp_size}, dp_rank "
        f"{rank // sp_size}) returned the loss {sp_loss:.6g}, but the same global batch without sequence "
        f"parallelism gives {reference:.6g} (ratio {ratio:.4g}; rtol={rtol}, atol={atol}).{hint} The loss value on "
        "every rank must be the token mean over its SP group's whole sequences: compute it with "
        "UlyssesLossMixin.causal_lm_loss or reduce_token_loss. If your loss is not plain next-token cross entropy, "
        "or the model uses dropout, this check does not apply: remove SequenceParallelParityCheck."
    )
