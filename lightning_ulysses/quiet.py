"""Third-party messages that every run printed, on every rank, and that are known harmless: filtered narrowly, each
by its own text and origin, when ``lightning_ulysses`` is imported (before DeepSpeed is).

* DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
  logged to stdout when it imports (the first line of ``--print_config``), only where torch sees no GPU either;
* DeepSpeed's "MPU is not provided, setting tp size to 1 in checkpoint loading." when it loads a converted
  checkpoint (there is no tensor parallelism here);
* DeepSpeed's ZeRO step calling ``torch.distributed.all_gather_into_tensor``, which torch 2.13 deprecates;
* Lightning's own ``isinstance(treespec, LeafSpec)`` deprecation (``lightning.pytorch.utilities._pytree``);
* Lightning's advertisements for its cloud services ("💡 Tip: For seamless cloud ...").

:func:`install_cli` adds, for ``lightning-ulysses`` runs (every rank), Lightning's lines that say nothing a run's user
needs: "Seed set to 42" (once per rank; the run's ``config.yaml`` holds the seed), "GPU available: False, used:
False" / "TPU available: ...", "initializing deepspeed distributed: GLOBAL_RANK: ..." (once per rank) and the
checkpoint callback's "The dirpath has changed from ..." of every resume, validate and predict from a checkpoint of
another run folder (once per rank: it only says that the new folder's top-k starts afresh).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable

DEEPSPEED_CPU_WARNING = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
DEEPSPEED_NO_MPU = "MPU is not provided, setting tp size to 1 in checkpoint loading."
LIGHTNING_TIP = "💡 Tip: For seamless cloud"
RANK_ZERO_LOGGERS = ("lightning.fabric.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero")
"""rank_zero_info logs through whichever of the two imported last."""
CLI_NOISE = (
    (("lightning.fabric.utilities.seed",), "Seed set to "),
    (RANK_ZERO_LOGGERS, "GPU available: "),
    (RANK_ZERO_LOGGERS, "TPU available: "),
    (("lightning.pytorch.strategies.deepspeed",), "initializing deepspeed distributed: "),
)
"""(loggers, start of the message) of the lines :func:`install_cli` drops."""


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


def _torch_sees_a_gpu() -> bool:
    import torch

    return torch.cuda.device_count() > 0


def install() -> None:
    """Add the filters (idempotent: each logger gets one of each, the warning filters are deduplicated by Python)."""
    _add_filter("DeepSpeed", _DropMessages(DEEPSPEED_CPU_WARNING, keep_if=_torch_sees_a_gpu))
    _add_filter("DeepSpeed", _DropMessages(DEEPSPEED_NO_MPU))
    for name in RANK_ZERO_LOGGERS:
        _add_filter(name, _DropMessages(LIGHTNING_TIP))
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
        category=FutureWarning,
        module=r"torch\.distributed\.c10d_logger",
    )
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


def install_cli() -> None:
    """Add the filters of ``lightning-ulysses`` runs (the module's docstring), in every rank's process."""
    for names, starts in CLI_NOISE:
        for name in names:
            _add_filter(name, _DropMessages(starts))
    warnings.filterwarnings(
        "ignore",
        message=r"The dirpath has changed from",
        module=r"lightning\.pytorch\.callbacks\.model_checkpoint",
    )


def _add_filter(name: str, message_filter: _DropMessages) -> None:
    """Add ``message_filter`` to the logger ``name`` unless it has one for the same message (idempotent)."""
    logger = logging.getLogger(name)  # the logger DeepSpeed and Lightning configure later: the filter stays
    if not any(isinstance(f, _DropMessages) and f.starts == message_filter.starts for f in logger.filters):
        logger.addFilter(message_filter)
