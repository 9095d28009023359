"""The private names of Lightning, DeepSpeed, transformers and torch that the engine adapters
(:mod:`lightning_ulysses.engines`) use still exist with the signature they are called with: a release that moves one
fails here, by name."""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from lightning.fabric.strategies.deepspeed import _validate_device_index_selection
from lightning.fabric.utilities.data import _auto_add_worker_init_fn
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import BatchSampler, SequentialSampler

from lightning_ulysses.engines import deepspeed as deepspeed_engine
from lightning_ulysses.engines import lightning as lightning_engine
from lightning_ulysses.engines import transformers as transformers_engine


def parameters(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_lightning_private_functions_take_what_the_adapter_passes() -> None:
    assert parameters(ModelParallelStrategy._setup_distributed) == ["self"]
    assert parameters(_materialize_distributed_module)[:2] == ["module", "device"]
    assert parameters(_optimizers_to_device)[:2] == ["optimizers", "device"]
    assert parameters(_auto_add_worker_init_fn)[:2] == ["dataloader", "rank"]
    assert parameters(_TrainingEpochLoop._should_accumulate) == ["self"]
    assert parameters(_validate_device_index_selection) == ["parallel_devices"]
    assert parameters(DeepSpeedStrategy._init_deepspeed_distributed) == ["self"]
    timeout = timedelta(seconds=7)
    for strategy in (
        DDPStrategy(timeout=timeout),
        DeepSpeedStrategy(timeout=timeout),
        ModelParallelStrategy(timeout=timeout),
    ):
        assert lightning_engine.process_group_timeout(strategy) == timeout


def test_lightning_private_attributes_are_where_the_adapter_reads_and_writes_them() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    assert isinstance(lightning_engine.signal_connector(trainer), _SignalConnector)
    results = trainer.fit_loop.epoch_loop._results
    assert isinstance(results, _ResultCollection) and trainer._results is None  # set once a loop runs
    trainer.state.stage = "train"
    assert trainer._results is results
    lightning_engine.set_logged_batch_size(trainer, 3)
    assert results.batch_size == 3
    module = L.LightningModule()
    mesh = object()
    lightning_engine.set_module_device_mesh(module, mesh)  # type: ignore[arg-type]
    assert module.device_mesh is mesh


def test_lightning_private_classes_and_the_checkpoint_connector() -> None:
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    assert lightning_engine.__all__ == sorted(lightning_engine.__all__)
    for name in lightning_engine.__all__:
        assert getattr(lightning_engine, name) is not None, name
    assert parameters(lightning_engine.format_summary_table)[:2] == ["total_parameters", "trainable_parameters"]
    assert parameters(lightning_engine.plugin_to_compute_dtype) == ["plugin"]
    batch_sampler = BatchSampler([0, 1], 1, False)
    wrapped = lightning_engine.IndexBatchSamplerWrapper(batch_sampler)
    assert lightning_engine.inside_index_batch_sampler(wrapped) is batch_sampler
    assert lightning_engine.inside_index_batch_sampler(batch_sampler) is batch_sampler
    sampler = SequentialSampler([0, 1])
    assert lightning_engine.wrapped_sampler(lightning_engine.DatasetSamplerWrapper(sampler)) is sampler
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer._checkpoint_connector, _CheckpointConnector)
    assert hasattr(trainer._checkpoint_connector, "_hpc_resume_path")
    assert lightning_engine.hpc_checkpoint_path(trainer).endswith("hpc_ckpt_1.ckpt")
    assert lightning_engine.attached_trainer(L.LightningModule()) is None
    module = L.LightningModule()
    module.trainer = trainer
    assert lightning_engine.attached_trainer(module) is trainer


def test_the_model_summary_rows_can_be_dropped() -> None:
    from lightning.pytorch.utilities.model_summary import ModelSummary

    module = L.LightningModule()
    module.kept, module.dropped = torch.nn.Linear(2, 2), torch.nn.ReLU()
    summary = ModelSummary(module)
    assert summary.layer_names == ["kept", "dropped"]
    lightning_engine.drop_summary_rows(summary, lambda layer: isinstance(layer, torch.nn.ReLU))
    assert summary.layer_names == ["kept"]


def test_torch_private_names() -> None:
    assert "mesh_dim_name" in parameters(DeviceMesh._flatten)
    assert callable(torch.distributed.distributed_c10d._get_default_store)
    from torch._C._distributed_c10d import Backend

    assert Backend.Options("gloo", timedelta(seconds=7))._timeout == timedelta(seconds=7)
    if hasattr(torch.distributed, "ProcessGroupNCCL"):  # a CUDA build: the timeout is set through _timeout
        assert hasattr(torch.distributed.ProcessGroupNCCL.Options(), "_timeout")


