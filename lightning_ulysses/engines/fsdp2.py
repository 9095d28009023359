"""torch's private FSDP2 / DeviceMesh names that the FSDP2 engine uses, with the reason (see
:mod:`lightning_ulysses.engines`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Backend
from torch.distributed.device_mesh import DeviceMesh


def flatten_mesh(mesh: DeviceMesh, name: str, backend_override: Any = None) -> DeviceMesh:
    """All axes of ``mesh`` (a slice of the process grid) as one axis ``name``, reachable afterwards as
    ``root_mesh[name]``: the grid's ``sp`` axis (``ring`` x ``ulysses``) and the ``dp x sp`` axis FSDP2 shards over.
    torch names this only ``DeviceMesh._flatten`` (torchtitan calls it the same way for its ``dp_shard_cp`` mesh);
    ``backend_override``: the options of the new axis's group (its timeout)."""
    return mesh._flatten(name, backend_override=backend_override)


def backend_options_with_timeout(timeout: timedelta) -> Backend.Options:
    """Options of the default group's backend that carry ``timeout``, the ``backend_override`` through which
    ``DeviceMesh`` gives its groups a timeout. torch exports the options' type only from ``torch._C`` and sets the
    timeout of NCCL's only through the private ``_timeout``."""
    backend = dist.get_backend()
    if "nccl" in backend:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    return Backend.Options(backend, timeout)
