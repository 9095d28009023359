"""``UlyssesFSDPStrategy``: Ulysses sequence parallelism on FSDP2, Lightning's ``ModelParallelStrategy`` underneath.

The sequence-parallel side (grid, data, batches, model hook, loss, memory options) is
:class:`~lightning_ulysses.sequence_parallel.SequenceParallelMixin`'s, the same as on DeepSpeed. This module is FSDP2's
side, as torchtitan's ``parallelize_llama`` / ``apply_fsdp`` does it for context parallelism:

* the process grid is the mixin's ``DeviceMesh`` (axes ``dp``, ``ring``, ``ulysses`` and ``sp``:
  :func:`~lightning_ulysses.groups.build_mesh`) with one more flattened axis, ``dp_sp`` (:data:`FSDP_AXIS`), also
  ``LightningModule.device_mesh``;
* every transformers model inside the LightningModule is sharded with ``fully_shard`` over the flattened
  ``dp x sp`` axis (torchtitan's ``dp_shard_cp``; the ranks of an SP group hold the same weights, so sharding them
  there too divides their memory by ``dp * sp``), found by what the model is, not by a list of names
  (:func:`shard_transformers_models`): each decoder layer (transformers' ``GradientCheckpointingLayer``) one unit, the
  input and output embeddings one unit (a tied weight has one owner; the tiled loss calls ``lm_head`` alone, outside
  the model's forward, once per tile and again in each tile's recomputation: a hook gathers the unit at such a call
  where FSDP2 left it sharded, :func:`_gather_when_sharded`), the decoder the root (it runs first in every path: the
  model's forward and the tiled loss's decoder call);
* FSDP2 reduce-scatters the gradients as the mean over all ``W = dp * sp`` ranks, the contract of
  :mod:`lightning_ulysses.sequence_parallel`: the same loss scale ``sp`` makes the update exact;
* checkpoints are Lightning's distributed checkpoints of ``ModelParallelStrategy`` (a folder with one shard file per
  rank and the loop state), or one full file with ``save_distributed_checkpoint=False``.

The model is patched and its memory options applied before it is sharded: the set-up checks run the whole model on
every rank, as one process would. A LightningModule that an earlier run sharded (``trainer.validate`` or ``predict``
after ``fit``, a second ``fit``) keeps its units: their weights are gathered whole for the set-up checks
(:func:`whole_weights`) and sharded again; a model that ``fully_shard`` sharded otherwise (in ``configure_model``) is
refused. After each run every unit holds only its shards again (after an evaluation FSDP2 would keep some gathered).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers.modeling_layers import GradientCheckpointingLayer
from typing_extensions import override

from lightning_ulysses.engines import lightning as lightning_engine
from lightning_ulysses.engines.fsdp2 import flatten_mesh
from lightning_ulysses.hf.state import outermost_models
from lightning_ulysses.sequence_parallel import SequenceParallelMixin

FSDP_AXIS = "dp_sp"
"""The name of the flattened ``dp x ring x ulysses`` axis of the process grid that FSDP2 shards over."""


class UlyssesFSDPStrategy(SequenceParallelMixin, ModelParallelStrategy):
    """Ulysses sequence parallelism on FSDP2 (``fully_shard``), for CUDA and CPU (gloo).

    The sequence-parallel arguments (``sp_size``, ``ring_size``, ``attn_implementation``, ``head_chunks``, the memory
    options, ...) are :class:`~lightning_ulysses.sequence_parallel.SequenceParallelMixin`'s. The LightningModule needs
    no ``configure_model``: its transformers models are sharded at set-up (:func:`shard_transformers_models`).

    Args:
        reshard_after_forward: FSDP2's: free each layer's gathered weights after its forward and gather them again for
            the backward (``True``, default), or keep them to the backward (``False``: more memory, less traffic).
        save_distributed_checkpoint: ``True`` (default): each rank saves its shards into one checkpoint folder;
            ``False``: the full weights and optimizer state in one file, written by rank 0.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; default: the device's.
        timeout: of every collective (the SP and DP groups' too).
        **sequence_parallel_kwargs: :class:`~lightning_ulysses.sequence_parallel.SequenceParallelMixin`'s.
    """

    strategy_name = "ulysses_fsdp"

    def __init__(
        self,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **sequence_parallel_kwargs: Any,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **sequence_parallel_kwargs,
        )
        if self.nonfinite_loss.mode == "skip":
            raise ValueError(
                "nonfinite_loss='skip' relies on DeepSpeed discarding the step; UlyssesFSDPStrategy has no such "
                "engine. Use nonfinite_loss='raise' (or 'off'), or UlyssesStrategy."
            )
        self.reshard_after_forward = reshard_after_forward

    @property
    def parameters_sharded(self) -> bool:
        """Always: ``fully_shard`` shards every parameter, gathered per unit in its forward."""
        return True

    @override
    def setup_environment(self) -> None:
        self._quiet_run()
        lightning_engine.model_parallel_setup_distributed(self)
        self._create_topology()
        self._create_groups(lightning_engine.process_group_timeout(self))
        mesh = self.device_mesh  # the mixin's grid, one more axis for FSDP2
        flatten_mesh(mesh["dp", "ring", "ulysses"], FSDP_AXIS)
        assert self.lightning_module is not None
        lightning_engine.set_module_device_mesh(self.lightning_module, mesh)

    @override
    def setup(self, trainer: Any) -> None:
        """``ModelParallelStrategy.setup`` without its ``configure_model`` requirement: the transformers models are
        patched, given their memory options and sharded here."""
        assert self.model is not None and self.lightning_module is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self._before_engine_setup(trainer)
        lightning_engine.materialize_meta_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        mesh = self.device_mesh[FSDP_AXIS]
        with whole_weights(self.lightning_module, self.reshard_after_forward):  # the models an earlier run sharded
            self._apply_sequence_parallel(trainer)
        shard_transformers_models(self.lightning_module, mesh, reshard_after_forward=self.reshard_after_forward)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            lightning_engine.optimizers_to_device(self.optimizers, self.root_device)

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None:
            # after an evaluation FSDP2 keeps the root's weights gathered (it reshards them after the backward), and
            # those of the embeddings when the tiled loss called lm_head more than once (a unit of several modules
            # reshards once all of them have run)
            for units in _sharded_models(self.lightning_module):
                for unit in (*units.resharded, units.root):
                    unit.reshard()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: lightning_engine.StrategyRegistryType) -> None:
        """``strategy="ulysses_fsdp"``: SP over each node's devices, FSDP2 over all ranks."""
        strategy_registry.register(cls.strategy_name, cls, description="Ulysses sequence parallelism on FSDP2")


UlyssesFSDPStrategy.register_strategies(StrategyRegistry)


@dataclass(frozen=True)
class _Units:
    """The ``fully_shard`` units of one transformers model, as :func:`shard_transformers_models` made them."""

    resharded: list[FSDPModule]  # each decoder layer and the embeddings: resharded after their forward, as asked
    root: FSDPModule  # the decoder: FSDP2 keeps its weights gathered from forward to backward


UNITS_ATTRIBUTE = "_ulysses_fsdp_units"
"""Where a transformers model that :func:`shard_transformers_models` sharded holds its :class:`_Units`, for the runs
after the first."""


def _units(model: nn.Module) -> _Units | None:
    return model.__dict__.get(UNITS_ATTRIBUTE)


def _sharded_models(module: nn.Module) -> list[_Units]:
    """The units of each transformers model inside ``module`` that :func:`shard_transformers_models` sharded."""
    return [units for model in outermost_models(module) if (units := _units(model)) is not None]


@contextmanager
def whole_weights(module: nn.Module, reshard_after_forward: bool) -> Iterator[None]:
    """The weights of the transformers models inside ``module`` that :func:`shard_transformers_models` sharded in an
    earlier run gathered whole on every rank until the block ends, forwards included (the set-up checks also call
    single modules, an MLP or an attention module, outside the unit that would gather them); then sharded again, the
    units other than the root resharding after their forward as ``reshard_after_forward`` says. A collective.

    Raises ``ValueError`` for a model whose modules ``fully_shard`` sharded otherwise (in ``configure_model``): the
    set-up checks could not run on its whole weights."""
    for model in outermost_models(module):
        if _units(model) is None and any(isinstance(m, FSDPModule) for m in model.modules()):
            raise ValueError(
                f"{type(model).__name__} is already sharded by fully_shard (in configure_model?): UlyssesFSDPStrategy "
                "shards the transformers models itself, at set-up, once its checks have run on the whole weights. "
                "Remove the fully_shard calls (and configure_model, if it only shards)."
            )
    sharded = _sharded_models(module)
    settings = [(unit, reshard_after_forward) for units in sharded for unit in units.resharded]
    settings += [(units.root, False) for units in sharded]
    for unit, _ in settings:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit, reshard in settings:
            unit.reshard()
            unit.set_reshard_after_forward(reshard, recurse=False)


def shard_transformers_models(module: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True) -> None:
    """``fully_shard`` every outermost transformers model inside ``module`` over the 1-D ``mesh``: each decoder layer
    (``GradientCheckpointingLayer``), then the input and output embeddings as one unit, each of its modules given a
    forward pre-hook that gathers it where FSDP2 left it sharded at a call (:func:`_gather_when_sharded`), then the
    decoder as the root.
    A model that an earlier call sharded is left as it is (the grid's ``dp x sp`` axis is the same world).

    Raises ``ValueError`` before any change where a trainable parameter would be left out (outside every transformers
    model, or outside its decoder and output embeddings): its gradient would not be reduced over the ranks."""
    models = outermost_models(module)
    covered: set[int] = set()
    planned = []
    for model in models:
        decoder = model.get_decoder()
        embeddings = list(dict.fromkeys(m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m))
        layers = _outermost(m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer))
        planned.append((model, layers, embeddings, decoder))
        covered.update(id(p) for part in (decoder, *embeddings) for p in part.parameters())
    left_out = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in covered]
    if left_out:
        shown = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
        raise ValueError(
            f"UlyssesFSDPStrategy shards the decoders and embeddings of the transformers models inside the "
            f"LightningModule; these trainable parameters lie outside them, and their gradients would not be reduced "
            f"over the ranks: {shown}. Freeze them (requires_grad=False), or use UlyssesStrategy (DeepSpeed)."
        )
    for model, layers, embeddings, decoder in planned:
        if _units(model) is not None:
            continue
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(embeddings, mesh=mesh, reshard_after_forward=reshard_after_forward)
        if len(embeddings) > 1:
            for embedding in embeddings:
                embedding.register_forward_pre_hook(_gather_when_sharded)  # after FSDP2's own pre-forward hook
        fully_shard(decoder, mesh=mesh)  # the root: FSDP2 keeps its weights gathered from forward to backward
        setattr(
            model, UNITS_ATTRIBUTE, _Units(cast(list[FSDPModule], [*layers, embeddings[0]]), cast(FSDPModule, decoder))
        )


