"""Failing loudly and together: checks that every rank runs, so that all ranks act at the same step.

A rank that stops alone leaves the others blocked in their next collective until the process-group
timeout (``UlyssesStrategy(timeout=...)``, which also bounds the SP and DP subgroups' collectives).
A non-finite loss on one rank would otherwise spread NaN weights to every rank through the gradient
reduction without a word. :class:`NonFiniteLossGuard` checks every training loss on every rank and,
as ``UlyssesStrategy(nonfinite_loss=...)`` says, raises the same error on every rank (``"raise"``) or
warns and skips the optimizer step (``"skip"``).

A rank that dies without a Python error (``kill -9``, the out-of-memory killer) leaves its peers with a bare
"Connection reset by peer" (gloo) or a timeout (NCCL) that names no rank. :class:`Heartbeat` keeps a counter
per rank in the job's rendezvous store, bumped by a background thread; after a collective fails, the
survivors read which counters stopped (:meth:`Heartbeat.dead_ranks_report`) and say so.

How a step is skipped: the NaN/inf of the loss reaches every gradient partition through the backward and
the gradient reduction, and DeepSpeed's ZeRO optimizers (stages 1-3, every precision with its default
``check_grad_overflow``) discard a step whose global gradient norm is not finite: no weight or optimizer-state
update, gradients cleared (``engine.was_step_applied()`` is False). The guard relies on that, and checks it
after every optimizer step: were a flagged step applied anyway, it raises rather than train on. With
gradient accumulation the whole optimizer step (all its micro-batches) is skipped. Lightning still counts a
skipped step: in ``global_step`` and in its LR schedulers, which it steps itself (as it does for the steps
that AMP's gradient scaler skips).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_ulysses.engines import deepspeed as deepspeed_engine

NonFiniteLoss = Literal["raise", "skip", "off"]
MAX_CONSECUTIVE_SKIPS = 10
"""Under ``"skip"``, this many skipped steps in a row end the run: it has diverged; skipping is for rare bad batches."""


def flagged_ranks(flags: Tensor, device: torch.device) -> list[list[int]]:
    """For each of this rank's ``flags`` (``[F]`` bool), the global ranks that raised it, agreed by one all-reduce of
    a ``[world_size, F]`` table (a collective: every rank calls it with as many flags)."""
    table = torch.zeros(dist.get_world_size(), len(flags), dtype=torch.int32, device=device)
    table[dist.get_rank()] = flags
    dist.all_reduce(table)
    return [table[:, column].nonzero().flatten().tolist() for column in range(len(flags))]


def nonfinite_ranks(loss: Tensor) -> list[int]:
    """The global ranks whose ``loss`` has a NaN or inf (a collective: every rank must call it)."""
    return flagged_ranks((~torch.isfinite(loss.detach())).any().reshape(1), loss.device)[0]


class NonFiniteLossGuard:
    """Checks the training loss of every micro-batch on every rank; raises or skips the step on NaN/inf.

    Args:
        mode: ``"raise"``: the same :class:`FloatingPointError` on every rank, before the optimizer step.
            ``"skip"``: a warning naming the step and the ranks, and the optimizer step is skipped.
            ``"off"``: no check (no collective per step).
        max_consecutive_skips: under ``"skip"``, raise once this many optimizer steps in a row were skipped.
    """

    def __init__(self, mode: NonFiniteLoss, max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS) -> None:
        if mode not in ("raise", "skip", "off"):
            raise ValueError(f"nonfinite_loss must be 'raise', 'skip' or 'off', got {mode!r}.")
        self.mode = mode
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps: list[int] = []  # global steps skipped for a non-finite loss
        self._consecutive_skips = 0
        self._flagged: str | None = None  # the non-finite micro-batch(es) of the optimizer step in progress
        self._report_gradient_skips = True  # fp16 loss scaling skips steps as a matter of course: not worth a warning

    def setup(self, engine: Any) -> None:
        """Refuse ``"skip"`` where DeepSpeed would apply a step with non-finite gradients (before any training)."""
        self._report_gradient_skips = not engine.fp16_enabled()
        if self.mode != "skip":
            return
        stage = engine.zero_optimization_stage()
        if stage == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled()):
            raise ValueError(
                "nonfinite_loss='skip' relies on DeepSpeed discarding steps with a non-finite gradient norm, which its "
                "ZeRO stage 0 does not do in fp32. Use stage=1, 2 or 3, or nonfinite_loss='raise'."
            )
        if engine.bfloat16_enabled() and stage in (1, 2) and not deepspeed_engine.checks_bf16_gradient_overflow(engine):
            raise ValueError(
                "nonfinite_loss='skip' needs DeepSpeed to check bf16 gradients for overflow: remove "
                "bf16.check_grad_overflow=false from the DeepSpeed config, or set nonfinite_loss='raise'."
            )

    def check_loss(self, loss: Tensor, global_step: int, batch_idx: int) -> None:
        """Run on every rank after each training step (a collective unless the mode is ``"off"``)."""
        if self.mode == "off":
            return
        ranks = nonfinite_ranks(loss)
        if not ranks:
            return
        where = f"global step {global_step} (batch {batch_idx} of the epoch) on ranks {ranks}"
        if self.mode == "raise":
            raise FloatingPointError(
                f"Non-finite training loss at {where}. Every rank stops here, before the optimizer step would spread "
                "it to the weights. Look for overflow (lower the learning rate, clip gradients, use bf16 instead of "
                "fp16) or bad samples in that batch; UlyssesStrategy(nonfinite_loss='skip') skips such steps instead."
            )
        self._flagged = where if self._flagged is None else f"{self._flagged}; {where}"

    def check_step(self, step_applied: bool, global_step: int) -> None:
        """Run on every rank after each optimizer step, with DeepSpeed's ``engine.was_step_applied()``."""
        flagged, self._flagged = self._flagged, None
        self._consecutive_skips = 0 if step_applied else self._consecutive_skips + 1
        if flagged is None:
            if not step_applied and self._report_gradient_skips:  # finite loss, yet non-finite gradients
                rank_zero_warn(f"DeepSpeed skipped global step {global_step}: its gradient norm was not finite.")
            return
        if step_applied:
            raise FloatingPointError(
                f"Non-finite training loss at {flagged}, and DeepSpeed applied the step anyway (its gradient norm "
                "was finite, or its overflow check is off), so the weights may be wrong from here on. "
                "Set nonfinite_loss='raise' to stop at such a step."
            )
        self.skipped_steps.append(global_step)
        if self._consecutive_skips >= self.max_consecutive_skips:
            raise FloatingPointError(
                f"Non-finite training loss at {flagged}, and {self._consecutive_skips} optimizer steps in a row "
                "skipped: training has diverged rather than met a bad batch. Resume from an earlier checkpoint with a "
                "lower learning rate or gradient clipping, or check the data from here on."
            )
        rank_zero_warn(f"Skipped global step {global_step}: non-finite training loss at {flagged}.")


