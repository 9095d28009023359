"""What Ulysses sequence parallelism adds to a Lightning strategy, whatever the engine underneath.

:class:`SequenceParallelMixin` goes first in a strategy's bases, before the engine's Lightning strategy:
``UlyssesStrategy(SequenceParallelMixin, DeepSpeedStrategy)`` (:mod:`lightning_ulysses.strategy`) and
``UlyssesFSDPStrategy(SequenceParallelMixin, ModelParallelStrategy)`` (:mod:`lightning_ulysses.fsdp_strategy`). It adds:

* the ``[dp, sp]`` process grid (:mod:`lightning_ulysses.topology`) with an SP and a DP group per rank (and a Ulysses
  and a ring group under Ulysses x Ring), in one object built at set-up (:attr:`SequenceParallelMixin.groups`,
  :mod:`lightning_ulysses.groups`); the engine calls :meth:`~SequenceParallelMixin._create_topology` once the world's
  ranks are set and :meth:`~SequenceParallelMixin._create_groups` once its process group exists;
* data: the distributed sampler runs over ``dp_rank / dp_size``, so the ``sp_size`` ranks of an SP
  group see the same samples and one epoch has the step count of DDP on ``dp_size`` ranks; a loader's own
  ``DistributedSampler`` over the world is moved onto the DP ranks, workers are seeded by DP rank, and every
  batch is checked to be the same across the SP group (:mod:`lightning_ulysses.sp_loaders`); the training
  loader resumes inside an epoch (:mod:`lightning_ulysses.runtime.resume`);
* every batch is padded, positioned, labelled and cut to this rank's ``[B, N / sp]`` shard
  (:mod:`lightning_ulysses.sharding`) on its way to the device; evaluation and prediction run the same
  batches on every DP rank (:mod:`lightning_ulysses.runtime.eval_data`);
* SIGTERM / SLURM's requeue signal save a checkpoint at a point that all ranks agree on
  (:mod:`lightning_ulysses.runtime.preemption`); a rank that dies is named by the survivors
  (:class:`~lightning_ulysses.runtime.failures.Heartbeat`);
* every transformers model inside the LightningModule runs all-to-all attention
  (:mod:`lightning_ulysses.hf`), checked at set-up to run exactly or be refused, optionally with tiled MLPs and
  checkpointed, offloaded layers (:mod:`lightning_ulysses.memory`); a model loaded in eval mode (``from_pretrained``)
  trains in train mode, its frozen parts excepted (:mod:`lightning_ulysses.train_mode`): the engine calls
  :meth:`~SequenceParallelMixin._apply_sequence_parallel` at set-up, where every rank can run the model;
* CPU (gloo) is a supported target next to CUDA (NCCL).

Gradient reduction contract. Each engine averages gradients over all ``W = dp * sp`` ranks (DeepSpeed's ZeRO without
an SP ``mpu``; FSDP2 sharding over the flattened ``dp x sp`` mesh). Rank ``r`` of SP group ``g`` returns the loss
``L_r = sp * S_r / T_g`` (``S_r``: its token-loss sum, ``T_g``: the group's valid-token count), so::

    grad = 1/W * sum_r dL_r/dtheta = 1/dp * sum_g d(sum_{r in g} S_r / T_g)/dtheta = 1/dp * sum_g d(mean_g)/dtheta

which is DDP's average over DP groups of the exact token mean of each group's whole sequences. The all-to-all
backward routes each rank's loss gradient to the ranks whose activations it used, so the sum over ``r`` covers every
term. ``sp`` is :attr:`SequenceParallelMixin.loss_gradient_scale`, applied by
:class:`~lightning_ulysses.UlyssesLossMixin` and by a transformers model called with ``labels=`` (or
``shift_labels=``), whose loss the strategy makes the same reduction (:func:`~lightning_ulysses.loss.labels_loss`, the
labels shifted over the whole sequence). A training step at ``sp > 1`` whose loss went through none of these
reductions (a plain mean of this rank's shard) is refused (``check_loss_reduction``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ulysses.attention import gather_sequence, resolve_attn_implementation
from lightning_ulysses.attention.collectives import gather_from_ranks
from lightning_ulysses.attention.head_chunks import HeadChunks, check_head_chunks
from lightning_ulysses.attention.ring_blocks import check_block_kernels
from lightning_ulysses.batch import ShardedBatch, shard_loader_batch
from lightning_ulysses.compile import compile_decoder_layers, remove_compiled_layers
from lightning_ulysses.engines import lightning as lightning_engine
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf import SequenceMixers, apply_ulysses_attention, remove_ulysses_attention
from lightning_ulysses.hf.apply import patches
from lightning_ulysses.hf.check.logits import check_tiled_logits
from lightning_ulysses.liger import apply_liger_kernels, check_liger_kernels, refuse_liger_setup, remove_liger_kernels
from lightning_ulysses.loss import LossContext, StepTokenCounts, labels_loss
from lightning_ulysses.memory import (
    MemoryOptions,
    MemoryReport,
    TileSetting,
    apply_memory_options,
    head_chunks_row,
    remove_memory_options,
    tiled_loss_row,
)
from lightning_ulysses.model_checkpoint import keep_last_checkpoint_current
from lightning_ulysses.quiet import RUN, Installed, install
from lightning_ulysses.runtime.eval_data import RepeatedRows, drop_rows, pad_over_dp_ranks
from lightning_ulysses.runtime.failures import Heartbeat, NonFiniteLoss, NonFiniteLossGuard
from lightning_ulysses.runtime.out_of_memory import StepShape, is_out_of_memory, out_of_memory_advice
from lightning_ulysses.runtime.preemption import PreemptionSignals
from lightning_ulysses.runtime.resume import ResumableLoader, is_resumable
from lightning_ulysses.sp_loaders import check_sp_group_agreement, sampler_over_dp_ranks, warn_on_forked_workers
from lightning_ulysses.topology import SequenceParallelTopology, auto_ring_size, check_ring_size, divisors
from lightning_ulysses.train_mode import train_loaded_models

log = logging.getLogger(__name__)


class SequenceParallelMixin(ParallelStrategy):
    """Ulysses sequence parallelism for a Lightning strategy: everything that does not depend on the engine.

    At set-up each asked memory option is applied and its effect logged as one table (:attr:`memory_report`: layers
    checkpointed, feed-forwards tiled, norms fused, attention layers projected per head chunk, the tiled loss); an
    option that would apply to nothing, or that the model's mode switches off, is refused there, naming what to drop.

    Args:
        sp_size: ranks that share one sequence (each holds ``1 / sp_size`` of its tokens). The world
            size (devices x num_nodes) must be a multiple (refused when the Trainer is built, before any process
            starts); ``dp_size = world_size / sp_size``.
            ``"auto"``: all processes of a node (SP inside each node, DP across nodes).
        ring_size: Ulysses x Ring (:mod:`lightning_ulysses.attention.ring`): each SP group runs Ulysses over
            ``sp_size / ring_size`` consecutive ranks (inside a node) and ring attention across ``ring_size`` such
            groups (``world = dp x ring x ulysses``); ``1`` (default): Ulysses only. ``"auto"``: the Ulysses degree is
            the largest divisor of ``sp_size`` that fits in a node, the ring joins the nodes. Sequences are cut into
            zigzag shards (causal work balanced over the ring); batches, ``gather_sequence`` and the loss keep
            whole-sequence order. Runs torch's SDPA kernels on each block (the flash kernel for CPU, the
            memory-efficient one on CUDA; ``attn_implementation`` ``"auto"`` or ``"sdpa"``), without attention dropout;
            the kernels of the device are checked against float64 at set-up (refused where they are not exact).
        attn_implementation: core attention kernel run on the gathered sequence: ``"auto"`` (on CUDA in fp16/bf16:
            SDPA's cuDNN kernels on Hopper and later, else flash-attn 2 when installed, else SDPA; fp32 and CPU:
            SDPA), ``"sdpa"``, ``"sdpa_cudnn"`` (SDPA's cuDNN backend for every call cuDNN covers, by torch's own
            check; the others run as ``"sdpa"``), ``"flash_attention_2"``, ``"flash_attention_3"`` or
            ``"flex_attention"`` (see docs/attention-backends.md).
        head_chunks: run each attention layer's all-to-alls and attention in this many chunks of each rank's heads
            (:mod:`lightning_ulysses.attention.head_chunks`): one all-to-all per chunk for q, k and v together and
            one back, the layer's backward run chunk by chunk, so its whole-sequence tensors are one chunk's
            (``1 / head_chunks`` of plain Ulysses'), each chunk's kernel backward run from its kept graph (q, k, v
            and the output gathered again; a kernel that saves more is run again); on CUDA the
            next chunk's all-to-all overlaps the current chunk's attention. Where a transformers attention module
            computes each head from its own rows of ``nn.Linear`` projections (found by the set-up check, which
            compares the chunks with the whole module: Llama, Mistral, Qwen, Gemma, ...), the module itself runs
            once per chunk with its projections narrowed to the chunk's heads, so that the layer keeps only its
            input for the backward (:mod:`lightning_ulysses.hf.projections`); per chunk its attention then runs as
            plain Ulysses on the chunk's heads. ``"auto"``: the fewest chunks whose whole-sequence q, k, v and
            output fit in the bytes of the layer's query shard. ``None`` (default): all heads at once (one
            all-to-all in, q, k and v together, and one out). Exact with every path: Ulysses x Ring, sinks, packed
            documents, windows, any head count.
        loss_normalization: ``"sp_group"`` (default): each SP group's token mean, averaged over DP groups as
            DDP does. ``"global"``: the token mean over every valid token of the optimizer step, all DP
            groups and accumulation micro-batches together (see :mod:`lightning_ulysses.loss`).
        nonfinite_loss: what a NaN or inf training loss on any rank does (checked on every rank with one
            all-reduce of ``world_size`` flags per micro-batch): ``"raise"`` the same error on all ranks, naming
            the step and the ranks; ``"skip"`` warn likewise and skip the optimizer step (no weight or optimizer
            state update; DeepSpeed ZeRO stage 1-3 only, see :mod:`lightning_ulysses.runtime.failures`); ``"off"``:
            no check.
        tiled_mlp: run each decoder layer's feed-forward in tiles of the sequence, recomputed in the backward:
            ``True`` (tiles of ``hidden_size`` tokens) or a number of tiles. The feed-forwards are found by what they
            do (the children of a decoder layer that map its hidden states alone to hidden states: dense MLPs and
            mixture-of-experts blocks alike), and each is tiled where its tiles, run at set-up, equal its whole call
            (router logits and scores included); one that is not token-wise is left whole and named in the report.
        tiled_loss: number of token tiles (or ``True``: sized by bytes, see :mod:`lightning_ulysses.logits`) for the
            logits + loss of :meth:`~lightning_ulysses.UlyssesLossMixin.forward_causal_lm_loss`, which then never
            materialises the ``[tokens, vocab]`` logits; each tile gets the scaling or soft-cap the model applies
            outside ``lm_head``, as the set-up check found it (:mod:`lightning_ulysses.hf.check.logits`), and a model
            whose logits follow otherwise is refused at set-up.
        activation_checkpointing: keep only each decoder layer's inputs, recompute the layer in the backward. A fit
            whose trainable layers are in eval mode (transformers then checkpoints nothing) is refused at set-up; a
            model loaded in eval mode (``from_pretrained``) is put in train mode first
            (:mod:`lightning_ulysses.train_mode`).
        offload_activations: keep those inputs in CPU memory (pinned) instead of on the GPU.
        fused_norms: run every RMSNorm and LayerNorm whose forward is found (by running it) to compute exactly what
            :func:`~lightning_ulysses.norms.rms_norm` / :func:`~lightning_ulysses.norms.layer_norm` do as those: the
            same output, and only its input and per-token statistics kept for the backward instead of float copies of
            the whole normalised tensor (``nn.LayerNorm``'s kernel already keeps only those, and is kept); Mamba 2's
            gated RMSNorm as :func:`~lightning_ulysses.norms.gated_rms_norm`. A call with arguments a fused form does
            not take (a gate applied after the norm) runs the module's own forward.
        sequence_mixers: what to do with token mixers other than attention (convolutions over the sequence, linear
            attention, state-space layers) that have no head-sharded form (those of transformers' hybrid families
            have one and always use it, see :mod:`lightning_ulysses.hf.mixers`) and that the set-up check finds:
            ``"refuse"`` the model (default), or ``"gather"``: run each on the whole sequence on every rank (exact, at
            ``sp_size`` times their compute and with their activations at full length).
        check_loss_reduction: refuse (``True``, default) a training step at ``sp_size > 1`` whose loss went through
            none of the package's exact reductions over the SP group (``UlyssesLossMixin``'s ``causal_lm_loss``,
            ``forward_causal_lm_loss``, ``reduce_token_loss``; a transformers model called with ``labels=`` or
            ``shift_labels=``; DPO's): a plain mean such as ``F.cross_entropy(logits, batch["shift_labels"])`` is the
            mean of this rank's shard, so the logged loss is one shard's and, where the shards' token counts differ,
            the update is wrong. A flag per step, no extra computation. ``False``: for a ``training_step`` that
            reduces its loss over the SP group exactly by itself.
        compile_layers: ``torch.compile`` each decoder layer on its own (regional compilation, as torchtitan compiles
            per block; :mod:`lightning_ulysses.compile`), in place, after the options above: one compilation per
            layer class reused by every layer, the Ulysses all-to-alls run eagerly between compiled regions. With
            ``activation_checkpointing`` each child of a layer is compiled instead (norms, feed-forward; dynamo
            compiles nothing of a checkpointed frame with a graph break, and the all-to-alls are one). Not where the
            engine shards parameters per module (ZeRO-3, FSDP2: refused; ZeRO-3's per-module hooks cut the layers
            apart). The first step pays the compilation, each new sequence length one more until the shapes are
            dynamic. Results equal the eager model's to float rounding.
        liger_kernels: LinkedIn's Triton kernels (:mod:`lightning_ulysses.liger`; ``pip install
            'lightning-ulysses[liger]'``, CUDA): ``True`` or a list of ``"cross_entropy"`` (Liger's fused linear cross
            entropy as the ``tiled_loss`` path, with the logit scaling or soft-cap the set-up check found; not where
            the engine shards parameters: ZeRO-3, FSDP2), ``"rms_norm"`` (the RMSNorms found to compute Llama's or
            Gemma's form; not with ``fused_norms``) and ``"swiglu"`` (the feed-forwards found to compute
            ``down(silu(gate(x)) * up(x))``). Refused at construction without the packages, at set-up off CUDA and
            where a kernel finds nothing to replace.
        **engine_kwargs: the engine strategy's own arguments (:class:`~lightning_ulysses.UlyssesStrategy`:
            DeepSpeed's; :class:`~lightning_ulysses.UlyssesFSDPStrategy`: its own and Lightning's
            ``ModelParallelStrategy``'s).

    Dropout: in training, the transformers models draw their dropout masks from an RNG stream of their SP rank
    (seeded at set-up from the run's seed and the SP rank; :mod:`lightning_ulysses.hf.dropout`), so the ranks of an
    SP group draw independent masks for their tokens and heads with one process's keep rate, not one process's bits;
    everything outside the model's forward keeps the shared generator state.
    """

    num_nodes: int  # both engines' Lightning strategies define these
    num_processes: int

    def __init__(
        self,
        sp_size: int | Literal["auto"] = "auto",
        attn_implementation: str = "auto",
        ring_size: int | Literal["auto"] = 1,
        loss_normalization: Literal["sp_group", "global"] = "sp_group",
        nonfinite_loss: NonFiniteLoss = "raise",
        tiled_mlp: TileSetting = False,
        tiled_loss: TileSetting = False,
        activation_checkpointing: bool = False,
        offload_activations: bool = False,
        fused_norms: bool = False,
        sequence_mixers: SequenceMixers = "refuse",
        head_chunks: HeadChunks | None = None,
        check_loss_reduction: bool = True,
        compile_layers: bool = False,
        liger_kernels: bool | list[str] = False,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__(**engine_kwargs)
        self.memory = MemoryOptions(tiled_mlp, tiled_loss, activation_checkpointing, offload_activations, fused_norms)
        if sp_size != "auto" and (isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1):
            raise ValueError(f"sp_size must be a positive integer or 'auto', got {sp_size!r}.")
        if attn_implementation != "auto":
            resolve_attn_implementation(attn_implementation, "cuda")  # refuse unknown names before any work
        if sequence_mixers not in ("refuse", "gather"):
            raise ValueError(f"sequence_mixers must be 'refuse' or 'gather', got {sequence_mixers!r}.")
        _check_ring_options(ring_size, sp_size, attn_implementation)
        check_head_chunks(head_chunks)
        self.head_chunks = head_chunks
        self._requested_ring_size = ring_size
        self.sequence_mixers = sequence_mixers
        self._requested_sp_size = sp_size
        self._requested_attn_implementation = attn_implementation
        if loss_normalization not in ("sp_group", "global"):
            raise ValueError(f"loss_normalization must be 'sp_group' or 'global', got {loss_normalization!r}.")
        self.loss_normalization = loss_normalization
        self.nonfinite_loss = NonFiniteLossGuard(nonfinite_loss)
        self._topology: SequenceParallelTopology | None = None
        self._groups: SequenceParallelGroups | None = None
        self._heartbeat: Heartbeat | None = None
        self._quiet: Installed | None = None  # the run's filters of harmless third-party messages
        self._applied_steps = 0  # Lightning's global step once it has counted the last step the engine applied
        self._batch: ShardedBatch | None = None  # the running batch (batch_to_device), see sharded_batch
        self._step_tokens: StepTokenCounts | None = None  # the training loader's wrapper under "global"
        self._repeated_rows = RepeatedRows()  # noted by the evaluation loaders' wrappers, taken per batch
        self._train_batch_shape: tuple[int, int] | None = None  # [B, N] of the last training batch, before padding
        self.check_loss_reduction = check_loss_reduction
        self._exact_loss_reductions = 0  # in the running training step (see check_loss_reduction)
        if compile_layers and self.parameters_sharded:
            raise ValueError(
                "compile_layers runs where the engine keeps each layer's parameters whole (ZeRO stages 1 and 2): under "
                "ZeRO-3 DeepSpeed's parameter hooks on every submodule run outside compiled code "
                "(torch.compiler.disable), cutting each layer into per-module pieces while dynamo recompiles "
                "DeepSpeed's own code; FSDP2's per-layer sharding is not supported with it yet. Set stage=2 (or 1) "
                "on UlyssesStrategy, or compile_layers=False."
            )
        self.compile_layers = compile_layers
        self.liger_kernels = check_liger_kernels(liger_kernels)
        if fused_norms and "rms_norm" in self.liger_kernels:
            raise ValueError(
                "fused_norms and liger_kernels 'rms_norm' both replace the RMSNorms: keep one (fused_norms keeps less "
                "for the backward; Liger's kernel is one Triton launch)."
            )
        self.memory_report = MemoryReport()
        """What each asked memory option (and ``head_chunks``) applies to, found at set-up and logged at fit start."""

    # ------------------------------------------------------------------------------------------
    # topology
    # ------------------------------------------------------------------------------------------
    @property
    def topology(self) -> SequenceParallelTopology:
        if self._topology is None:
            raise RuntimeError("The sequence-parallel topology exists once the Trainer has set up its processes.")
        return self._topology

    @property
    def sp_size(self) -> int:
        """Ranks that share one sequence: the configured value, also before set-up; ``"auto"`` (the processes of a
        node) is known once a Trainer holds the strategy."""
        if self._topology is not None:
            return self._topology.sp_size
        if self._requested_sp_size != "auto":
            return self._requested_sp_size
        if not self.parallel_devices:
            raise RuntimeError(
                "sp_size='auto' is the number of processes per node, known once a Trainer holds this strategy "
                "(L.Trainer(devices=..., strategy=...)); give an integer sp_size to know it before."
            )
        return self.num_processes

    @property
    def sp_rank(self) -> int:
        return self.topology.sp_rank

    @property
    def ring_size(self) -> int:
        """Ring degree of Ulysses x Ring (1: Ulysses only); ``sp_size / ring_size`` is the Ulysses degree."""
        return self.topology.ring_size

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size

    @property
    def dp_rank(self) -> int:
        return self.topology.dp_rank

    @property
    def groups(self) -> SequenceParallelGroups:
        """This rank's process groups (SP, DP, and Ulysses and ring with ``ring_size > 1``), its layout, the per-batch
        cache of its documents and the observer of its all-to-alls: what ``ulysses_attention(group=...)`` and
        ``gather_sequence`` take to run exactly under every layout, Ulysses x Ring included."""
        if self._groups is None:
            raise RuntimeError("The sequence-parallel groups exist once the Trainer has set up its processes.")
        return self._groups

    @property
    def device_mesh(self) -> DeviceMesh:
        """The process grid: a ``DeviceMesh`` with the axes ``dp``, ``ring`` and ``ulysses`` and ``sp`` (``ring`` x
        ``ulysses`` flattened; see :func:`~lightning_ulysses.groups.build_mesh`), built once at set-up."""
        mesh = self.groups.mesh
        assert mesh is not None  # set-up builds the grid's mesh
        return mesh

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        """The process group of the ranks sharing this rank's sequences (the attention takes :attr:`groups` or
        :attr:`device_mesh`, which carry the ring)."""
        self.topology  # noqa: B018 - raises before set-up
        return None if self._groups is None else self._groups.sp

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The process group of the ranks holding the same shard position in every SP group."""
        self.topology  # noqa: B018 - raises before set-up
        return None if self._groups is None else self._groups.dp

    @property
    def loss_context(self) -> LossContext:
        """What :class:`~lightning_ulysses.UlyssesLossMixin` reduces the current batch's loss with (read per batch)."""
        assert self.lightning_module is not None  # attached by the Trainer before its hooks run
        return LossContext(
            self.groups,
            self.loss_normalization,
            self.loss_gradient_scale,
            self.memory.tiled_loss,
            self._batch,
            self.lightning_module.trainer.accumulate_grad_batches,
            self._record_exact_reduction,
            "cross_entropy" in self.liger_kernels,
        )

    @property
    def sharded_batch(self) -> ShardedBatch | None:
        """The batch this rank is running, as :meth:`batch_to_device` cut it (:class:`~lightning_ulysses.batch.
        ShardedBatch`: the step's input shards, the whole position ids and their documents, the padding, the repeated
        rows of evaluation, the step's token count), from its transfer until the next batch's; ``None`` before the
        first. The patched models read their documents from it (no all-gather of the position ids), the loss its
        padding, repeated rows and token count (:attr:`loss_context`)."""
        return self._batch

    def _record_exact_reduction(self) -> None:
        self._exact_loss_reductions += 1

    def _labels_loss(self, logits: Tensor, labels: Tensor | None, shift_labels: Tensor | None, ignore: int) -> Tensor:
        """The loss of a patched model called with ``labels=`` / ``shift_labels=``: the SP-exact token mean."""
        return labels_loss(self.loss_context, logits, labels, shift_labels, ignore)

    @property
    def attn_implementation(self) -> str:
        """The resolved core attention backend (``"auto"`` is resolved from the device and the precision at set-up);
        a flash backend asked for fp32 is refused here; Ulysses x Ring runs SDPA."""
        if self._topology is not None and self.ring_size > 1:
            return "sdpa"
        device = self.root_device
        return resolve_attn_implementation(
            self._requested_attn_implementation,
            device.type,
            compute_dtype(self.precision_plugin.precision),
            torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
        )

    @property
    def parameters_sharded(self) -> bool:
        """Whether the engine keeps each parameter sharded over the ranks outside its module's forward (ZeRO-3,
        FSDP2): ``compile_layers`` and Liger's fused loss (which reads ``lm_head``'s whole weight) are refused then."""
        raise NotImplementedError(f"{type(self).__name__} must say whether it shards parameters")

    @property
    def loss_gradient_scale(self) -> float:
        """Factor on each rank's ``local_loss_sum / group_valid_tokens`` that makes gradients exact.

        Both engines average gradients over all ``dp * sp`` ranks (see the module docstring).
        """
        return float(self.sp_size)

    # ------------------------------------------------------------------------------------------
    # processes and devices
    # ------------------------------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        # the Trainer's constructor calls it once the processes are known: a layout that cannot run is refused here,
        # in the user's process, before a launcher starts any other
        self._layout()
        super()._configure_launcher()

    def _layout(self) -> tuple[int, int]:
        """``(sp_size, ring_size)`` with ``"auto"`` resolved from the processes per node; raises ``ValueError`` for a
        layout that does not fit the world size."""
        sp_size = self.num_processes if self._requested_sp_size == "auto" else self._requested_sp_size
        ring_size = self._requested_ring_size
        if ring_size == "auto":
            ring_size = auto_ring_size(sp_size, self.num_processes) if self.world_size % sp_size == 0 else 1
            _check_ring_options(ring_size, sp_size, self._requested_attn_implementation)
        SequenceParallelTopology(self.world_size, sp_size, 0, ring_size)
        return sp_size, ring_size

    def _create_topology(self) -> None:
        """This rank's place in the ``[dp, sp]`` grid, once the world's ranks are set (before any process group); the
        ring's block kernels are checked here, and SP groups that span nodes are warned about."""
        sp_size, ring_size = self._layout()
        self._topology = SequenceParallelTopology(self.world_size, sp_size, self.global_rank, ring_size)
        if ring_size > 1:
            _check_ring_kernels(self.root_device, compute_dtype(self.precision_plugin.precision), ring_size)
        if self.num_nodes > 1 and self._topology.sp_groups_span_nodes(self.num_nodes):
            spanning = next(r for r in self._topology.ulysses_group_ranks if _nodes_of(r, self.num_processes) > 1)
            ulysses = self._topology.ulysses_size
            degree = f"sp_size={sp_size}" if ring_size == 1 else f"The Ulysses degree sp_size / ring_size = {ulysses}"
            groups = "SP groups" if ring_size == 1 else "Ulysses groups"
            rank_zero_warn(
                f"{degree} does not divide the {self.num_processes} processes per node, so {groups} span nodes (ranks "
                f"{spanning} are on {_nodes_of(spanning, self.num_processes)} nodes) and every attention layer runs "
                "its all-to-alls over the network instead of inside a node. If that is not intended, set sp_size to "
                "one of "
                f"{divisors(self.num_processes)} (SP inside each node, DP across nodes), or ring_size='auto' (Ulysses "
                "inside each node, ring attention across nodes)."
            )

    def _create_groups(self, timeout: timedelta | None) -> None:
        """The SP, DP (and Ulysses and ring) process groups and the heartbeat, once the world's group exists."""
        # subgroups do not inherit the default group's timeout: without it a stalled rank holds its peers for torch's
        # default
        self._groups = SequenceParallelGroups.create(self.topology, self.root_device.type, timeout)
        self._heartbeat = Heartbeat(lightning_engine.default_store(), self.global_rank, self.world_size)
        self._heartbeat.start()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    # ------------------------------------------------------------------------------------------
    # model, batches, backward
    # ------------------------------------------------------------------------------------------
    def _before_engine_setup(self, trainer: Any) -> None:
        """What the model needs before the engine wraps it."""
        keep_last_checkpoint_current(trainer.callbacks)
        if trainer.state.fn == TrainerFn.FITTING:
            assert self.lightning_module is not None
            train_loaded_models(self.lightning_module)  # from_pretrained's eval mode would skip checkpointing, dropout

    def _apply_sequence_parallel(self, trainer: Any) -> None:
        """Patch every transformers model of the LightningModule for Ulysses and apply the memory options (both
        checked by running the model: every rank must hold the weights it runs, whole or gathered by the engine), log
        what they apply to, and install the preemption signals."""
        assert self.lightning_module is not None
        refuse_liger_setup(self.liger_kernels, self.root_device.type, self.parameters_sharded, self.memory.tiled_loss)
        apply_ulysses_attention(
            self.lightning_module,
            self.groups,
            self.attn_implementation,
            self.sequence_mixers,
            self.head_chunks,
            self._labels_loss,
            tiled_loss=bool(self.memory.tiled_loss),
            batches=lambda: self._batch,
        )
        # refuses a model whose logits do not tile, before any other option's work; fitting with lm_head's parameters
        # whole on the rank (the fused training loss), also one whose lm_head reads a trainable tensor not its own
        fitting = trainer.state.fn == TrainerFn.FITTING
        logit_maps = (
            check_tiled_logits(self.lightning_module, fused_training=fitting and not self.parameters_sharded)
            if self.memory.tiled_loss
            else None
        )
        # before the memory options: tiled_mlp tiles the feed-forward Liger's SwiGLU makes
        liger_rows = apply_liger_kernels(self.lightning_module, self.liger_kernels) if self.liger_kernels else []
        self.memory_report = apply_memory_options(self.lightning_module, self.memory, fitting=fitting)
        self.memory_report.rows.extend(liger_rows)
        if self.head_chunks is not None:
            plans = [patch.plan for patch in patches(self.lightning_module)]
            self.memory_report.rows.append(head_chunks_row(plans, self.head_chunks))
        if self.memory.tiled_loss:
            self.memory_report.rows.append(tiled_loss_row(self.memory.tiled_loss, logit_maps))
        if self.compile_layers:  # last: each layer compiles what the options above made of it, at its first call
            self.memory_report.rows.append(compile_decoder_layers(self.lightning_module))
        if self.memory_report.rows:
            rank_zero_info(self.memory_report.table())
        if not isinstance(lightning_engine.signal_connector(trainer), PreemptionSignals):
            lightning_engine.replace_signal_connector(trainer, PreemptionSignals(trainer))

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        assert self.lightning_module is not None  # attached by the Trainer before its hooks run
        trainer = self.lightning_module.trainer
        batches_before = trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1  # this batch is counted
        if batches_before % trainer.accumulate_grad_batches == 0:  # an optimizer step begins: a safe point
            lightning_engine.signal_connector(trainer).at_step_boundary(trainer)
        super().on_train_batch_start(batch, batch_idx)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        assert self.lightning_module is not None  # attached by the Trainer before its hooks run
        trainer = self.lightning_module.trainer
        loader_name = _loader_name(trainer)
        sampler_over_dp_ranks(dataloader, self.topology, loader_name)
        warn_on_forked_workers(dataloader, loader_name)
        # seed_everything(workers=True): seeded by DP rank, on the loader itself (Lightning seeds what this returns, by
        # global rank, and would give the SP ranks of a group different augmentations; see lightning_ulysses.sp_loaders)
        lightning_engine.add_worker_init_fn(dataloader, self.dp_rank)
        if not trainer.training:
            return pad_over_dp_ranks(dataloader, self._repeated_rows)
        if is_resumable(dataloader):
            dataloader = ResumableLoader(
                dataloader, trainer.fit_loop, self.dp_size, lambda: self.optimizer_step_in_flight
            )
        if self.loss_normalization == "global":
            fit_loop = trainer.fit_loop
            dataloader = self._step_tokens = StepTokenCounts(
                dataloader,
                trainer.accumulate_grad_batches,
                lambda: fit_loop.max_batches - fit_loop.epoch_loop.batch_progress.current.ready,
            )
        return dataloader

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """The loader's ``batch`` on the device, checked to be the same on every rank of the SP group, and cut to this
        rank's shards: the dict that the LightningModule's step receives. The whole batch, as one
        :class:`~lightning_ulysses.batch.ShardedBatch`, is :attr:`sharded_batch` until the next one."""
        assert self.lightning_module is not None  # attached by the Trainer before its hooks run
        trainer = self.lightning_module.trainer
        input_ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        repeated_rows = self._repeated_rows.take(input_ids) if isinstance(input_ids, Tensor) else None
        step_valid_tokens = self._step_tokens.take() if self._step_tokens is not None and trainer.training else None
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.sp_size > 1:
            sp_group = self.sp_group
            assert sp_group is not None  # set up, with more than one rank
            check_sp_group_agreement(batch, sp_group, device or self.root_device, _loader_name(trainer, dataloader_idx))
        self._batch = shard_loader_batch(
            batch, self.sp_rank, self.sp_size, self.ring_size, repeated_rows, step_valid_tokens
        )
        if trainer.training:  # for the out-of-memory line
            self._train_batch_shape = self._batch.loaded_shape
        return self._batch.inputs

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._exact_loss_reductions = 0
        output = super().training_step(*args, **kwargs)
        loss = output["loss"] if isinstance(output, Mapping) else output
        if isinstance(loss, Tensor):
            assert self.lightning_module is not None  # attached by the Trainer before its hooks run
            trainer = self.lightning_module.trainer
            if self.check_loss_reduction and self.sp_size > 1 and not self._exact_loss_reductions:
                raise RuntimeError(_unreduced_loss_message(self.sp_size, trainer.global_step))
            self.nonfinite_loss.check_loss(loss, trainer.global_step, trainer.fit_loop.epoch_loop.batch_idx)
        return output

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # Lightning calls this at the last micro-batch of each step only
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self.lightning_module is not None  # attached by the Trainer before its hooks run
        global_step = self.lightning_module.trainer.global_step  # counted once the LightningModule hook returns
        self._applied_steps = global_step + 1
        self.nonfinite_loss.check_step(self._step_applied(), global_step)
        return output

    def _step_applied(self) -> bool:
        """Whether the engine applied the optimizer step that just ran (DeepSpeed skips one whose gradients are not
        finite)."""
        return True

    @property
    def repeated_rows(self) -> Tensor | None:
        """``[B]`` bool on the current evaluation or prediction batch: True for the rows that the distributed sampler
        repeated to even out the DP ranks (their ``shift_labels`` are all ``-100``); ``None`` when it has none."""
        return None if self._batch is None else self._batch.repeated_rows

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._weigh_out_repeated_rows()
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._weigh_out_repeated_rows()
        return super().test_step(*args, **kwargs)

    def _weigh_out_repeated_rows(self) -> None:
        """Lightning averages a value logged in an evaluation step over the batches of all ranks, each weighted by its
        batch size (the batch's length unless ``self.log`` is given ``batch_size``): count a batch's real rows only,
        so that its repeats weigh 0 (a batch of repeats, whose labels are all masked, weighs nothing)."""
        assert self.lightning_module is not None  # attached by the Trainer before its hooks run
        if self.repeated_rows is not None:
            lightning_engine.set_logged_batch_size(self.lightning_module.trainer, int((~self.repeated_rows).sum()))

    @property
    def optimizer_step_in_flight(self) -> bool:
        """Whether the engine has run an optimizer step that Lightning has not counted yet (inside
        ``optimizer_step``)."""
        assert self.lightning_module is not None  # attached by the Trainer before its hooks run
        return self._applied_steps > self.lightning_module.trainer.global_step

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        output = super().predict_step(*args, **kwargs)
        if self.repeated_rows is None:
            return output
        keep = ~self.repeated_rows
        drop_rows(args[0] if args else kwargs["batch"], keep)  # the batch that on_predict_batch_end and writers see
        return drop_rows(output, keep)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """As DDP's, but the mean of an integer tensor in float64: Lightning averages its integer batch-size sums of
        ``self.log(..., sync_dist=True)`` that way, and DDP's mean would truncate them where the ranks' sums differ
        (an evaluation whose repeated rows weigh 0, see :meth:`repeated_rows`)."""
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if mean and isinstance(tensor, Tensor) and not tensor.is_floating_point():
            tensor = tensor.double()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[safe-super]  # the engine's

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """``[world, *tensor.shape]``. Without ``sync_grads`` a plain ``dist.all_gather``: Lightning's gathers through
        ``torch.distributed.nn.functional.all_gather``, which torch deprecates with a warning on every call."""
        if sync_grads or not dist.is_initialized():
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        return torch.stack(gather_from_ranks(tensor.detach(), group))

    def gather_sequence(self, local: Tensor) -> Tensor:
        """``[B, N/sp, ...]`` per-token outputs of this rank -> ``[B, N, ...]`` in sequence order (the zigzag of a ring
        undone), on every SP rank."""
        return gather_sequence(local, self.groups)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A collective that failed because a peer died names no rank: name the ranks whose heartbeat stopped and
        the checkpoint to resume from, in the log and as the last line of the traceback (a note on the exception).
        Out of memory: rank 0 logs one line with the options that would fit the sequence and, in a training step of a
        transformers model, the estimated activation memory per rank with and without them
        (:mod:`lightning_ulysses.runtime.out_of_memory`); the exception is raised as it was."""
        if is_out_of_memory(exception) and self._topology is not None and self.global_rank == 0:
            advice = out_of_memory_advice(
                exception,
                self.memory,
                self.head_chunks,
                self.sp_size,
                self.world_size,
                self.root_device.type == "cuda",
                self._failed_step_shape(),
            )
            log.error(advice)
        if isinstance(exception, RuntimeError) and self._heartbeat is not None:
            report = self._heartbeat.dead_ranks_report()
            if report:
                assert self.lightning_module is not None  # attached by the Trainer before its hooks run
                message = f"lightning-ulysses: {report}. {_resume_hint(self.lightning_module.trainer)}"
                log.error(rank_prefixed_message(message, self.global_rank))
                if hasattr(exception, "add_note"):  # Python 3.11+
                    exception.add_note(message)

    def _failed_step_shape(self) -> StepShape | None:
        """The training step that failed, for the out-of-memory line's estimate (``None`` outside a training step)."""
        module = self.lightning_module
        if module is None or not module.trainer.training:
            return None
        return StepShape.read(module, self._train_batch_shape, self.ring_size)

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None:
            remove_ulysses_attention(self.lightning_module)
            remove_compiled_layers(self.lightning_module)  # first: it compiled what the memory options made
            remove_memory_options(self.lightning_module)
            remove_liger_kernels(self.lightning_module)  # last: the memory options tiled what it made
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        self._train_batch_shape = None
        self._batch = self._step_tokens = None
        super().teardown()
        if self._quiet is not None:
            self._quiet.remove()
            self._quiet = None

    def _quiet_run(self) -> None:
        """Install the run's filters of harmless third-party messages (removed at :meth:`teardown`); first thing in
        the engine's ``setup_environment``: setting up the processes imports DeepSpeed, which logs as it is imported."""
        if self._quiet is None:
            self._quiet = install(RUN)


