"""Third-party messages that every run printed, on every rank, and that are known harmless: filtered narrowly, each
by its own text and origin, when ``lightning_ulysses`` is imported (before DeepSpeed is).

* DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
  logged to stdout when it imports (the first line of ``--print_config``), only where torch sees no GPU either;
* DeepSpeed's "MPU is not provided, setting tp size to 1 in checkpoint loading." when it loads a converted
  checkpoint (there is no tensor parallelism here);
* DeepSpeed's ZeRO step calling ``torch.distributed.all_gather_into_tensor``, which torch 2.13 deprecates;
* Lightning's own ``isinstance(treespec, LeafSpec)`` deprecation (``lightning.pytorch.utilities._pytree``);
* Lightning's advertisements for its cloud services ("💡 Tip: For seamless cloud ...").
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

DEEPSPEED_CPU_WARNING = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
DEEPSPEED_NO_MPU = "MPU is not provided, setting tp size to 1 in checkpoint loading."
LIGHTNING_TIP = "💡 Tip: For seamless cloud"


class _DropMessages(logging.Filter):
    """Drops the records whose message starts with ``starts``, unless ``keep_if()`` says otherwise."""

    def __init__(self, starts: str, keep_if: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self.starts = starts
        self.keep_if = keep_if

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.starts):
            return True
        return self.keep_if is not None and self.keep_if()


def _torch_sees_a_gpu() -> bool:
    import torch

    return torch.cuda.device_count() > 0


def install() -> None:
    """Add the filters (idempotent: each logger gets one of each, the warning filters are deduplicated by Python)."""
    for name, message_filter in (
        ("DeepSpeed", _DropMessages(DEEPSPEED_CPU_WARNING, keep_if=_torch_sees_a_gpu)),
        ("DeepSpeed", _DropMessages(DEEPSPEED_NO_MPU)),
        # rank_zero_info logs through whichever of the two imported last
        ("lightning.fabric.utilities.rank_zero", _DropMessages(LIGHTNING_TIP)),
        ("lightning.pytorch.utilities.rank_zero", _DropMessages(LIGHTNING_TIP)),
    ):
        logger = logging.getLogger(name)  # the logger DeepSpeed and Lightning configure later: the filter stays
        if not any(isinstance(f, _DropMessages) and f.starts == message_filter.starts for f in logger.filters):
            logger.addFilter(message_filter)
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated", category=FutureWarning,
        module=r"torch\.distributed\.c10d_logger",
    )
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", module=r"lightning\.pytorch\.utilities\._pytree",
    )
