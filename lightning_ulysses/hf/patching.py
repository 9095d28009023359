"""The model hook: Ulysses attention inside Hugging Face transformers models, with no model code change.

:func:`apply_ulysses_attention` plans, then applies, for every outermost ``PreTrainedModel`` inside a module:

1. a :class:`~lightning_ulysses.hf.apply.Patch` hooks the model (its configs point at the ``"ulysses"``
   attention implementation of :mod:`lightning_ulysses.hf.interface`, its forward is guarded as
   :mod:`lightning_ulysses.hf.forward` describes);
2. the set-up check (:mod:`lightning_ulysses.hf.check`) runs it by what it does and returns a
   :class:`~lightning_ulysses.hf.plan.ModelPlan` (what each module becomes) or a
   :class:`~lightning_ulysses.hf.plan.Refusal` (every layer that would not run exactly); the patch realises each
   plan the check tries;
3. the plan stays in place, or the refusal undoes the patch and raises :class:`UnsupportedModelError`, before any
   step.

Every change is in the patch's ledger; :func:`remove_ulysses_attention` undoes it. Transformers builds no attention
mask (``"ulysses"`` has no mask interface during training), so nothing of size ``[N, N]`` exists.
"""

from __future__ import annotations

import warnings

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from transformers import PreTrainedModel

from lightning_ulysses.attention.head_chunks import HeadChunks
from lightning_ulysses.batch import BatchSource
from lightning_ulysses.groups import SequenceParallelGroupLike, SequenceParallelGroups
from lightning_ulysses.heads import plan_heads
from lightning_ulysses.hf.apply import Patch, patch_of
from lightning_ulysses.hf.check import check_model
from lightning_ulysses.hf.dropout import SequenceParallelRNG, layerdrop_refusal
from lightning_ulysses.hf.plan import ModelPlan, Refusal
from lightning_ulysses.hf.state import LabelsLoss, PatchState, SequenceMixers, UnsupportedModelError, outermost_models


def apply_ulysses_attention(
    model: nn.Module,
    group: SequenceParallelGroupLike,
    attn_implementation: str | None = None,
    sequence_mixers: SequenceMixers = "refuse",
    head_chunks: HeadChunks | None = None,
    labels_loss: LabelsLoss | None = None,
    batches: BatchSource | None = None,
    *,
    sp_size: int | None = None,
    tiled_loss: bool = True,
    core: str | None = None,
) -> None:
    """Make every transformers ``PreTrainedModel`` inside ``model`` run Ulysses attention over ``group`` (the
    strategy's :class:`~lightning_ulysses.groups.SequenceParallelGroups` or ``DeviceMesh``, Ulysses x Ring included;
    a 1-D ``DeviceMesh``: plain Ulysses over its ranks; ``None``: locally), or refuse it, its core attention the
    backend named ``attn_implementation`` (``"sdpa"``, ... as ``UlyssesStrategy(attn_implementation=...)``; ``core``:
    its deprecated name). The SP degree is the group's (``sp_size``: deprecated, checked against it).

    Any head count runs (see :mod:`lightning_ulysses.heads`; a layout with inert heads is logged with its
    overhead). The model must be callable (under ZeRO-3: after DeepSpeed's engine exists): a short forward
    checks it (:func:`~lightning_ulysses.hf.check.check_model`; collective over ``group``) and raises
    :class:`UnsupportedModelError`, naming the layers, for anything that would not run exactly. Token mixers other
    than attention (convolutions, linear attention, state-space layers) that call transformers' sequential kernels
    run them head-sharded on the whole sequence (:func:`~lightning_ulysses.hf.mixers.sharded_mixer_forward`); any
    other is refused, or with ``sequence_mixers="gather"`` run on the whole sequence on every rank
    (:mod:`lightning_ulysses.hf.mixers.gather`). ``head_chunks``: every layer's
    ``ulysses_attention(head_chunks=...)``, or, where the set-up check finds its projections narrow per head, the
    attention module run per chunk (:mod:`lightning_ulysses.hf.projections`). In training the models draw their
    random numbers (dropout) from this SP rank's stream, seeded here from ``torch.initial_seed()`` and the SP rank
    (:mod:`lightning_ulysses.hf.dropout`). ``labels_loss``: the loss of a call with ``labels=`` (``None``: the
    model's own); ``batches``: the strategy's running :class:`~lightning_ulysses.batch.ShardedBatch`, whose documents
    a forward on its position ids reads instead of all-gathering them (``None``: every forward gathers its shard's).
    ``tiled_loss``: the check also reads how each model makes its logits from
    its decoder's final hidden states, which the tiled loss applies (:mod:`lightning_ulysses.hf.check.logits`;
    :func:`~lightning_ulysses.hf.tiled_logit_map` needs it); the strategy skips that without its ``tiled_loss``.
    Idempotent.
    """
    if core is not None:
        warnings.warn(
            "apply_ulysses_attention(core=...) is deprecated: pass attn_implementation=...",
            DeprecationWarning,
            stacklevel=2,
        )
        if attn_implementation is not None:
            raise TypeError("apply_ulysses_attention got both attn_implementation and its deprecated name core.")
        attn_implementation = core
    if attn_implementation is None:
        raise TypeError("apply_ulysses_attention() missing the attention backend: attn_implementation='sdpa', ...")
    if not isinstance(attn_implementation, str):
        raise TypeError(
            "apply_ulysses_attention(model, group, attn_implementation, ...) takes no sp_size (the group carries it), "
            f"got attn_implementation={attn_implementation!r}: drop the sp_size argument."
        )
    if sequence_mixers not in ("refuse", "gather"):
        raise ValueError(f"sequence_mixers must be 'refuse' or 'gather', got {sequence_mixers!r}.")
    groups = SequenceParallelGroups.of(group)
    if sp_size is not None:
        warnings.warn(
            "apply_ulysses_attention(sp_size=...) is deprecated: the group carries its size.",
            DeprecationWarning,
            stacklevel=2,
        )
        if sp_size != groups.topology.sp_size:
            raise ValueError(f"sp_size={sp_size} is not the group's size, {groups.topology.sp_size}.")
    sp_size = groups.topology.sp_size
    rng = SequenceParallelRNG.of(groups)  # one stream for every model of the module, as one process has
    for hf_model in outermost_models(model):
        if patch_of(hf_model) is not None:
            continue
        refusal = layerdrop_refusal(hf_model, next(hf_model.parameters()).device) if rng is not None else None
        if refusal is not None:
            raise UnsupportedModelError(refusal)
        _log_head_layout(hf_model, groups.topology.ulysses_size)
        patch = Patch(
            hf_model,
            PatchState(
                groups,
                attn_implementation,
                sp_size,
                gather_mixers=sequence_mixers == "gather",
                head_chunks=head_chunks,
                rng=rng,
                labels_loss=labels_loss,
                batches=batches,
            ),
        )
        try:
            outcome = check_model(hf_model, patch.state, patch.realize, tiled_loss=tiled_loss)
        except BaseException:
            patch.undo()
            raise
        if isinstance(outcome, Refusal):
            patch.undo()
            raise UnsupportedModelError(outcome.message())
        patch.realize(outcome)
        _log_plan(hf_model, outcome, sp_size)