def _check_ring_options(ring_size: Any, sp_size: Any, attn_implementation: str) -> None:
    """Refuse what Ulysses x Ring cannot run, at construction (``"auto"``: once resolved, at set-up); the attention
    layers refuse the rest (``check_ring_supported`` in :mod:`lightning_ulysses.attention.ulysses`)."""
    check_ring_size(ring_size, sp_size if isinstance(sp_size, int) else None, auto=True)
    if ring_size in ("auto", 1):
        return
    if attn_implementation not in ("auto", "sdpa"):
        raise ValueError(
            f"Ulysses x Ring (ring_size={ring_size!r}) runs its own block kernels (torch's SDPA kernels, which return "
            f"the log-sum-exp), not attn_implementation={attn_implementation!r}. Set attn_implementation='sdpa' (or "
            "'auto'), or ring_size=1 for Ulysses only."
        )


def _check_ring_kernels(device: torch.device, dtype: torch.dtype, ring_size: int) -> None:
    """Refuse Ulysses x Ring on a device whose block kernels are not exact in ``dtype`` (or fp32), checked on a small
    problem against float64 (:func:`~lightning_ulysses.attention.ring_blocks.check_block_kernels`), before any step."""
    failures = [f for d in dict.fromkeys((torch.float32, dtype)) for f in check_block_kernels(device, d)]
    if failures:
        raise ValueError(
            f"Ulysses x Ring (ring_size={ring_size}): the ring's block kernels on {device} do not compute attention "
            f"exactly here (checked at set-up against float64 attention: {'; '.join(failures)}). Use ring_size=1 "
            "(Ulysses only) on this machine."
        )


