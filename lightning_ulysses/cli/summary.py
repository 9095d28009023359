"""The model summary a ``lightning-ulysses`` run prints at the start of fit: Lightning's, without its FLOPs and
without the rows of the LightningModule's metrics (``eval_loss | TokenCrossEntropy | 0``: no parameters, not layers
of the model).

Lightning counts FLOPs only by running the module's ``example_input_array``, which the models here do not have, so
its summary always read ``Total FLOPs: 0`` next to a column of zeros.
:class:`~lightning_ulysses.SequenceParallelMonitor` measures the FLOPs that training runs (``sp/tflops_per_sec``).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torchmetrics import Metric

from lightning_ulysses.engines import lightning as lightning_engine
from lightning_ulysses.engines.lightning import format_summary_table


class ModelSummaryWithoutFlops(ModelSummary):
    """Lightning's :class:`~lightning.pytorch.callbacks.ModelSummary` with the FLOPs column and total left out where
    nothing counted them (``total_flops == 0``), and no row for a metric."""

    def _summary(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Summary:
        summary = super()._summary(trainer, pl_module)
        lightning_engine.drop_summary_rows(summary, lambda module: isinstance(module, Metric))
        return summary

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        columns = summary_data if total_flops else [column for column in summary_data if column[0] != "FLOPs"]
        table = format_summary_table(
            total_parameters, trainable_parameters, model_size, total_training_modes, total_flops, *columns
        )
        if not total_flops:
            table = table.rsplit("\n", 1)[0]  # its last line is the FLOPs total
        rank_zero_info("\n" + table)
