"""The model hook: Ulysses attention inside Hugging Face transformers models, with no model code change.

:func:`apply_ulysses_attention` points every (sub-)config of every ``PreTrainedModel`` inside a module at
the ``"ulysses"`` attention implementation (:mod:`lightning_ulysses.hf.interface`; the ``"sdpa"`` and
flash entries stay as they are for other models), tags the modules that hold those configs, wraps each
model's ``forward``, and then checks the model by what it does (:mod:`lightning_ulysses.hf.check`):
every layer runs exactly or the model is refused with :class:`UnsupportedModelError`, before any step.

The wrapped ``forward``:

* requires ``position_ids``, the global positions of the token shard (transformers would otherwise
  build local positions ``0 .. N/sp - 1`` on every rank, and RoPE would be silently wrong on every
  rank but the first), and keeps them for the attention layers: documents (packed samples, padding
  runs) are read from them, whether or not a layer's call site passes them on;
* folds a 2-D ``attention_mask`` into that document layout when it marks whole documents (padding that
  :func:`~lightning_ulysses.prepare_batch` made separate documents), and refuses any other mask;
* switches the KV cache off (it would hold one shard of the sequence).

Transformers builds no attention mask (``"ulysses"`` has no mask interface during training), so nothing
of size ``[N, N]`` exists.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from transformers import PretrainedConfig, PreTrainedModel

from lightning_ulysses.attention import documents_of, gather_sequence, plan_batch
from lightning_ulysses.attention.collectives import ring_layout
from lightning_ulysses.heads import plan_heads
from lightning_ulysses.hf.interface import ULYSSES_ATTN_IMPLEMENTATION


class UnsupportedModelError(ValueError):
    """A model that sequence parallelism cannot run exactly, refused at set-up (before any data or step).

    The message names each offending layer, the feature and what to do instead.
    """


@dataclass
class PatchState:
    """Shared by every module that one :func:`apply_ulysses_attention` call patched."""

    group: ProcessGroup | None
    core: str
    sp_size: int
    position_ids: Tensor | None = None
    """``[B, N/sp]`` global position ids of the shard of the latest forward (kept for recomputation in backward)."""
    enabled: bool = True
    """``False`` inside :func:`unpatched`: the model runs as plain transformers."""
    depth: int = 0
    """Nesting of patched forwards (a vision-language model calls its language model): the outermost one reads the batch."""
    sharded_mixers: bool = False
    """Token mixers run head-sharded (:mod:`lightning_ulysses.hf.mixers`): their document rows are planned per batch."""
    gather_mixers: bool = False
    """Run token mixers other than attention on the whole sequence (:mod:`lightning_ulysses.hf.mixers`) instead of
    refusing the model."""
    agree_tokens: bool = False
    """Set by ``tiled_mlp=True`` (:mod:`lightning_ulysses.memory`): agree once per batch on the most tokens any rank
    holds, so that every MLP call of the batch finds its tile count without a collective or a host sync."""
    batch_tokens: tuple[int, int] | None = None
    """``(this rank's tokens, the most tokens of any rank)`` of the current batch, when ``agree_tokens``."""


def outermost_models(module: nn.Module) -> list[PreTrainedModel]:
    """The outermost transformers ``PreTrainedModel`` instances inside ``module`` (not the models inside them)."""
    found: list[PreTrainedModel] = []
    inner: set[int] = set()
    for sub in module.modules():  # pre-order: a model comes before the models inside it
        if isinstance(sub, PreTrainedModel) and id(sub) not in inner:
            found.append(sub)
            inner.update(id(m) for m in sub.modules())
    return found


SequenceMixers = Literal["refuse", "gather"]


def apply_ulysses_attention(
    model: nn.Module, group: ProcessGroup | None, sp_size: int, core: str, sequence_mixers: SequenceMixers = "refuse"
) -> None:
    """Make every transformers ``PreTrainedModel`` inside ``model`` run Ulysses attention over ``group``, or refuse it.

    Any head count runs (see :mod:`lightning_ulysses.heads`; a layout with inert heads is logged with its
    overhead). The model must be callable (under ZeRO-3: after DeepSpeed's engine exists): a short forward
    checks it (:func:`~lightning_ulysses.hf.check.check_model`; collective over ``group``) and raises
    :class:`UnsupportedModelError`, naming the layers, for anything that would not run exactly. Token mixers other
    than attention (convolutions, linear attention, state-space layers) that call transformers' sequential kernels
    run them head-sharded on the whole sequence (:func:`~lightning_ulysses.hf.mixers.shard_token_mixers`); any
    other is refused, or with ``sequence_mixers="gather"`` run on the whole sequence on every rank
    (:mod:`lightning_ulysses.hf.mixers.gather`).
    Idempotent.
    """
    if sequence_mixers not in ("refuse", "gather"):
        raise ValueError(f"sequence_mixers must be 'refuse' or 'gather', got {sequence_mixers!r}.")
    from lightning_ulysses.hf.check import check_model
    from lightning_ulysses.hf.mixers import shard_token_mixers

    for hf_model in outermost_models(model):
        if "_ulysses_original_attn" in hf_model.__dict__:
            continue
        ring = ring_layout(group)
        _log_head_layout(hf_model, sp_size if ring is None else sp_size // ring.ring_size)
        state = PatchState(group, core, sp_size, gather_mixers=sequence_mixers == "gather")
        _patch(hf_model, state)
        sharded = shard_token_mixers(hf_model, state)
        state.sharded_mixers = bool(sharded)
        _log_sharded_mixers(hf_model, sharded, sp_size)
        try:
            check_model(hf_model, state)
        except BaseException:
            _unpatch(hf_model)
            raise


def _log_head_layout(model: PreTrainedModel, sp_size: int) -> None:
    """Log the head layout over the ``sp_size`` ranks of an all-to-all (the Ulysses degree under Ulysses x Ring)."""
    text_config = model.config.get_text_config()
    try:
        num_heads = getattr(text_config, "num_attention_heads", None)
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: head counts that vary per layer
        return  # no one layout to log; the attention layers' own head counts are checked when they run
    if not isinstance(num_heads, int):
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


def _log_sharded_mixers(model: PreTrainedModel, names: list[str], sp_size: int) -> None:
    if names and sp_size > 1:
        rank_zero_info(
            f"{type(model).__name__}: {len(names)} token mixers outside attention run their sequential kernels on the "
            f"whole sequence for 1/{sp_size} of their heads or channels (all-to-all around each kernel): "
            f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}."
        )


def model_configs(model: PreTrainedModel) -> list[PretrainedConfig]:
    """Every config object of ``model``, its sub-configs (text, vision, ...) included, each once."""
    found: dict[int, PretrainedConfig] = {}
    pending = [sub.config for sub in model.modules() if isinstance(sub, PreTrainedModel)]
    while pending:
        config = pending.pop()
        if id(config) not in found:
            found[id(config)] = config
            pending += [getattr(config, key) for key in config.sub_configs if getattr(config, key, None) is not None]
    return list(found.values())


def _patch(model: PreTrainedModel, state: PatchState) -> None:
    configs = model_configs(model)
    for module in model.modules():  # any of them may call the attention interface
        module._ulysses_state = state
    model._ulysses_original_attn = [(config, config._attn_implementation) for config in configs]
    for config in configs:  # each config by itself: transformers' setter would recurse into the sub-configs
        config._attn_implementation_internal = ULYSSES_ATTN_IMPLEMENTATION
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel):
            sub.forward = _guarded_forward(sub, state)