def _unreduced_loss_message(sp_size: int, step: int) -> str:
    return (
        f"The loss of training step {step} went through none of lightning-ulysses' reductions over the SP group "
        f"(sp_size={sp_size}): each rank holds 1/{sp_size} of every sequence, so a plain mean such as "
        "F.cross_entropy(logits, batch['shift_labels']) is this rank's shard's (the logged loss is one shard's and, "
        "where the shards hold different numbers of valid tokens, the update differs from one process on whole "
        "sequences). Mix UlyssesLossMixin into the LightningModule and return "
        "self.forward_causal_lm_loss(model, batch), self.causal_lm_loss(logits, batch['shift_labels']) or "
        "self.reduce_token_loss(loss_sum, num_valid_tokens); or call the transformers model with "
        "labels=batch['input_ids'] (or shift_labels=batch['shift_labels']) and return its .loss. If the step "
        "already reduces its loss over the SP group exactly, pass UlyssesStrategy(check_loss_reduction=False)."
    )


def _resume_hint(trainer: Any) -> str:
    """Where a failed fit can go on from: the last checkpoint that ``ModelCheckpoint`` wrote, if any."""
    callback = trainer.checkpoint_callback
    last = (callback.last_model_path or callback.best_model_path) if callback is not None else ""
    if not last or trainer.state.fn != TrainerFn.FITTING:
        return "Resume from the last checkpoint the run saved (ckpt_path)."
    return f"Resume from the last checkpoint with --ckpt_path {last} (ckpt_path={last!r})."


def _loader_name(trainer: Any, dataloader_idx: int = 0) -> str:
    """The hook that made the loader of the running stage, e.g. ``"train_dataloader"``, for messages."""
    stage = trainer.state.stage
    name = f"{stage.dataloader_prefix}_dataloader" if stage is not None else "dataloader"
    return f"{name} (dataloader_idx={dataloader_idx})" if dataloader_idx else name


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the attention kernels see under Lightning's ``precision`` setting ("bf16-mixed", "16-true", ...)."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    return torch.float16 if precision.startswith("16") else torch.float32


def _nodes_of(ranks: list[int], processes_per_node: int) -> int:
    """How many nodes the global ``ranks`` live on (launchers number ranks node by node)."""
    return len({rank // processes_per_node for rank in ranks})
