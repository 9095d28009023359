"""Loading a checkpoint directory under sequence parallelism: which layouts resume, and the one load entry point.

:class:`~lightning_ulysses.UlyssesStrategy` saves DeepSpeed's checkpoint directory (Lightning's
``trainer.save_checkpoint`` / ``ModelCheckpoint``, :mod:`.save`). DeepSpeed is given no SP topology, so ZeRO
partitions parameters and optimizer state over *all* ``dp * sp`` processes and replicates nothing per
SP group. Consequences:

* the ``(sp, dp)`` split is not part of the checkpoint: one saved with ``sp=2 x dp=1`` resumes with
  ``sp=1 x dp=2`` (keep ``dp * micro_batch_size`` to keep the global batch);
* the process count and the ZeRO stage are: DeepSpeed cannot re-partition a checkpoint as saved.
  :func:`check_resumable` refuses such a resume before anything is loaded, and says how to convert it.

A checkpoint converted by :func:`~.convert.convert_checkpoint` (DeepSpeed's *universal* format) resumes on any
process count, ``sp x dp`` split and ZeRO stage through DeepSpeed's universal loader: weights, optimizer state and
step counters exactly. Under ZeRO-3 that loader (DeepSpeed 0.19) restores Adam's state only (``exp_avg``,
``exp_avg_sq``, ``step``); other checkpoints resume under ZeRO 1/2, and :func:`check_resumable` says so before
loading. What it gets wrong with several param groups, :func:`repair_zero3_universal_load` puts right after the load;
what it skips (frozen parameters, buffers), :func:`load_untrained_state` restores.

:func:`load_checkpoint` is what ``UlyssesStrategy.load_checkpoint`` runs for a checkpoint directory: all of the above,
in order, around DeepSpeed's load. Resuming then reproduces the uninterrupted run, also from a checkpoint saved inside
an epoch: the strategy makes the training loader resumable (:mod:`.resume`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_ulysses.engines import deepspeed as deepspeed_engine
from lightning_ulysses.runtime.directory import (
    UNTRAINED_STATE_FILE,
    is_universal_checkpoint,
    pointer_of,
    saved_layout,
    tag_dir,
)
from lightning_ulysses.runtime.integrity import check_integrity

# the optimizer state names DeepSpeed 0.19's ZeRO-3 universal loader restores (stage3.py, "for key in [...]")
_ZERO3_UNIVERSAL_STATE = {"fp32", "exp_avg", "exp_avg_sq", "step"}


def load_checkpoint(
    engine: Any, checkpoint_dir: str | Path, num_processes: int, zero_stage: int, *, fitting: bool, strict: bool = True
) -> dict[str, Any]:
    """Restore DeepSpeed ``engine`` from ``checkpoint_dir`` and return Lightning's part of the checkpoint.

    Refuses, before anything is loaded, a damaged directory (:func:`~.integrity.check_integrity`), a layout it
    cannot be restored on (:func:`check_resumable`) and a converted checkpoint outside ``fit``; loads the optimizer
    state only when ``fitting``, the module's weights ``strict``-ly (the LightningModule's ``strict_loading``).
    A collective: every rank calls it.

    Args:
        engine: the DeepSpeed engine, set up for this run.
        checkpoint_dir: a directory that ``UlyssesStrategy`` saved, or that :func:`~.convert.convert_checkpoint` wrote.
        num_processes: the processes of this run (``dp * sp``).
        zero_stage: this run's ZeRO stage.
        fitting: whether the checkpoint resumes ``trainer.fit`` (else it is evaluated from: weights only).
        strict: whether every weight of the module must be in the checkpoint and vice versa.
    """
    universal = is_universal_checkpoint(checkpoint_dir)
    check_integrity(checkpoint_dir, pointer_of(checkpoint_dir))
    check_resumable(checkpoint_dir, num_processes, zero_stage)
    if universal and not fitting:
        raise ValueError(
            f"{checkpoint_dir} is a converted (universal) checkpoint, which DeepSpeed loads only to resume "
            "trainer.fit. Evaluate from the checkpoint as saved (on its own process count and ZeRO stage) or "
            "from its weights (export_hf_model)."
        )
    deepspeed_engine.set_load_universal_checkpoint(engine, universal)
    # as DeepSpeedStrategy loads, without its check for a tag folder named "checkpoint" (ours are checkpoint-<id>)
    _, checkpoint = engine.load_checkpoint(
        checkpoint_dir,
        load_optimizer_states=fitting,
        load_lr_scheduler_states=False,
        load_module_strict=strict,
    )
    if universal:
        load_untrained_state(engine.module, checkpoint_dir)
        if engine.zero_optimization_stage() == 3:
            repair_zero3_universal_load(engine.optimizer, checkpoint_dir)
    return checkpoint


def check_resumable(checkpoint_dir: str | Path, num_processes: int, zero_stage: int) -> None:
    """Raise before any state is loaded if ``checkpoint_dir`` cannot be restored exactly on this layout.

    A checkpoint as saved resumes on its own process count and ZeRO stage (any ``sp x dp`` split); a
    converted (universal) one on any layout, except optimizer state that DeepSpeed's ZeRO-3 loader cannot
    restore (see the module docstring).
    """
    if is_universal_checkpoint(checkpoint_dir):
        if zero_stage == 3:
            _check_zero3_universal(Path(checkpoint_dir))
        return
    saved_processes, saved_stage = saved_layout(checkpoint_dir)
    if (saved_processes, saved_stage) == (num_processes, zero_stage):
        return
    converted = f"{str(checkpoint_dir).rstrip('/')}-universal"
    raise ValueError(
        f"The checkpoint {checkpoint_dir} was saved by {saved_processes} processes under ZeRO stage {saved_stage}; "
        f"this run has {num_processes} processes under ZeRO stage {zero_stage}. DeepSpeed partitions the weights and "
        f"optimizer state over every process, so as saved it resumes only with {saved_processes} processes and "
        f"stage={saved_stage} (any sp_size x dp_size split). To resume on this layout with the optimizer state and "
        "loop progress, convert it once (offline, one process) and resume from the converted directory: "
        f"lightning-ulysses convert-checkpoint {checkpoint_dir} {converted} "
        "(or lightning_ulysses.runtime.convert_checkpoint), "
        f"then ckpt_path={converted!r}."
    )


def _check_zero3_universal(checkpoint_dir: Path) -> None:
    saved_states = {file.stem for file in (tag_dir(checkpoint_dir) / "zero").glob("*/*.pt")}
    if saved_states == _ZERO3_UNIVERSAL_STATE:
        return
    raise ValueError(
        f"The converted checkpoint {checkpoint_dir} holds optimizer state {sorted(saved_states - {'fp32'})}. "
        "DeepSpeed's ZeRO-3 universal loader restores only Adam's exp_avg, exp_avg_sq and step "
        "(deepspeedai/DeepSpeed#8608), so ZeRO-3 would not resume it exactly. Resume it under ZeRO stage 1 or 2 "
        "(any process count)."
    )


def repair_zero3_universal_load(optimizer: Any, checkpoint_dir: str | Path) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal loader (0.19) with several param groups.

    * It copies the first group's hyperparameters into every group, which would, e.g., decay the norms and
      biases of the usual no-weight-decay group: each group gets its saved ones back.
    * It gives every group's state one shared ``step`` tensor, which torch's Adam increments in place once per
      group and step, so the bias correction would run ahead: each group gets its own copy.
    """
    for state in optimizer.optimizer.state.values():
        if isinstance(state.get("step"), Tensor):
            state["step"] = state["step"].clone()
    path = tag_dir(checkpoint_dir) / "zero" / "optimizer_state.pt"
    saved = torch.load(path, map_location="cpu", weights_only=False)["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"{checkpoint_dir} holds {len(saved)} optimizer param groups, this run's optimizer has "
            f"{len(optimizer.param_groups)}: configure_optimizers must build the groups of the run that saved it."
        )
    for group, saved_group in zip(optimizer.param_groups, saved, strict=True):
        group.update({key: value for key, value in saved_group.items() if key != "params"})


def load_untrained_state(module: torch.nn.Module, checkpoint_dir: str | Path) -> None:
    """Copy the frozen parameters and persistent buffers that :func:`~.convert.convert_checkpoint` kept into
    ``module`` (the module DeepSpeed's engine wraps), on every rank alike; DeepSpeed's universal loader skips them."""
    import deepspeed

    file = tag_dir(checkpoint_dir) / UNTRAINED_STATE_FILE
    if not file.is_file():
        return
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    # mmap: every rank of a node reads the same pages instead of holding its own copy (a LoRA base is the whole
    # model); weights_only: the file holds tensors only, and nothing else may run when it is read
    for name, value in torch.load(file, map_location="cpu", mmap=True, weights_only=True).items():
        tensor = tensors[name]
        # a ZeRO-3 partitioned parameter is gathered, set on every rank, and partitioned again
        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0, enabled=hasattr(tensor, "ds_id")):
            tensor.data.copy_(value)
