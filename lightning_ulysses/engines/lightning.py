"""Lightning's private names that the strategies use, each with the reason (see :mod:`lightning_ulysses.engines`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer


def model_parallel_setup_distributed(strategy: ModelParallelStrategy) -> None:
    """The process group of ``ModelParallelStrategy`` (device, world ranks, ``init_process_group`` with its timeout),
    without the ``[data_parallel, tensor_parallel]`` mesh that its ``setup_environment`` builds next: the Ulysses
    strategy builds its own ``[dp, sp]`` mesh. Lightning has no public hook between the two."""
    strategy._setup_distributed()


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


PRIVATE_NAMES: dict[str, Any] = {
    "ModelParallelStrategy._setup_distributed": ModelParallelStrategy._setup_distributed,
    "LightningModule._device_mesh": "_device_mesh",
    "_materialize_distributed_module": _materialize_distributed_module,
    "_optimizers_to_device": _optimizers_to_device,
}
"""What this module reaches into, for the test that a new release still has it."""
