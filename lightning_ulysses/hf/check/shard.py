"""This rank's shard of the probe sequence, and comparisons of per-token tensors with the whole-sequence run."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_ulysses.hf.check.tensors import Call
from lightning_ulysses.hf.plan import TokenDims
from lightning_ulysses.sharding import shard_index


def tolerance(dtype: torch.dtype) -> float:
    """Largest difference, relative to a tensor's largest magnitude, that counts as equal between the whole and
    the sharded probe: kernels may round differently for other shapes (one bf16 ulp is 0.8%). A token mixer
    changes the border tokens of its own output by about their size."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


class Shard:
    """This rank's shard of the probe sequence (its columns as :func:`~lightning_ulysses.sharding.shard_batch` takes
    them, zigzag with a ring), and comparisons of per-token tensors with the whole run."""

    def __init__(self, rank: int, sp_size: int, whole_length: int, ring_size: int = 1) -> None:
        self.whole_length, self.length = whole_length, whole_length // sp_size
        self.index = shard_index(whole_length, rank, sp_size, ring_size)

    def take(self, tensor: Tensor, dim: int) -> Tensor:
        """``tensor``'s shard columns along ``dim``."""
        return tensor.index_select(dim, self.index.to(tensor.device))

    def of(self, tensor: Tensor) -> Tensor:
        return self.take(tensor, 1)

    def slice(self, whole: Tensor, local: Tensor) -> Tensor | None:
        """The part of ``whole`` that corresponds to ``local``: sliced along the token dimension (the one that is
        ``N`` long in ``whole`` and ``N / sp`` in ``local``, every other dimension equal); None if there is none."""
        if whole.dim() != local.dim():
            return None
        for dim, (w, n) in enumerate(zip(whole.shape, local.shape, strict=True)):
            if (w, n) == (self.whole_length, self.length) and all(
                a == b for d, (a, b) in enumerate(zip(whole.shape, local.shape, strict=True)) if d != dim
            ):
                return self.take(whole, dim)
        return None

    def token_dims(self, whole: Call, local_inputs: dict[str, Tensor], local_outputs: list[Tensor]) -> TokenDims | None:
        """Where the sequence runs in a module's inputs and outputs (:class:`TokenDims`), from its whole-sequence and
        its shard call; None when an output is not one the shard's rows can be cut from."""
        inputs = {}
        for key, local in local_inputs.items():
            dim = self._sequence_dim(whole.inputs.get(key), local, extra=False)
            if dim is not None:
                inputs[key] = dim
        outputs = {}
        if len(whole.outputs) != len(local_outputs):
            return None
        for i, (w, loc) in enumerate(zip(whole.outputs, local_outputs, strict=True)):
            dim = self._sequence_dim(w, loc, extra=True)
            if dim is None and w.shape != loc.shape:
                return None
            if dim is not None:
                outputs[i] = dim
        return TokenDims(inputs, outputs)

    def _sequence_dim(self, whole: Tensor | None, local: Tensor, extra: bool) -> int | None:
        """The dimension that is ``N`` long in ``whole`` and ``N / sp`` in ``local`` (or, with ``extra``, longer than
        those by the same constant), every other dimension equal."""
        if whole is None or whole.dim() != local.dim():
            return None
        for dim, (w, n) in enumerate(zip(whole.shape, local.shape, strict=True)):
            others = all(a == b for d, (a, b) in enumerate(zip(whole.shape, local.shape, strict=True)) if d != dim)
            if others and w - n == self.whole_length - self.length and (n == self.length or extra and n > self.length):
                return dim
        return None

    def agree(self, whole: Tensor | None, local: Tensor | None) -> bool:
        if whole is None or local is None:
            return whole is local
        part = self.slice(whole, local)
        return part is not None and close(part, local)

    def inputs_agree(self, whole: dict[str, Tensor], local: dict[str, Tensor]) -> bool:
        """Whether the per-token inputs that both calls received agree (a mask built only for the whole run is
        left out)."""
        keys = [key for key in whole if key in local]
        return self.all_agree([whole[k] for k in keys], [local[k] for k in keys])

    def all_agree(self, whole: list[Tensor], local: list[Tensor]) -> bool:
        """Whether every per-token tensor of ``local`` equals its part of the matching tensor of ``whole``."""
        if len(whole) != len(local):
            return False
        for w, loc in zip(whole, local, strict=True):
            part = self.slice(w, loc)
            if part is not None and not close(part, loc):
                return False
        return True


def close(expected: Tensor, got: Tensor) -> bool:
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return False
    if not expected.is_floating_point():
        return bool(torch.equal(expected, got))
    scale = expected.abs().amax().clamp(min=1e-6)
    return bool(((expected - got).abs().amax() <= tolerance(expected.dtype) * scale).item())


def shard_of(value: Any, shard: Shard) -> Any:
    """``value`` cut to the shard along its token dimension (the last that is ``N`` long), if it has one."""
    if not isinstance(value, Tensor):
        return value
    for dim in reversed(range(1, value.dim())):
        if value.shape[dim] == shard.whole_length:
            return shard.take(value, dim)
    return value