def _unpatch(model: PreTrainedModel) -> None:
    for config, implementation in model.__dict__.pop("_ulysses_original_attn"):
        config._attn_implementation_internal = implementation
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel) and "forward" in sub.__dict__:
            del sub.forward  # the guard was an instance attribute over the class's forward
        for name in ("_ulysses_state", "_ulysses_plan"):
            sub.__dict__.pop(name, None)
    from lightning_ulysses.hf.mixers import remove_gather_whole_sequence, remove_sharded_mixers
    from lightning_ulysses.hf.rotary import remove_whole_sequence_rotary

    remove_whole_sequence_rotary(model)
    remove_gather_whole_sequence(model)
    remove_sharded_mixers(model)


def remove_ulysses_attention(model: nn.Module) -> None:
    """Undo :func:`apply_ulysses_attention` on every PreTrainedModel inside ``model``."""
    for hf_model in outermost_models(model):
        if "_ulysses_original_attn" in hf_model.__dict__:
            _unpatch(hf_model)


def _guarded_forward(model: PreTrainedModel, state: PatchState) -> Any:
    forward = model.forward
    takes_position_ids = "position_ids" in inspect.signature(forward).parameters

    @functools.wraps(forward)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if not state.enabled:
            state.batch_tokens = None  # agreed for another batch
            return forward(*args, **kwargs)
        kwargs["use_cache"] = False
        if state.depth == 0:
            _read_batch_layout(kwargs, state, model)
        elif takes_position_ids and kwargs.get("position_ids") is None and _tokens(args, kwargs) == _tokens((), {
            "input_ids": state.position_ids}):
            kwargs["position_ids"] = state.position_ids  # an outer model that does not pass them on (transformers
            # would number this shard's tokens from 0)
        if not takes_position_ids:
            kwargs.pop("position_ids", None)
        state.depth += 1
        try:
            return forward(*args, **kwargs)
        finally:
            state.depth -= 1

    return guarded


def _tokens(args: tuple, kwargs: dict[str, Any]) -> int | None:
    """The sequence length of a model call's ``input_ids`` / ``inputs_embeds`` (``[B, N, ...]``), if it has them."""
    inputs = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
    return inputs.shape[1] if isinstance(inputs, Tensor) and inputs.dim() >= 2 else None