def _gather_when_sharded(module: nn.Module, args: Any) -> None:
    """A forward pre-hook of each module of a unit of several modules: gathers the unit's weights where FSDP2's own
    pre-forward hook (which runs first) left them sharded at this call.

    torch 2.11's FSDP2 runs the pre-forward hook of such a unit only for the first of its modules to run in a forward
    pass, and its post-forward hook (the reshard, and the pre-backward hook on the output) once all of them have run.
    The tiled loss calls ``lm_head`` once per tile after the model's forward and again in each tile's recomputation in
    the backward, so there a call can come after the unit was resharded (by its post-forward, or by the post-backward
    that a later tile's input triggered) and find the weight a sharded ``DTensor``. Newer FSDP2 runs the pre-forward
    hook on every module's call, and this hook finds the weights gathered. FSDP2 reshards them again itself: at the
    unit's next post-backward, at the latest in its final callback of the backward (which also reduces the gradients
    made after the gathering), or after an evaluation at :meth:`UlyssesFSDPStrategy.teardown`."""
    if any(isinstance(p, DTensor) for p in module.parameters()):
        cast(FSDPModule, module).unshard()


def _outermost(modules: Any) -> list[nn.Module]:
    """The modules of ``modules`` (in pre-order) that are not inside another of them."""
    found: list[nn.Module] = []
    inner: set[int] = set()
    for module in modules:
        if id(module) not in inner:
            found.append(module)
            inner.update(id(m) for m in module.modules())
    return found