def remove_ulysses_attention(model: nn.Module) -> None:
    """Undo :func:`apply_ulysses_attention` on every PreTrainedModel inside ``model``."""
    for hf_model in outermost_models(model):
        patch = patch_of(hf_model)
        if patch is not None:
            patch.undo()


def _log_head_layout(model: PreTrainedModel, sp_size: int) -> None:
    """Log the head layout over the ``sp_size`` ranks of an all-to-all (the Ulysses degree under Ulysses x Ring)."""
    text_config = model.config.get_text_config()
    try:
        num_heads = getattr(text_config, "num_attention_heads", None)
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: head counts that vary per layer
        return  # no one layout to log; the attention layers' own head counts are checked when they run
    if not isinstance(num_heads, int) or not isinstance(num_kv_heads, int):
        return
    if num_heads % num_kv_heads:
        return  # not a grouped-query layout; the attention layers' own head counts are checked when they run
    layout = plan_heads(num_heads, num_kv_heads, sp_size)
    if layout.overhead > 1 or layout.kv_overhead > 1:
        rank_zero_info(
            f"{type(model).__name__}: {layout.num_heads} attention heads / {layout.num_kv_heads} key/value heads over "
            f"sp_size={sp_size} run as {layout.heads_per_rank} / {layout.kv_heads_per_rank} per rank "
            f"({layout.overhead:.2f}x attention compute, {layout.kv_overhead:.2f}x key/value traffic)."
        )


def _log_plan(model: PreTrainedModel, plan: ModelPlan, sp_size: int) -> None:
    """Log the token mixers that run other than on this rank's tokens, and their cost."""
    sharded = plan.sharded
    if sharded and sp_size > 1:
        rank_zero_info(
            f"{type(model).__name__}: {len(sharded)} token mixers outside attention run their sequential kernels on "
            f"the whole sequence for 1/{sp_size} of their heads or channels (all-to-all around each kernel): "
            f"{', '.join(sharded[:4])}{', ...' if len(sharded) > 4 else ''}."
        )
    if plan.gathered:
        rank_zero_info(
            f"{type(model).__name__}: {len(plan.gathered)} token mixers outside attention run on the whole sequence on "
            f"every rank (sequence_mixers='gather'): {', '.join(g.module for g in plan.gathered)}. Exact, at "
            f"{sp_size}x their compute and with their activations at full length."
        )
