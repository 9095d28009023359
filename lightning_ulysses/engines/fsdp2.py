"""torch's private FSDP2 / DeviceMesh names that the FSDP2 engine uses, with the reason (see
:mod:`lightning_ulysses.engines`)."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """All axes of ``mesh`` as one axis ``name``, reachable afterwards as ``mesh[name]``: FSDP2 shards over the
    flattened ``dp x sp`` axis. torch names this only ``DeviceMesh._flatten`` (torchtitan calls it the same way for
    its ``dp_shard_cp`` mesh)."""
    return mesh._flatten(name)
