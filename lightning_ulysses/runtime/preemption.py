"""Preemption and Ctrl-C: SIGTERM, SLURM's requeue signal and SIGINT end a run with a checkpoint that all ranks
save at one safe point.

Lightning acts inside the signal handler of the rank that got the signal: its SLURM handler (``SIGUSR1`` with
``SLURMEnvironment(auto_requeue=True)``) saves a checkpoint there, and its SIGTERM handler broadcasts a flag.
Both are collectives that each rank starts at a different point of its step, possibly while its peers are
inside an all-to-all or a ZeRO gather: under NCCL a deadlock until the timeout, under gloo a mismatch. The
checkpoint, taken in the middle of a step, also held the wrong loop state (see :mod:`.resume`).

:class:`PreemptionSignals` replaces the Trainer's signal connector. Its handlers only record the signal (and,
for SIGTERM, forward it to the processes Lightning launched, as Lightning does). The decision is taken by
:meth:`PreemptionSignals.at_step_boundary`, which the strategy runs on every rank before the first
micro-batch of each optimizer step: a point that every rank reaches in the same order, outside any
collective. There one ``all_reduce`` of a ``[world_size, 3]`` flag table makes the ranks agree; if any rank got
a signal, they all save the checkpoint that Lightning resumes from on SLURM (``hpc_ckpt_N.ckpt`` in
``default_root_dir``, the newest one replaced atomically), rank 0 requeues the SLURM job for ``SIGUSR1`` (as
Lightning does), and every rank leaves ``fit`` with Lightning's ``SIGTERMException`` (exit status 0) before
training another batch. Nothing of the run is lost: the checkpoint holds every completed optimizer step.

Ctrl-C (SIGINT, which a terminal sends to every process of the job) is handled the same way during ``fit``: the
ranks agree at the next step boundary, save ``interrupted.ckpt`` in the run's checkpoint folder, rank 0 says where
and prints the command that resumes it, and the run stops as Lightning stops on Ctrl-C (exit status 1). A second
Ctrl-C before that point interrupts at once, as without this handler.

Outside ``fit`` there is nothing to save: SIGTERM stops the rank at its next batch, as Lightning does, minus the
broadcast (its peers then fail in their next collective), and Ctrl-C interrupts at once.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_info

from lightning_ulysses.engines.lightning import SignalConnector, hpc_checkpoint_path
from lightning_ulysses.runtime.failures import flagged_ranks

log = logging.getLogger(__name__)

_REQUEUE, _STOP, _INTERRUPT = 0, 1, 2  # the columns of the flag table: SLURM's requeue signal, SIGTERM, SIGINT
INTERRUPTED_CHECKPOINT = "interrupted.ckpt"


class PreemptionSignals(SignalConnector):
    """The Trainer's signal connector, with handlers that only record the signal (see the module docstring).

    Lightning registers the handlers as it does its own: SIGTERM always, ``SIGUSR1`` (the environment's
    ``requeue_signal``) under ``SLURMEnvironment(auto_requeue=True)``; SIGINT is added here.
    """

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        self.signalled = [False, False, False]  # [requeue, stop, interrupt] on this rank since the handlers registered

    def register_signal_handlers(self) -> None:
        self.signalled = [False, False, False]
        super().register_signal_handlers()
        self._register_signal(signal.SIGINT, self._sigint_handler_fn)

    def _sigint_handler_fn(self, signum: Any, _: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts at once
        if self.trainer.state.fn != TrainerFn.FITTING:
            raise KeyboardInterrupt
        self.signalled[_INTERRUPT] = True
        rank_zero_info("Ctrl-C: saving a checkpoint before the next training step (Ctrl-C again to stop at once) ...")

    def _slurm_sigusr_handler_fn(self, signum: Any, _: FrameType | None) -> None:
        self.signalled[_REQUEUE] = True

    def _sigterm_notifier_fn(self, signum: Any, _: FrameType | None) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.local_rank))
        launcher = self.trainer.strategy.launcher
        if not self.signalled[_STOP] and launcher is not None:
            launcher.kill(signum)  # the processes Lightning started itself get it too
        self.signalled[_STOP] = True
        if self.trainer.state.fn != TrainerFn.FITTING:
            self.received_sigterm = True  # Lightning's evaluation and prediction loops stop at their next batch

    def at_step_boundary(self, trainer: Any) -> None:
        """Run on every rank before the first micro-batch of each optimizer step (a collective): if any rank got
        a signal, save the preemption checkpoint on all ranks, requeue on SLURM, and raise ``SIGTERMException``
        (Ctrl-C alone: save ``interrupted.ckpt`` and raise ``KeyboardInterrupt``)."""
        ranks = flagged_ranks(torch.tensor(self.signalled), trainer.strategy.root_device)
        requeue_ranks, stop_ranks, interrupt_ranks = (ranks[column] for column in (_REQUEUE, _STOP, _INTERRUPT))
        if not (requeue_ranks or stop_ranks or interrupt_ranks):
            return
        if interrupt_ranks and not (requeue_ranks or stop_ranks):
            self._save_and_interrupt(trainer)
        path = preemption_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        signals = ", ".join(
            f"{name} on ranks {ranks}"
            for name, ranks in (("the requeue signal", requeue_ranks), ("SIGTERM", stop_ranks))
            if ranks
        )
        rank_zero_info(
            f"Preempted ({signals}): saved {path} at global step {trainer.global_step}, before its next "
            f"batch; resume with ckpt_path={path!r} (on SLURM, Lightning resumes it by itself)."
        )
        if requeue_ranks and trainer.is_global_zero:
            requeue_slurm_job()
        raise SIGTERMException

    @staticmethod
    def _save_and_interrupt(trainer: Any) -> None:
        """Ctrl-C: save ``interrupted.ckpt`` where the run keeps its checkpoints, say how to resume, and stop."""
        callback = trainer.checkpoint_callback
        folder = Path(callback.dirpath) if callback is not None and callback.dirpath else Path(trainer.default_root_dir)
        path = folder / INTERRUPTED_CHECKPOINT
        config = Path(trainer.log_dir or ".") / "config.yaml"  # log_dir: a collective, on every rank
        trainer.save_checkpoint(path)
        resume = (
            f"lightning-ulysses fit --config {config} --ckpt_path {path}"
            if config.is_file()
            else f"ckpt_path={str(path)!r}"
        )
        rank_zero_info(
            f"Interrupted (Ctrl-C): saved {path} at global step {trainer.global_step}, before its next "
            f"batch. Resume with: {resume}"
        )
        raise KeyboardInterrupt


def preemption_checkpoint_path(trainer: Any) -> str:
    """Where preemption saves: the newest ``hpc_ckpt_N.ckpt`` of ``default_root_dir`` (replaced atomically), else
    ``hpc_ckpt_1.ckpt``; Lightning resumes the newest one when the SLURM job starts again."""
    return hpc_checkpoint_path(trainer)


def requeue_slurm_job() -> None:
    """``scontrol requeue`` this SLURM job (array task), as Lightning's requeue handler does."""
    array_job_id = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job_id else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job_id):
        raise ValueError(f"Not a SLURM job id: {job_id!r}")
    result = subprocess.call(["scontrol", "requeue", job_id])
    if result == 0:
        log.info(f"Requeued SLURM job {job_id}")
    else:
        log.warning(f"Requeuing SLURM job {job_id} failed with exit status {result}")
