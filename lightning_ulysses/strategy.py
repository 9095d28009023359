"""``UlyssesStrategy``: Lightning's DeepSpeed strategy plus Ulysses sequence parallelism.

Everything that does not depend on the engine (the ``[dp, sp]`` grid, data per SP group, batches prepared and sharded,
the model hook, the exact loss reduction, the memory options, preemption, failures) is
:class:`~lightning_ulysses.sequence_parallel.SequenceParallelMixin`'s; this module is DeepSpeed's side:

* DeepSpeed's distributed set-up (its world-group clone bounded by the strategy's timeout, its CPU shared-memory kernel
  skipped under gloo) and CPU as a target next to CUDA;
* DeepSpeed checkpoint directories, saved atomically and checked before loading (:mod:`lightning_ulysses.runtime`),
  resuming at the first untrained batch wherever they were taken (:mod:`lightning_ulysses.runtime.resume`);
* gradient accumulation: Lightning already divides each micro-batch loss by ``accumulate_grad_batches``, so the
  engine's second division is switched off. Lightning, not DeepSpeed's micro-batch counter, decides which micro-batch
  ends an optimizer step, as without a strategy: every ``accumulate_grad_batches``-th batch of an epoch and the epoch's
  last one (a shorter last window is applied, not carried into the next epoch); the engine is told so before each
  micro-batch (``set_gradient_accumulation_boundary``).

Gradient reduction: DeepSpeed is given no SP ``mpu``, so under every ZeRO stage it averages gradients over all
``W = dp * sp`` ranks, the contract of :mod:`lightning_ulysses.sequence_parallel`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ulysses.engines import deepspeed as deepspeed_engine
from lightning_ulysses.engines import lightning as lightning_engine
from lightning_ulysses.hf.mixers import register_mixer_weights_for_zero3
from lightning_ulysses.runtime.load import load_checkpoint
from lightning_ulysses.runtime.save import save_checkpoint
from lightning_ulysses.sequence_parallel import SequenceParallelMixin


class UlyssesStrategy(SequenceParallelMixin, DeepSpeedStrategy):
    """Ulysses sequence parallelism on DeepSpeed (ZeRO 1/2/3), for CUDA and CPU.

    The sequence-parallel arguments (``sp_size``, ``ring_size``, ``attn_implementation``, ``head_chunks``, the memory
    options, ...) are :class:`~lightning_ulysses.sequence_parallel.SequenceParallelMixin`'s; every other keyword goes to
    :class:`~lightning.pytorch.strategies.DeepSpeedStrategy` (``stage``, ``config``, offload options, ...).
    """

    strategy_name = "ulysses"

    @property
    def parameters_sharded(self) -> bool:
        """Under ZeRO-3 (DeepSpeed partitions every parameter, gathered per module in its forward)."""
        return isinstance(self.config, dict) and self.config.get("zero_optimization", {}).get("stage") == 3

    @property
    @override
    def root_device(self) -> torch.device:
        device = super().root_device
        # DeepSpeed takes ``root_device.index`` as its device rank and fails on None; "cpu:0" is the same device.
        return torch.device("cpu", 0) if device.type == "cpu" else device

    @override
    def setup_environment(self) -> None:
        # DeepSpeedStrategy accepts CUDA only; CPU runs on DeepSpeed's CPU accelerator over gloo.
        if not isinstance(self.accelerator, (CUDAAccelerator, CPUAccelerator)):
            raise RuntimeError(
                f"UlyssesStrategy runs on CUDA GPUs or CPUs, not {type(self.accelerator).__name__}. "
                "Set Trainer(accelerator='cuda') or Trainer(accelerator='cpu')."
            )
        self._quiet_run()
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        assert self.parallel_devices is not None
        if self.root_device.type == "cuda":
            deepspeed_engine.validate_device_index_selection(self.parallel_devices)
        reset_seed()
        self.set_world_ranks()
        self._create_topology()
        if self.root_device.type == "cpu":
            deepspeed_engine.skip_shared_memory_kernel()
        deepspeed_engine.init_deepspeed_distributed(self)
        timeout = lightning_engine.process_group_timeout(self)
        deepspeed_engine.bound_world_group(self.world_size, timeout)
        self._create_groups(timeout)

    @override
    def setup(self, trainer: Any) -> None:
        assert self.lightning_module is not None
        self._before_engine_setup(trainer)
        assert isinstance(self.config, dict)  # DeepSpeedStrategy.__init__ has built or loaded it
        if self.config.get("zero_optimization", {}).get("stage", 0) == 3:
            register_mixer_weights_for_zero3(self.lightning_module)
        super().setup(trainer)
        # after DeepSpeed's engine exists: the set-up check runs a short forward (ZeRO-3 gathers the weights for it)
        self._apply_sequence_parallel(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.nonfinite_loss.setup(self.model)

    @override
    def teardown(self) -> None:
        deepspeed_engine.release_zero3_module(self.model)  # ZeRO-3 would keep the model alive for the process's life
        super().teardown()

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """False: Lightning's loop decides which micro-batch ends an optimizer step, as it does without a strategy
        (also the epoch's last batch, which closes a shorter window), and calls ``optimizer_step`` only there;
        :meth:`on_train_batch_start` hands that decision to DeepSpeed's engine."""
        return False

    @contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's loop enters this around the backward of a micro-batch that does not end a step; DeepSpeed's
        ``no_sync`` refuses ZeRO 2 and 3, and the engine already knows not to reduce there (its boundary flag)."""
        yield None

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # a preemption's save point
        assert self.lightning_module is not None  # attached by the Trainer before its hooks run
        trainer = self.lightning_module.trainer
        # before the forward: ZeRO reduces (and ZeRO-3 partitions) the gradients in the backward of a step's last batch
        # (self.model: the DeepSpeed engine, which deepspeed's missing types leave typed as a Module)
        cast(Any, self.model).set_gradient_accumulation_boundary(
            not lightning_engine.should_accumulate(trainer.fit_loop)
        )

    @override
    def _step_applied(self) -> bool:
        # self.model: the DeepSpeed engine, which skips a step whose gradients are not finite
        return bool(cast(Any, self.model).was_step_applied())

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        kwargs.setdefault("scale_wrt_gas", False)  # Lightning has already divided by accumulate_grad_batches
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """DeepSpeed's checkpoint directory, committed atomically, with the loop state of the last optimizer step when
        saved inside one (:func:`~lightning_ulysses.runtime.save.save_checkpoint`)."""
        if storage_options is not None:
            raise TypeError("UlyssesStrategy saves DeepSpeed checkpoint directories, without storage_options.")
        assert self.lightning_module is not None  # attached by the Trainer before its hooks run
        trainer = self.lightning_module.trainer
        fit_loop = trainer.fit_loop if trainer.state.fn == TrainerFn.FITTING else None
        save_checkpoint(
            self.deepspeed_engine,
            checkpoint,
            filepath,
            fit_loop,
            self.optimizer_step_in_flight,
            exclude_frozen_parameters=self.exclude_frozen_parameters,
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A DeepSpeed checkpoint directory, checked whole and resumable on this layout before anything is loaded
        (:func:`~lightning_ulysses.runtime.load.load_checkpoint`); a single file as ``DeepSpeedStrategy`` loads it."""
        if not Path(checkpoint_path).is_dir():  # a single file (load_full_weights), or a path Lightning explains
            return super().load_checkpoint(checkpoint_path, weights_only)
        assert isinstance(self.config, dict)
        zero_stage = self.config.get("zero_optimization", {}).get("stage", 0)
        assert self.lightning_module is not None  # attached by the Trainer before its hooks run
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return load_checkpoint(
            self.deepspeed_engine,
            checkpoint_path,
            self.world_size,
            zero_stage,
            fitting=fitting,
            strict=self.lightning_module.strict_loading,
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: lightning_engine.StrategyRegistryType) -> None:
        """``strategy="ulysses"`` (ZeRO stage 2) and ``"ulysses_stage_{1,2,3}"``, SP over each node's devices."""
        strategy_registry.register(
            cls.strategy_name, cls, description="Ulysses sequence parallelism on DeepSpeed ZeRO stage 2"
        )
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"{cls.strategy_name}_stage_{stage}",
                cls,
                description=f"Ulysses sequence parallelism on DeepSpeed ZeRO stage {stage}",
                stage=stage,
            )


UlyssesStrategy.register_strategies(StrategyRegistry)
