"""DeepSpeed's (and Lightning's DeepSpeed strategy's) private names that ``UlyssesStrategy`` uses, each with the reason
(see :mod:`lightning_ulysses.engines`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.deepspeed import _validate_device_index_selection
from lightning.pytorch.strategies import DeepSpeedStrategy


def validate_device_index_selection(devices: list[torch.device]) -> None:
    """Refuse CUDA device lists that DeepSpeed cannot address (it takes the local rank as the device index), as
    ``DeepSpeedStrategy.setup_distributed`` does; the Ulysses strategy replaces that method to build its grid."""
    _validate_device_index_selection(devices)


def init_deepspeed_distributed(strategy: DeepSpeedStrategy) -> None:
    """``deepspeed.init_distributed`` as ``DeepSpeedStrategy.setup_distributed`` calls it (the cluster environment's
    address and port, the backend, the strategy's timeout; ``_init_deepspeed_distributed``): the Ulysses strategy
    replaces that method to build its grid between the world's ranks and the engine's groups."""
    strategy._init_deepspeed_distributed()


def bound_world_group(world_size: int, timeout: Any) -> None:
    """DeepSpeed clones the world group for its own collectives (``groups._clone_world_group``) without a timeout, so
    a rank that fails before the engine exists would hold its peers for torch's default 30 minutes. Create that clone
    first, with the strategy's timeout (DeepSpeed keeps it in ``groups._WORLD_GROUP`` until the world group is
    destroyed)."""
    from deepspeed.utils import groups

    if groups._WORLD_GROUP is None:
        groups._WORLD_GROUP = dist.new_group(ranks=list(range(world_size)), timeout=timeout)


def skip_shared_memory_kernel() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce kernel (over a minute) at start-up.
    Gloo never uses it, so mark it unavailable in ``deepspeed.ops.__compatible_ops__`` (DeepSpeed keeps this table for
    exactly such edits)."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


@contextmanager
def recovery_script_copy_through(engine: Any, copy: Callable[[Callable[[str], None], str], None]) -> Iterator[None]:
    """Route the engine's copy of ``zero_to_fp32.py`` into each checkpoint (rank 0, DeepSpeed's private
    ``_copy_recovery_script(save_path)``, the one write outside its checkpoint engine) through
    ``copy(original, save_path)``, so that an atomic save records and checks that file as every other."""
    original = engine._copy_recovery_script
    engine._copy_recovery_script = lambda save_path: copy(original, save_path)
    try:
        yield
    finally:
        del engine._copy_recovery_script  # the instance attribute: DeepSpeed's method shows again


def set_load_universal_checkpoint(engine: Any, universal: bool) -> None:
    """DeepSpeed reads its ``checkpoint.load_universal`` setting (``_config.load_universal_checkpoint``) only when it
    loads, and has no argument for it: set it on the engine that exists by then, per checkpoint."""
    engine._config.load_universal_checkpoint = universal


def checks_bf16_gradient_overflow(engine: Any) -> bool:
    """Whether the engine's bf16 optimizer skips steps with non-finite gradients (the config's
    ``bf16.check_grad_overflow``, which DeepSpeed exposes only in its parsed ``_config``)."""
    return bool(engine._config.bfloat16_config.check_grad_overflow)


def release_zero3_module(engine: Any) -> None:
    """Drop ``engine``'s modules from DeepSpeed's module-level ``parameter_offload.FWD_MODULE_STACK``.

    ZeRO-3 pushes the engine's top module there at set-up and never pops it (DeepSpeed 0.19.8), and a forward that
    raised leaves its sub-modules there: without this, every engine built in a process (a sweep, a test session)
    stays alive with its weights and optimizer state. Entries of other engines stay."""
    from deepspeed.runtime.zero import parameter_offload

    module = getattr(engine, "module", None)
    if not isinstance(module, torch.nn.Module):
        return
    owned = {id(m) for m in module.modules()}
    parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if id(m) not in owned]


def zero3_parameter_dicts(model: torch.nn.Module) -> list[Any]:
    """The parameter dicts of ``model``'s modules that ZeRO-3 has converted (DeepSpeed's ``ZeROOrderedDict``): each
    gathers a parameter read outside its own module's call, but only while its private ``_in_forward`` flag is on,
    which the engine sets for its own forward only; the set-up check calls the model itself
    (:mod:`lightning_ulysses.hf.check.zero3`). Empty without ZeRO-3."""
    return [m._parameters for m in model.modules() if hasattr(m._parameters, "_in_forward")]


def in_forward(parameters: Any) -> bool:
    """Whether a dict of :func:`zero3_parameter_dicts` gathers parameters read outside their module's call."""
    return bool(parameters._in_forward)


def set_in_forward(parameters: Any, on: bool) -> None:
    """Switch that gathering of a dict of :func:`zero3_parameter_dicts` on or off, as the engine's forward does."""
    parameters._in_forward = on
