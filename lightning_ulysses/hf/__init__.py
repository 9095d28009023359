"""Hugging Face transformers models under Ulysses sequence parallelism: the hook, and the set-up check
that every layer of a patched model runs exactly (or the model is refused).

* :mod:`~lightning_ulysses.hf.patching`: :func:`apply_ulysses_attention` / :func:`remove_ulysses_attention`:
  plan (the check), then apply (the patch);
* :mod:`~lightning_ulysses.hf.state`: what both sides share (the patch state, the refusal, the models inside a module);
* :mod:`~lightning_ulysses.hf.check`: the set-up check, which returns a plan or a refusal (:mod:`.plan`), and finds
  the map from hidden states to logits that ``tiled_loss`` tiles (:func:`tiled_logit_map`);
* :mod:`~lightning_ulysses.hf.apply`: the applier, every change in one ledger (:mod:`.ledger`) with one undo;
* :mod:`~lightning_ulysses.hf.interface`: the ``"ulysses"`` attention-interface entry and each layer's plan;
* :mod:`~lightning_ulysses.hf.forward`: the patched model's forward (position ids, masks, per-batch plans);
* :mod:`~lightning_ulysses.hf.masks`: the attention pattern a model asks for through its masks;
* :mod:`~lightning_ulysses.hf.mixers`: token mixers other than attention run on the whole sequence (opt-in);
* :mod:`~lightning_ulysses.hf.rotary`: length-dependent RoPE computed for the whole sequence;
* :mod:`~lightning_ulysses.hf.projections`: under ``head_chunks``, attention modules run per head chunk with their
  projections inside.
"""

from lightning_ulysses.hf.apply import sequence_parallel_disabled, unpatched
from lightning_ulysses.hf.check.logits import tiled_logit_map
from lightning_ulysses.hf.interface import ULYSSES_ATTN_IMPLEMENTATION
from lightning_ulysses.hf.patching import apply_ulysses_attention, remove_ulysses_attention
from lightning_ulysses.hf.state import SequenceMixers, UnsupportedModelError, outermost_models

__all__ = [
    "ULYSSES_ATTN_IMPLEMENTATION",
    "SequenceMixers",
    "UnsupportedModelError",
    "apply_ulysses_attention",
    "outermost_models",
    "remove_ulysses_attention",
    "sequence_parallel_disabled",
    "tiled_logit_map",
    "unpatched",
]
