"""Lightning's private names that lightning-ulysses uses, each with the reason (see :mod:`lightning_ulysses.engines`).

Private classes and functions used as they are are re-exported here under a public name, with the reason:

* ``SignalConnector`` (``_SignalConnector``): :class:`~lightning_ulysses.runtime.preemption.PreemptionSignals` extends
  the Trainer's signal handler to save at a step boundary that all ranks agree on;
* ``DatasetSamplerWrapper`` (``_DatasetSamplerWrapper``): what Lightning's ``DistributedSamplerWrapper`` wraps a
  user's sampler in; the even evaluation batches rebuild the wrapper over the DP ranks;
* ``IndexBatchSamplerWrapper`` (``_IndexBatchSamplerWrapper``): Lightning wraps a prediction loader's batch sampler in
  it; the SP loader checks and the even evaluation batches look through it to the user's sampler;
* ``StrategyRegistryType`` (``_StrategyRegistry``): the type of ``register_strategies``' argument, Lightning's hook for
  strategy names;
* ``format_summary_table`` (``_format_summary_table``): the CLI's model summary prints Lightning's own table;
* ``plugin_to_compute_dtype`` (``_plugin_to_compute_dtype``): the compute dtype of a precision plugin, for the peak
  FLOP/s the monitor divides by, as Lightning's ``ThroughputMonitor`` reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies import _StrategyRegistry as StrategyRegistryType
from lightning.fabric.utilities.data import _auto_add_worker_init_fn
from lightning.fabric.utilities.distributed import _DatasetSamplerWrapper as DatasetSamplerWrapper
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype as plugin_to_compute_dtype
from lightning.pytorch.loops import _FitLoop
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper as IndexBatchSamplerWrapper
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector as SignalConnector
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table as format_summary_table
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer


def model_parallel_setup_distributed(strategy: ModelParallelStrategy) -> None:
    """The process group of ``ModelParallelStrategy`` (device, world ranks, ``init_process_group`` with its timeout),
    without the ``[data_parallel, tensor_parallel]`` mesh that its ``setup_environment`` builds next: the Ulysses
    strategy builds its own ``[dp, sp]`` mesh. Lightning has no public hook between the two."""
    strategy._setup_distributed()


def process_group_timeout(strategy: DDPStrategy | ModelParallelStrategy) -> timedelta | None:
    """The ``timeout`` argument of a DDP-family strategy (``DDPStrategy``, ``DeepSpeedStrategy``,
    ``ModelParallelStrategy``), which they keep only as ``_timeout``: the strategies' own groups get it too."""
    return strategy._timeout


def set_module_device_mesh(module: LightningModule, mesh: DeviceMesh) -> None:
    """``LightningModule.device_mesh`` reads ``_device_mesh``, which only ``ModelParallelStrategy.setup_environment``
    sets (there is no setter)."""
    module._device_mesh = mesh


def materialize_meta_module(module: nn.Module, device: torch.device) -> None:
    """Materialise the parameters a ``Trainer.init_module(empty_init=True)`` left on the meta device, as
    ``ModelParallelStrategy.setup`` does (the Ulysses strategy runs its own set-up, which needs no
    ``configure_model``)."""
    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Iterable[Optimizer], device: torch.device) -> None:
    """Move optimizer state (a resumed one's included) to the device, as ``ModelParallelStrategy.setup`` does."""
    _optimizers_to_device(optimizers, device)


def signal_connector(trainer: Trainer) -> Any:
    """The Trainer's signal handler (``Trainer._signal_connector``): after set-up the strategies'
    :class:`~lightning_ulysses.runtime.preemption.PreemptionSignals`, told at each step boundary that it may save."""
    return trainer._signal_connector


def replace_signal_connector(trainer: Trainer, connector: SignalConnector) -> None:
    """Install ``connector`` as the Trainer's signal handler: Lightning saves on SIGTERM / SLURM's requeue signal
    wherever the signal lands, and has no option for a handler that waits for a point that all ranks agree on."""
    trainer._signal_connector = connector


def should_accumulate(fit_loop: _FitLoop) -> bool:
    """Whether the running micro-batch does not end an optimizer step (``_TrainingEpochLoop._should_accumulate``, the
    loop's own rule, the epoch's last batch included), which DeepSpeed's engine must know before the forward."""
    return fit_loop.epoch_loop._should_accumulate()


def set_logged_batch_size(trainer: Trainer, batch_size: int) -> None:
    """The weight of the running evaluation batch in the epoch means of ``self.log`` (``trainer._results.batch_size``,
    which Lightning takes from the batch's length): the rows the sampler repeated weigh 0."""
    results = trainer._results
    if results is not None:
        results.batch_size = batch_size


def add_worker_init_fn(dataloader: object, rank: int) -> None:
    """Lightning's ``seed_everything(workers=True)`` worker seeding, by ``rank`` (the DP rank: the SP ranks of a group
    must draw the same augmentations); Lightning's own call seeds by global rank."""
    _auto_add_worker_init_fn(dataloader, rank)


def inside_index_batch_sampler(batch_sampler: Any) -> Any:
    """The batch sampler inside Lightning's prediction index-recording wrapper (``_IndexBatchSamplerWrapper`` keeps it
    as ``_batch_sampler``, with no public accessor), whose ``sampler`` the SP loader checks and replaces; any other
    batch sampler as it is."""
    return batch_sampler._batch_sampler if isinstance(batch_sampler, IndexBatchSamplerWrapper) else batch_sampler


def wrapped_sampler(dataset: DatasetSamplerWrapper) -> Any:
    """The user's sampler that Lightning's ``DistributedSamplerWrapper`` wraps (its dataset, a
    ``_DatasetSamplerWrapper``, keeps it as ``_sampler``, with no public accessor): the even evaluation batches wrap it
    again, padded over the DP ranks."""
    return dataset._sampler


def attached_trainer(module: object) -> Trainer | None:
    """The Trainer ``module`` is attached to, None where there is none (``LightningModule.trainer`` raises then; its
    ``_trainer`` is what it reads), or where ``module`` is no LightningModule."""
    return getattr(module, "_trainer", None)


def drop_summary_rows(summary: ModelSummary, drop: Callable[[nn.Module], bool]) -> None:
    """Leave out of Lightning's model summary the rows of the modules that ``drop`` picks: the summary keeps its rows
    in ``_layer_summary`` (name -> ``LayerSummary``, whose module is ``_module``), with no public way to filter them
    (``ModelSummary._summary``, the callback's private hook, is where a subclass gets the summary)."""
    for name in [name for name, layer in summary._layer_summary.items() if drop(layer._module)]:
        del summary._layer_summary[name]


def default_store() -> dist.Store:
    """The default process group's key-value store (torch's ``distributed_c10d._get_default_store``), where the
    heartbeat of each rank is kept: every launcher's rendezvous already made it."""
    return dist.distributed_c10d._get_default_store()


def hpc_checkpoint_path(trainer: Trainer) -> str:
    """Where Lightning's SLURM handling saves and resumes: the newest ``hpc_ckpt_N.ckpt`` of ``default_root_dir``, else
    the next one (``_CheckpointConnector``'s ``_hpc_resume_path`` and ``hpc_save_path``), so that a preemption save
    is found by Lightning's own requeue resume."""
    connector = trainer._checkpoint_connector
    return connector._hpc_resume_path or connector.hpc_save_path(trainer.default_root_dir)


__all__ = [
    "DatasetSamplerWrapper",
    "IndexBatchSamplerWrapper",
    "SignalConnector",
    "StrategyRegistryType",
    "format_summary_table",
    "plugin_to_compute_dtype",
]