class Heartbeat:
    """A daemon thread that bumps this rank's counter in the rendezvous ``store`` every ``period`` seconds.

    Keys: ``lightning_ulysses/heartbeat/<rank>`` (the counter, read with ``store.add(key, 0)``, which never waits for a
    key) and ``lightning_ulysses/left/<rank>``, set by :meth:`stop` when the rank leaves in order (its run ended, or
    its own error is on its way out), so that only ranks that vanished are reported dead. The thread ends quietly
    when the store stops answering (the process hosting it is gone).
    """

    def __init__(self, store: Any, rank: int, world_size: int, period: float = 1.0) -> None:
        self.store, self.rank, self.world_size, self.period = store, rank, world_size, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="lightning-ulysses-heartbeat", daemon=True)

    @staticmethod
    def key(rank: int) -> str:
        return f"lightning_ulysses/heartbeat/{rank}"

    @staticmethod
    def left_key(rank: int) -> str:
        return f"lightning_ulysses/left/{rank}"

    def start(self) -> None:
        self.store.delete_key(self.left_key(self.rank))  # left by an earlier run of this process
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        # whatever the store's client raises: the store is gone with its host, and nobody is left to ask
        with contextlib.suppress(Exception):
            self.store.set(self.left_key(self.rank), "1")

    def _beat(self) -> None:
        try:
            while True:
                self.store.add(self.key(self.rank), 1)
                if self._stop.wait(self.period):
                    return
        except Exception:  # noqa: BLE001 - the store is gone: dead_ranks_report says so on this rank's failure
            return

    def silent_ranks(self) -> list[int]:
        """The other ranks whose counter did not move for 2.5 periods (blocks that long) and that did not leave in
        order. Raises if the store does not answer."""
        before = [self.store.add(self.key(rank), 0) for rank in range(self.world_size)]
        time.sleep(2.5 * self.period)
        after = [self.store.add(self.key(rank), 0) for rank in range(self.world_size)]
        return [
            rank
            for rank in range(self.world_size)
            if rank != self.rank and after[rank] == before[rank] and not self.store.check([self.left_key(rank)])
        ]

    def dead_ranks_report(self) -> str | None:
        """A sentence naming the ranks that vanished, for an error that a collective raised; None if none did."""
        try:
            silent = self.silent_ranks()
        except Exception as error:  # noqa: BLE001 - any failure of the store is the report (named in it)
            return (
                f"the job's rendezvous store stopped answering ({type(error).__name__}: {error}): the process that "
                "hosts it (rank 0, unless torchrun hosts it) has exited or died; see its log"
            )
        if not silent:
            return None
        return (
            f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped: no heartbeat for "
            f"{2.5 * self.period:g} s, so the process died without a Python error (killed, e.g. by kill -9 or the "
            "out-of-memory killer, or crashed); see its log and the system's (dmesg)"
        )
