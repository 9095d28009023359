"""Preemption: SIGTERM and SLURM's requeue signal end a run with a checkpoint that all ranks save at one safe point.

Lightning acts inside the signal handler of the rank that got the signal: its SLURM handler (``SIGUSR1`` with
``SLURMEnvironment(auto_requeue=True)``) saves a checkpoint there, and its SIGTERM handler broadcasts a flag.
Both are collectives that each rank starts at a different point of its step, possibly while its peers are
inside an all-to-all or a ZeRO gather: under NCCL a deadlock until the timeout, under gloo a mismatch. The
checkpoint, taken in the middle of a step, also held the wrong loop state (see :mod:`lightning_ulysses.resume`).

:class:`PreemptionSignals` replaces the Trainer's signal connector. Its handlers only record the signal (and,
for SIGTERM, forward it to the processes Lightning launched, as Lightning does). The decision is taken by
:meth:`PreemptionSignals.at_step_boundary`, which the strategy runs on every rank before the first
micro-batch of each optimizer step: a point that every rank reaches in the same order, outside any
collective. There one ``all_reduce`` of a ``[world_size, 2]`` flag table makes the ranks agree; if any rank got
a signal, they all save the checkpoint that Lightning resumes from on SLURM (``hpc_ckpt_N.ckpt`` in
``default_root_dir``, the newest one replaced atomically), rank 0 requeues the SLURM job for ``SIGUSR1`` (as
Lightning does), and every rank leaves ``fit`` with Lightning's ``SIGTERMException`` (exit status 0) before
training another batch. Nothing of the run is lost: the checkpoint holds every completed optimizer step.

Outside ``fit`` there is nothing to save: SIGTERM stops the rank at its next batch, as Lightning does, minus the
broadcast (its peers then fail in their next collective).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_info

log = logging.getLogger(__name__)

_REQUEUE, _STOP = 0, 1  # the columns of the flag table: SLURM's requeue signal, SIGTERM


class PreemptionSignals(_SignalConnector):
    """The Trainer's signal connector, with handlers that only record the signal (see the module docstring).

    Lightning registers the handlers as it does its own: SIGTERM always, ``SIGUSR1`` (the environment's
    ``requeue_signal``) under ``SLURMEnvironment(auto_requeue=True)``.
    """

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        self.signalled = [False, False]  # [requeue, stop] on this rank since the handlers were registered

    def register_signal_handlers(self) -> None:
        self.signalled = [False, False]
        super().register_signal_handlers()

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
        a signal, save the preemption checkpoint on all ranks, requeue on SLURM, and raise ``SIGTERMException``."""
        flags = torch.zeros(trainer.world_size, 2, dtype=torch.int32, device=trainer.strategy.root_device)
        flags[trainer.global_rank] = torch.tensor(self.signalled, dtype=torch.int32)
        dist.all_reduce(flags)
        requeue_ranks, stop_ranks = (flags[:, column].nonzero().flatten().tolist() for column in (_REQUEUE, _STOP))
        if not (requeue_ranks or stop_ranks):
            return
        path = preemption_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        signals = ", ".join(f"{name} on ranks {ranks}" for name, ranks in
                            (("the requeue signal", requeue_ranks), ("SIGTERM", stop_ranks)) if ranks)
        rank_zero_info(f"Preempted ({signals}): saved {path} at global step {trainer.global_step}, before its next "
                       f"batch; resume with ckpt_path={path!r} (on SLURM, Lightning resumes it by itself).")
        if requeue_ranks and trainer.is_global_zero:
            requeue_slurm_job()
        raise SIGTERMException


def preemption_checkpoint_path(trainer: Any) -> str:
    """Where preemption saves: the newest ``hpc_ckpt_N.ckpt`` of ``default_root_dir`` (replaced atomically), else
    ``hpc_ckpt_1.ckpt``; Lightning resumes the newest one when the SLURM job starts again."""
    connector = trainer._checkpoint_connector
    return connector._hpc_resume_path or connector.hpc_save_path(trainer.default_root_dir)


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

