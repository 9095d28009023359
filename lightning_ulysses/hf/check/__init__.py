"""The set-up check: run a patched model once on a few tokens and refuse it unless every layer is exact.

Detection is by what the model does, not by its name. A few short ``no_grad`` forwards in eval mode
(two rows of ``N = sp * PROBE_TOKENS_PER_RANK`` tokens), with every attention layer replaced by
*token-local attention* (each token attends only to itself: ``out = v * sigmoid(scale * q.k)``, so
queries, keys and values all still matter, but no information moves between tokens through attention). Under ZeRO-3
each call of the model finds the parameters that modules read outside their own module's call as DeepSpeed's engine
does in a step (:mod:`~lightning_ulysses.hf.check.zero3`):

1. **Whole sequence, one rank.** transformers builds its masks through
   :func:`~lightning_ulysses.hf.masks.recording_mask_interface`; each attention layer's call is read
   (:func:`~lightning_ulysses.hf.interface.read_layer_call`): the mask pattern it receives (windows and
   chunks applied only through the mask included) and its arguments (sinks; soft-capping, bidirectional
   attention, model-computed biases are refused). Every module's inputs and outputs are kept. From them and one
   plain forward more, with ``tiled_loss`` only: how the logits follow from the decoder's final hidden states (a
   constant factor, a tanh soft-cap: :mod:`~lightning_ulysses.hf.check.logits`), which the tiled loss applies per
   tile; the strategy refuses ``tiled_loss`` where they follow otherwise.
2. **Token types.** Where the model takes ``token_type_ids``, the whole-sequence probe runs once more with runs of
   ``1`` in them: layers whose masks make each run bidirectional (Gemma 3's image tokens) are planned with
   bidirectional spans (:mod:`~lightning_ulysses.hf.check.spans`).
3. **Position numbering.** The plain model must compute the same with position ids ``0, 1, 2, ...`` as with
   its own (RoBERTa counts from ``padding_idx + 1``): sequence parallelism must pass global ones.
4. **Rotary embeddings** (``sp > 1``): every module that maps ``position_ids`` to a pair of per-token
   tensors (cos, sin) is called with positions around each ``max_position`` boundary of the config; where
   its output depends on the length (dynamic NTK, longrope), it is planned as whole-sequence rotary
   (:func:`~lightning_ulysses.hf.rotary.whole_sequence_rotary`), which must make it exact.
5. **Projections in head chunks** (``head_chunks`` set, ``sp > 1``): each attention layer whose chunks, run with
   its projections narrowed to their heads, sum to its own output and write into its arguments what it writes, and
   which draws no random numbers outside attention, is planned to run so
   (:mod:`~lightning_ulysses.hf.check.projections`).
6. **As in training**: this rank's shard (the whole sequence at ``sp_size=1``), the real SP group, no masks
   built. With attention token-local, no module's per-token output may differ from the whole run: where
   one does, something other than attention moves information between tokens (a convolution over the
   sequence, a recurrent / linear-attention / state-space layer), computes from local token indices, or
   reads the attention mask outside attention (sparse-attention indexers). Every module whose inputs
   agree with the whole run is compared on its own outputs (a small mixer is as visible as a large one)
   and the first that differs is named; the model's output must agree too. ``torch.arange`` over the
   shard's length is trapped as well: an index-dependent computation may change nothing at the probe's
   few tokens (Llama4's temperature tuning starts at index 8192).
7. **The decoder by itself** (the tiled loss's call, on the final plan; with ``tiled_loss`` only): on this rank's
   shard it must return its shard of the whole run's final hidden states, else the plan's logits say why and
   ``tiled_loss`` is refused (:mod:`~lightning_ulysses.hf.check.logits`; a module gathered around the decoder does
   not run in that call).
8. **No gradient of its own** (``sp > 1``): the model, in training mode, on the whole sequence, must give its
   parameters and input embeddings a zero gradient when every output it returns gets one; a module that adds a loss
   only the backward sees (DeepSeek-V2's MoE load-balancing loss) would compute it from each rank's shard and is
   refused (:mod:`~lightning_ulysses.hf.check.gradient`). One forward and backward more at set-up.

The check writes nothing on the model: it returns a :class:`~lightning_ulysses.hf.plan.ModelPlan` (the attention
layers' plans, the head-sharded token mixers, whole-sequence rotary, gathered mixers, the logit map) or a
:class:`~lightning_ulysses.hf.plan.Refusal`, and has each plan it tries on the way realised by the caller's
applier (:meth:`~lightning_ulysses.hf.apply.Patch.realize`). The verdict is agreed over the SP group, so every rank
refuses alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import PreTrainedModel

from lightning_ulysses.hf.check.findings import agreed
from lightning_ulysses.hf.check.gradient import check_own_gradient
from lightning_ulysses.hf.check.logits import check_decoder_call, find_logit_map
from lightning_ulysses.hf.check.projections import plan_projection_chunks
from lightning_ulysses.hf.check.rope import check_rotary
from lightning_ulysses.hf.check.shard import Shard
from lightning_ulysses.hf.check.spans import check_token_types
from lightning_ulysses.hf.check.tensors import modes_restored
from lightning_ulysses.hf.check.training import run_as_in_training
from lightning_ulysses.hf.check.whole import check_position_numbering, whole_sequence_run
from lightning_ulysses.hf.check.zero3 import engine_like_calls
from lightning_ulysses.hf.mixers import is_token_mixer
from lightning_ulysses.hf.plan import NOT_CHECKED, ModelPlan, Refusal
from lightning_ulysses.hf.state import PatchState, model_configs
from lightning_ulysses.logits import LogitMap

PROBE_TOKENS_PER_RANK = 11
"""Tokens per rank in the probe: an odd count, so that the sequence dimension is told from model dimensions."""


def check_model(
    model: PreTrainedModel, state: PatchState, realize: Callable[[ModelPlan], None], *, tiled_loss: bool
) -> ModelPlan | Refusal:
    """Check a patched ``model`` (see the module docstring): its plan, or the refusal that names every layer that
    would not run exactly. ``realize`` brings the model to each plan tried on the way; ``tiled_loss``: whether the
    logit steps run (without them the plan's ``logits`` stay :data:`~lightning_ulysses.hf.plan.NOT_CHECKED`).
    Collective over ``state.group``."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ring_size = state.group.ring_size
    # with a ring the length is a multiple of 2 * sp_size (two zigzag chunks per ring rank)
    tokens_per_rank = PROBE_TOKENS_PER_RANK * (1 if ring_size == 1 else 2)
    input_ids = probe_ids(model, state.sp_size * tokens_per_rank, device)
    position_ids = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
    rank = 0 if state.group.sp is None else dist.get_rank(state.group.sp)
    shard = Shard(rank, state.sp_size, input_ids.shape[1], ring_size)
    plan = ModelPlan(sharded=tuple(name for name, module in model.named_modules() if is_token_mixer(module)))
    realize(plan)
    with modes_restored(model), torch.no_grad(), engine_like_calls(model):
        model.eval()
        findings, whole = whole_sequence_run(model, state, input_ids, position_ids)
        # a forward that failed on one rank only must not leave the others waiting
        findings = agreed(findings, state)
        if not findings:
            logits = find_logit_map(model, state, whole, input_ids, position_ids) if tiled_loss else NOT_CHECKED
            plan = replace(plan, layers=tuple(whole.layers.items()), logits=logits)
            plan = check_token_types(model, state, input_ids, position_ids, plan)
            realize(plan)
            findings = check_position_numbering(model, input_ids, position_ids)
        if state.sp_size > 1 and not findings:
            findings, plan = check_rotary(model, state, whole, shard, plan, realize)
        if not findings:
            plan = plan_projection_chunks(model, state, whole, plan)
            realize(plan)
        if not findings:
            findings, plan = run_as_in_training(model, state, input_ids, position_ids, whole, shard, plan, realize)
        if not findings and isinstance(plan.logits, LogitMap):
            gathered = tuple(g.module for g in plan.gathered)
            logits = check_decoder_call(model, state, whole, shard, input_ids, position_ids, plan.logits, gathered)
            plan = replace(plan, logits=logits)
        if state.sp_size > 1 and not findings:
            findings = agreed(check_own_gradient(model, input_ids, position_ids), state)
    if findings:
        return Refusal(type(model).__name__, tuple(findings), suggest_gather=not state.gather_mixers)
    return plan


def probe_ids(model: PreTrainedModel, length: int, device: torch.device) -> Tensor:
    """``[2, length]`` token ids that are no special token of the config (image, audio, ... placeholders). Two rows:
    a flattened ``[2 * tokens]`` axis is then told from the sequence axis."""
    embeddings = model.get_input_embeddings()
    vocab_size = getattr(embeddings, "num_embeddings", None) or model.config.get_text_config().vocab_size
    special = {
        value
        for config in model_configs(model)
        for key, value in config.to_dict().items()
        if "token" in key and isinstance(value, int)
    }
    ordinary = [i for i in range(min(vocab_size, 4096)) if i not in special]
    generator = torch.Generator().manual_seed(0)
    choice = torch.randint(len(ordinary), (2, length), generator=generator)
    return torch.tensor(ordinary)[choice].to(device)
