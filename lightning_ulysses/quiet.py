"""Third-party messages that every run printed, on every rank, and that are known harmless: filtered narrowly, each
by its own text and origin, and only while what prints them runs: importing the package installs nothing.

* :data:`RUN`, from the start of ``UlyssesStrategy``'s set-up to its teardown: DeepSpeed's "Setting accelerator to
  CPU. If you have GPU or other accelerator, we were unable to detect it.", logged to stdout as it is imported (by
  the set-up's first step; only where torch sees no GPU either), its "MPU is not provided, setting tp size to 1 in
  checkpoint loading." when it loads a converted checkpoint (there is no tensor parallelism here), its ZeRO step
  calling ``torch.distributed.all_gather_into_tensor``, which torch 2.13 deprecates, and Lightning's own
  ``isinstance(treespec, LeafSpec)`` deprecation (``lightning.pytorch.utilities._pytree``);
* :data:`CLI`, while ``lightning-ulysses`` runs (every rank): DeepSpeed's CPU line (the first line of
  ``--print_config``, which imports it), and Lightning's lines that say nothing a run's user needs: its
  advertisements for its cloud services ("💡 Tip: For seamless cloud ..."), "Seed set to 42" (once per rank; the
  run's ``config.yaml`` holds the seed), "GPU available: False, used: False" / "TPU available: ...", "initializing
  deepspeed distributed: GLOBAL_RANK: ..." (once per rank) and the checkpoint callback's "The dirpath has changed
  from ..." of every resume, validate and predict from a checkpoint of another run folder (once per rank: it only
  says that the new folder's top-k starts afresh).

A Python program that builds its own ``Trainer`` sees Lightning's tips as with any strategy.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

DEEPSPEED_CPU_WARNING = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
DEEPSPEED_NO_MPU = "MPU is not provided, setting tp size to 1 in checkpoint loading."
LIGHTNING_TIP = "💡 Tip: For seamless cloud"
RANK_ZERO_LOGGERS = ("lightning.fabric.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero")
"""rank_zero_info logs through whichever of the two imported last."""


def _torch_sees_a_gpu() -> bool:
    import torch

    return torch.cuda.device_count() > 0


@dataclass(frozen=True)
class Filters:
    """Log records to drop, as ``(logger, start of the message, keep_if)`` (``keep_if()`` true keeps the record), and
    warnings to ignore, as the keyword arguments of :func:`warnings.filterwarnings`."""

    logs: tuple[tuple[str, str, Callable[[], bool] | None], ...] = ()
    warnings: tuple[dict[str, Any], ...] = ()


DEEPSPEED_CPU = ("DeepSpeed", DEEPSPEED_CPU_WARNING, _torch_sees_a_gpu)
RUN = Filters(
    logs=(DEEPSPEED_CPU, ("DeepSpeed", DEEPSPEED_NO_MPU, None)),
    warnings=(
        dict(
            message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
            category=FutureWarning,
            module=r"torch\.distributed\.c10d_logger",
        ),
        dict(
            message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
            module=r"lightning\.pytorch\.utilities\._pytree",
        ),
    ),
)
CLI = Filters(
    logs=(
        DEEPSPEED_CPU,
        *((name, LIGHTNING_TIP, None) for name in RANK_ZERO_LOGGERS),
        ("lightning.fabric.utilities.seed", "Seed set to ", None),
        *((name, "GPU available: ", None) for name in RANK_ZERO_LOGGERS),
        *((name, "TPU available: ", None) for name in RANK_ZERO_LOGGERS),
        ("lightning.pytorch.strategies.deepspeed", "initializing deepspeed distributed: ", None),
    ),
    warnings=(
        dict(message=r"The dirpath has changed from", module=r"lightning\.pytorch\.callbacks\.model_checkpoint"),
    ),
)


class _DropMessages(logging.Filter):
    """Drops the records whose message (after Lightning's ``[rank: N]`` prefix) starts with ``starts``, unless
    ``keep_if()`` says otherwise."""

    def __init__(self, starts: str, keep_if: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self.starts = starts
        self.keep_if = keep_if

    def filter(self, record: logging.LogRecord) -> bool:
        if not re.sub(r"^\[rank: \d+\] ", "", str(record.msg)).startswith(self.starts):  # Lightning's rank prefix
            return True
        return self.keep_if is not None and self.keep_if()


@dataclass
class Installed:
    """What :func:`install` added, which :meth:`remove` takes away again (and nothing else: a warning filter that
    was there before stays)."""

    logs: list[tuple[logging.Logger, logging.Filter]] = field(default_factory=list)
    warnings: list[Any] = field(default_factory=list)  # entries of warnings.filters

    def remove(self) -> None:
        for logger, log_filter in self.logs:
            logger.removeFilter(log_filter)
        active = cast(list, warnings.filters)  # a list (typeshed: a Sequence)
        for entry in self.warnings:
            if entry in active:  # an "ignore" entry: no warning registry remembers what it ignored
                active.remove(entry)
        self.logs.clear()
        self.warnings.clear()


def install(filters: Filters) -> Installed:
    """Add ``filters`` until the returned :meth:`Installed.remove`."""
    installed = Installed()
    for name, starts, keep_if in filters.logs:
        logger = logging.getLogger(name)  # the logger DeepSpeed and Lightning configure later: the filter stays
        log_filter = _DropMessages(starts, keep_if)
        logger.addFilter(log_filter)
        installed.logs.append((logger, log_filter))
    for arguments in filters.warnings:
        before = list(warnings.filters)
        warnings.filterwarnings("ignore", **arguments)
        if warnings.filters[0] not in before:
            installed.warnings.append(warnings.filters[0])
    return installed


@contextmanager
def installed(filters: Filters) -> Iterator[None]:
    """``filters`` within the block."""
    added = install(filters)
    try:
        yield
    finally:
        added.remove()