def test_deepspeed_private_names() -> None:
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    from deepspeed.utils import groups

    assert hasattr(groups, "_WORLD_GROUP") and hasattr(groups, "_clone_world_group")
    assert isinstance(deepspeed.ops.__compatible_ops__, dict) and isinstance(ShareMemCommBuilder.NAME, str)
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert parameters(DeepSpeedEngine._copy_recovery_script) == ["self", "save_path"]
    config = DeepSpeedConfig({"train_batch_size": 1, "bf16": {"enabled": True}})
    assert isinstance(config.bfloat16_config.check_grad_overflow, bool)
    assert hasattr(config, "load_universal_checkpoint")
    from deepspeed.runtime.zero import parameter_offload

    assert isinstance(parameter_offload.FWD_MODULE_STACK, list)
    converted, plain = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    converted._parameters = parameter_offload.ZeROOrderedDict(converted, converted._parameters)
    model = torch.nn.Sequential(converted, plain)
    (converted_dict,) = deepspeed_engine.zero3_parameter_dicts(model)
    assert converted_dict is converted._parameters and not deepspeed_engine.in_forward(converted_dict)
    deepspeed_engine.set_in_forward(converted_dict, True)
    assert deepspeed_engine.in_forward(converted_dict)
    assert deepspeed_engine.zero3_parameter_dicts(torch.nn.Linear(2, 2)) == []


def test_transformers_private_names() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, RecurrentGemmaConfig, RecurrentGemmaModel
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = LlamaConfig(num_hidden_layers=1, hidden_size=8, intermediate_size=16, num_attention_heads=2, vocab_size=8)
    config._attn_implementation = "sdpa"
    assert transformers_engine.attn_implementation(config) == "sdpa"
    transformers_engine.set_own_attn_implementation(config, "eager")
    assert config._attn_implementation == "eager" and transformers_engine.ATTN_IMPLEMENTATION_ATTRIBUTE in vars(config)

    ALL_MASK_ATTENTION_FUNCTIONS.register("engines_test", lambda *args, **kwargs: None)
    transformers_engine.unregister_mask_interface("engines_test")
    assert "engines_test" not in ALL_MASK_ATTENTION_FUNCTIONS

    model = LlamaForCausalLM(config)
    assert parameters(type(model)._set_gradient_checkpointing)[:3] == ["self", "enable", "gradient_checkpointing_func"]
    checkpointed: list[str] = []
    transformers_engine.enable_gradient_checkpointing(model, lambda *args, **kwargs: checkpointed.append("called"))
    assert model.is_gradient_checkpointing and model.model.layers[0].gradient_checkpointing
    transformers_engine.disable_gradient_checkpointing(model)
    assert not model.is_gradient_checkpointing
    model.loss_function = lambda *args, **kwargs: None
    assert transformers_engine.LOSS_FUNCTION_ATTRIBUTE in vars(model)

    recurrent = RecurrentGemmaConfig(
        num_hidden_layers=1, hidden_size=8, lru_width=8, intermediate_size=16, num_attention_heads=2, vocab_size=8
    )
    lru = RecurrentGemmaModel(recurrent).layers[0].temporal_block.rg_lru
    assert parameters(lru._rnn_scan) == ["hidden_states", "recurrent_gate", "reset", "recurrent_states", "acc_dtype"]
    gate, x = torch.full((1, 3, 8), 0.5), torch.ones(1, 3, 8)
    out = transformers_engine.rnn_scan(lru, x, gate, torch.tensor([[[True], [False], [False]]]))
    assert torch.allclose(out[0, :, 0], torch.tensor([1.0, 1.5, 1.75]))


def test_lightning_private_hooks_the_package_overrides_take_what_it_passes() -> None:
    """Hooks a subclass overrides cannot move into an adapter: a release that renames one would leave the override
    silently uncalled (ModelCheckpoint's last.ckpt, the step progress bar, the CLI, the summary, the refusal of a
    layout in the user's process)."""
    from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, RichProgressBar
    from lightning.pytorch.cli import LightningCLI

    assert parameters(ModelCheckpoint._save_topk_checkpoint) == ["self", "trainer", "monitor_candidates"]
    assert parameters(ModelCheckpoint._save_last_checkpoint) == ["self", "trainer", "monitor_candidates"]
    assert parameters(ModelCheckpoint._monitor_candidates) == ["self", "trainer"]
    assert parameters(RichProgressBar._get_train_description) == ["self", "current_epoch"]
    assert parameters(RichProgressBar._initialize_train_progress_bar_id) == ["self"]
    assert parameters(RichProgressBar._update)[:3] == ["self", "progress_bar_id", "current"]
    assert parameters(RichProgressBar._update_metrics) == ["self", "trainer", "pl_module"]
    assert parameters(LightningCLI._add_subcommands) == ["self", "parser", "kwargs"]
    assert parameters(LightningCLI._parse_ckpt_path) == ["self"]
    assert parameters(LightningCLI._instantiate_trainer) == ["self", "config", "callbacks"]
    assert parameters(ModelSummary._summary) == ["self", "trainer", "pl_module"]
    assert parameters(DDPStrategy._configure_launcher) == ["self"]