def _read_batch_layout(kwargs: dict[str, Any], state: PatchState, model: PreTrainedModel) -> None:
    """Keep the batch's position ids for the attention layers and build, once per batch, what every layer reuses:
    the documents and the attention backend's plans for each layer pattern, and the MLP tile agreement."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError(
            "Under sequence parallelism the model must be called with the global position ids of its token shard, "
            "e.g. model(input_ids=batch['input_ids'], position_ids=batch['position_ids']) with the batch that "
            "UlyssesStrategy sharded. Without them transformers builds local positions 0..N/sp-1 and RoPE is wrong on "
            "every rank but the first."
        )
    position_ids = text_position_ids(position_ids)
    mask = kwargs.pop("attention_mask", None)
    if mask is not None:
        check_foldable_attention_mask(mask, position_ids, state.group)
    state.position_ids = position_ids
    plan_batch(position_ids, state.group, state.core, _layer_patterns(model))
    if state.sharded_mixers:
        from lightning_ulysses.hf.mixers import plan_document_rows

        plan_document_rows(position_ids, state.group)
    if state.agree_tokens:
        from lightning_ulysses.memory import agree_max_tokens

        tokens = position_ids.shape[-2:].numel()  # [B, N/sp], or [sections, B, N/sp] (multimodal RoPE)
        state.batch_tokens = (tokens, agree_max_tokens(tokens, position_ids.device))


def text_position_ids(position_ids: Tensor) -> Tensor:
    """``[B, N/sp]``: the positions that number the documents. Multimodal RoPE position ids come as
    ``[4, B, N/sp]``, the text positions first (the layout transformers' Qwen-VL models take for packed samples);
    ``[3, B, N/sp]`` (temporal, height, width only) cannot tell where documents start and is refused."""
    if position_ids.dim() == 2:
        return position_ids
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:
        return position_ids[0]
    raise ValueError(
        f"Position ids of shape {tuple(position_ids.shape)}: under sequence parallelism a model takes [B, N/sp] "
        "positions, or multimodal RoPE positions as [4, B, N/sp] with the text positions (restarting at 0 per "
        "document) first; lightning_ulysses.VisionLanguageModel builds them."
    )


def _layer_patterns(model: PreTrainedModel) -> set[tuple[int | None, int | None]]:
    """The ``(chunk, window)`` of every attention layer that the set-up check planned (none before it ran)."""
    return {
        (plan.pattern.chunk, plan.pattern.window)
        for module in model.modules() if (plan := module.__dict__.get("_ulysses_plan")) is not None
    }


def check_foldable_attention_mask(mask: Tensor, position_ids: Tensor, group: ProcessGroup | None) -> None:
    """Accept a 2-D padding mask ``[B, N/sp]`` only when it is constant over every document of the position ids.

    Such a mask marks padding that is already a document of its own (as :func:`~lightning_ulysses.prepare_batch`
    lays it out), which attention never crosses: dropping it changes nothing for the real tokens. Anything else
    (a 4-D mask, padding inside a document) is refused. Collective over ``group`` (one all-gather per forward).
    """
    if mask.dim() != 2 or mask.shape != position_ids.shape:
        raise ValueError(
            f"The model received an attention_mask of shape {tuple(mask.shape)}; under sequence parallelism only a 2-D "
            f"padding mask shaped like the position ids {tuple(position_ids.shape)} can be taken (it is folded into the "
            "document layout). Put padding in the batch (attention_mask / position_ids) and let UlyssesStrategy prepare it."
        )
    whole_mask = gather_sequence(mask.bool(), group)
    starts = documents_of(position_ids, group).starts
    changes = whole_mask[:, 1:] != whole_mask[:, :-1]
    if bool((changes & ~starts[:, 1:]).any()):
        raise ValueError(
            "The attention_mask passed to the model masks tokens inside a document (a run of position ids that does not "
            "restart at 0), which Ulysses attention cannot express without an [N, N] mask. Pass the mask in the batch "
            "so that UlyssesStrategy turns padding into separate documents, or restart position_ids at 0 after padding."
        )


@contextmanager
def sequence_parallel_disabled(model: nn.Module) -> Iterator[None]:
    """Run the patched attention of ``model`` locally (no SP group) inside the ``with`` block.

    The model must then be called with whole sequences (``[B, N]`` inputs and global ``position_ids``) on
    one rank; documents and padding are still masked from the position ids. Not collective.
    """
    states = _states(model)
    saved = [(state.group, state.sp_size) for state in states]
    try:
        for state in states:
            state.group, state.sp_size = None, 1
        yield
    finally:
        for state, (group, sp_size) in zip(states, saved):
            state.group, state.sp_size = group, sp_size


@contextmanager
def unpatched(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as plain transformers inside the ``with`` block: its original attention implementation
    (and the masks transformers builds for it), no forward guard, no whole-sequence RoPE. Not collective."""
    models = [m for m in outermost_models(model) if "_ulysses_original_attn" in m.__dict__]
    try:
        for hf_model in models:
            hf_model._ulysses_state.enabled = False
            for config, implementation in hf_model._ulysses_original_attn:
                config._attn_implementation_internal = implementation
        yield
    finally:
        for hf_model in models:
            hf_model._ulysses_state.enabled = True
            for config, _ in hf_model._ulysses_original_attn:
                config._attn_implementation_internal = ULYSSES_ATTN_IMPLEMENTATION


def _states(model: nn.Module) -> list[PatchState]:
    return [m._ulysses_state for m in outermost_models(model) if "_ulysses_original_attn" in m.__dict__]
