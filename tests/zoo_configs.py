"""Tiny configs for every causal LM family, derived from each config class's defaults.

Nothing here names a family except :data:`FAMILY_FIXES` (config fixes for the odd ones) and :data:`VARIANTS` (extra
entries for features no default switches on). Every field of a config and of its sub-configs (vision, audio, ...)
goes through :data:`_RULES`, keyed by field name. A family's default config is usually its flagship checkpoint's,
and the tiny one keeps its proportions (:mod:`tests.zoo_proportions`): head counts, per-head dims and widths each
shrink by one factor of their kind read from the default, so that distinct dims stay distinct and equal ones equal
(``head_dim != hidden / heads``, ``v_head_dim != qk_head_dim``, the ``qk_nope`` / ``qk_rope`` split, the rotary part
of a partial rotary head), the key-value groups stay (MHA, MQA, ``heads / kv_heads``), and the RoPE type and its
scaling parameters stay as they are: 4 to 16 query heads, attention head dims of 8 to 32 (Zamba's 464 to 58), hidden
sizes of 16 to 128 (StableLM's 160, where a smaller one would make its rotary dim odd). Only head counts, widths,
depth, experts (4, top-2), vocabulary (256) and SSM states shrink; dropout and the KV cache go off, and the features
a family has go on (sliding windows of 5 tokens and chunked attention of 8, both shorter than a shard; sliding
layers where the family has a switch for them). The decoder keeps the shortest prefix of its default layer stack
that holds every kind of layer the full stack has: layers are told apart by their module structure (module classes,
parameter shapes and plain attributes such as ``sliding_window``), read from the full-depth model built without
weight initialisation. ``tests/test_zoo_configs.py`` checks the proportions of every family's tiny decoder config
against its default.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import CONFIG_MAPPING, PreTrainedConfig, PreTrainedModel
from transformers.initialization import no_init_weights
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from tests.zoo_proportions import (
    HEAD_COUNTS,
    INPUT_CHANNELS,
    KV_HEAD_FIELDS,
    PER_HEAD_DIMS,
    WIDTHS,
    Proportions,
    proportions,
)

SEQ_LEN = 32
SP_SIZE = 2
SHARD_LEN = SEQ_LEN // SP_SIZE
VOCAB = 256
EXPERTS = 4
TOP_K = 2
WINDOW = 5  # sliding window, shorter than a shard
CHUNK = 8  # chunked attention, shorter than a shard
MIN_LAYERS = 2
MAX_LAYERS = 24  # a layer pattern that needs more is cut here (and its missing layer kinds are reported)

_QSA_INDEXER = {
    f"indexer_{k}": v for k, v in dict(n_heads=4, kv_heads=1, head_dim=16, budget=8, compress_ratio=2).items()
}

_DRAFTER = {
    "text_config.hidden_size_per_layer_input": 0,
    "text_config.vocab_size_per_layer_input": 0,
    "text_config.num_hidden_layers": 2,
    "text_config.num_kv_shared_layers": 2,
}

# Per-family config fixes, keyed by model_type: {field: value} applied last to the config that the family's causal-LM
# class takes ("a.b": field b of its sub-config a). A fix of the depth field pins the layer pattern to the fix's.
# Each entry says why the generic rules do not fit.
FAMILY_FIXES: dict[str, dict[str, Any]] = {
    # --- defaults that build no working model (real checkpoints set these) ---
    # the attention reads attn_config.rope_theta, which has no default, and clamps q/k/v to clip_qkv, default None
    "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},
    # drafters of speculative decoding, whose default does not validate (no per-layer input embeddings allowed);
    # every layer reads the key-value states of the target model's layers
    "gemma4_assistant": _DRAFTER,
    "gemma4_unified_assistant": _DRAFTER,
    "cohere_compass_text": {  # the default rope_parameters is empty, the rotary embedding reads one per layer type
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    },
    "xmod": {"default_language": "en_XX"},  # the forward needs a language adapter
    # the global transformer is a part of the decoder whose width the local encoder and decoder read
    # (hidden_size_global): shrunk by their factor (8), not by its own (16)
    "blt": {"global_config.hidden_size": 256, "global_config.head_dim": 64, "global_config.intermediate_size": 704},
    # the QSA indexer of the indexed-attention layers has no default; budget 8 tokens, shorter than a shard
    "qwen4_exp": _QSA_INDEXER,
    "qwen4_exp_text": _QSA_INDEXER,
    # --- layer patterns the generic depth search cannot express ---
    "lfm2": {"full_attn_idxs": [1]},  # the default makes every layer attention: switch the short-conv layers on
    "lfm2_moe": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]},  # no default layer_types
    "gpt_neo": {"num_layers": 2, "attention_types": [[["global", "local"], 1]], "window_size": WINDOW},
    # hybrid layers share one attention block, which transformers cannot build for a single hybrid layer
    "zamba": {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2},
    # its shared block holds one adapter per hybrid layer, so no prefix has the full stack's modules: two hybrid layers
    "zamba2": {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2},
    # input, recurrent and output layers must add up to the depth; 4 layers hold a full-attention one
    "dory": {"num_hidden_layers": 4, "n_input_layers": 1, "n_recurrent_layers": 2, "n_output_layers": 1},
    # the last layers reuse the key-value states of earlier ones (num_kv_shared_layers of 35)
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
    },
    # --- inputs ---
    "musicgen": {"num_codebooks": 2},  # input rows are (sample, codebook) pairs: the 2 data rows are one sample
    "musicgen_melody": {"num_codebooks": 2},
    "reformer": {  # axial position embeddings must factor the sequence (4 x 8 = 32) and add up to the hidden size,
        # which the shrink factor leaves no whole parts of (256 = 64 + 192 to 43)
        "attn_layers": ["local", "lsh"],
        "axial_pos_shape": [4, 8],
        "axial_pos_embds_dim": [32, 32],
        "hidden_size": 64,
    },
}


Rule = Callable[[Any, Proportions], Any]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _at_most(limit: int) -> Rule:
    """At most ``limit`` (also for each entry of a per-layer list); None and 0 (feature off) stay."""

    def rule(value: Any, scale: Proportions) -> Any:
        if isinstance(value, list):
            return [rule(v, scale) for v in value]
        return min(value, limit) if _is_int(value) and value > 0 else value

    return rule


def _at_most_or(limit: int) -> Rule:
    """Like :func:`_at_most`, and ``limit`` where the default is None."""
    return lambda value, scale: limit if value is None else _at_most(limit)(value, scale)


def _scaled(divide: Callable[[Proportions, int], int], where_none: Callable[[Proportions], Any] | None = None) -> Rule:
    """``divide(scale, value)`` for a positive int (also each entry of a per-layer list); 0 (feature off) stays; None
    stays, or becomes ``where_none(scale)``."""

    def rule(value: Any, scale: Proportions) -> Any:
        if isinstance(value, list):
            return [rule(v, scale) for v in value]
        if value is None and where_none is not None:
            return where_none(scale)
        return divide(scale, value) if _is_int(value) and value > 0 else value

    return rule


def _always(new: Any) -> Rule:
    return lambda value, scale: new


def _zero_float(value: Any, scale: Proportions) -> Any:
    return 0.0 if isinstance(value, float) else value


def _window(value: Any, scale: Proportions) -> Any:
    return WINDOW if value is None or _is_int(value) else value


_WINDOW_FIELDS = r"(sliding_window|sliding_window_size|attention_window_size|local_attention_window_len)"
# set also where the config derives them: the features, and the RoPE parameters (a composite config gives its decoder
# the checkpoint's, which the decoder's own derivation would not: GOT-OCR2's rope_theta 1e6)
_KEPT_FIELD = re.compile(rf"({_WINDOW_FIELDS}|attention_chunk_size|rope_parameters)")
_KV_HEADS = re.compile(rf"({'|'.join(KV_HEAD_FIELDS)})")

# (field-name pattern, rule(old value, the config's proportions) -> new value); the first full match wins.
_RULES: list[tuple[str | re.Pattern, Rule]] = [
    # regularisation and generation state off, fp32
    (r".*(drop|jitter).*", _zero_float),  # dropout, attention_probs_dropout_prob, layerdrop, router jitter, ...
    (r"(use_cache|output_router_logits|add_cross_attention)", _always(False)),
    (r"is_decoder", _always(True)),  # the causal-LM use of models that can also run bidirectionally
    (r"dtype", _always(torch.float32)),
    # vocabulary
    (r".*vocab.*", _at_most(VOCAB)),  # also hashed n-gram and per-layer-input vocabularies
    # features on
    (r"use_sliding_window", _always(True)),
    (_WINDOW_FIELDS, _window),
    (r"local_attention", _always(2 * WINDOW)),  # ModernBERT's window is local_attention // 2
    (r"max_window_layers", _always(1)),
    (r"attention_chunk_size", _always(CHUNK)),
    # head counts, per-head dims and widths, each by its kind's factor (tests.zoo_proportions); a key-value head
    # count left None is the query heads' (what transformers derives from None)
    (_KV_HEADS, _scaled(Proportions.heads, lambda scale: scale.tiny_heads)),
    (HEAD_COUNTS, _scaled(Proportions.heads)),
    (r"head_dim", _scaled(Proportions.head_dim, lambda scale: scale.tiny_head_dim)),  # None where the model reads it
    (PER_HEAD_DIMS, _scaled(Proportions.head_dim)),
    # experts: on also where the default leaves their number or top-k unset
    (r"(num_experts|num_local_experts|n_routed_experts|moe_num_experts)", _at_most_or(EXPERTS)),
    (r"(num_experts_per_tok|num_experts_per_token|moe_topk|moe_top_k|moe_k|top_k_experts)", _at_most_or(TOP_K)),
    (r"(n_group|topk_group|num_expert_group)", _at_most(1)),
    (r"zero_expert_num", _at_most(2)),
    (r"(n_shared_experts|num_shared_experts)", _at_most_or(1)),
    # layer patterns given as numbers: the first dense layers
    (r"(first_k_dense_replace|num_dense_layers|moe_layer_start_index)", _at_most(1)),
    # state-space and convolution mixers
    (r"(n_groups|mamba_n_groups|mamba_ngroups)", _at_most(1)),
    (r"(state_size|mamba_d_state|ssm_state_size|d_state)", _at_most(8)),
    (r"(time_step_rank|mamba_dt_rank|dt_rank)", _at_most(8)),
    (r"(chunk_size|mamba_chunk_size)", _at_most(8)),
    # widths (convolution channels of vision and audio towers too, not the channels of their input)
    (INPUT_CHANNELS, lambda value, scale: value),
    (WIDTHS, _scaled(Proportions.width)),
    # depth (of sub-configs: the decoder's depth follows its layer pattern, see tiny_recipe)
    (
        r"(num_hidden_layers|n_layer|num_layers|n_layers|encoder_layers|decoder_layers|depth|num_decoder_layers"
        r"|num_encoder_layers|.*_num_hidden_layers)",
        _at_most(MIN_LAYERS),
    ),
]
_COMPILED_RULES = [(re.compile(pattern), rule) for pattern, rule in _RULES]
_DEPTH_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers")
_TOKEN_ID = re.compile(r".*_(token_id|token_ids|token_index|id)$")


# ----------------------------------------------------------------------------------------------
# config specs: a config class and its constructor arguments, sub-configs nested
# ----------------------------------------------------------------------------------------------
@dataclass
class ConfigSpec:
    """What to construct: ``config_class(**kwargs)``, with nested specs for sub-configs."""

    config_class: type[PreTrainedConfig]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> PreTrainedConfig:
        return self.config_class(**{k: v.build() if isinstance(v, ConfigSpec) else v for k, v in self.kwargs.items()})

    def set(self, path: str, value: Any) -> None:
        """Set ``kwargs[path]``; ``"a.b"`` sets field ``b`` of sub-config ``a``."""
        head, _, rest = path.partition(".")
        if rest:
            self.kwargs[head].set(rest, value)
        else:
            self.kwargs[head] = value


def _init_fields(config_class: type[PreTrainedConfig]) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(config_class) if f.init}


def _class_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


class _TokenIds:
    """Special token ids past the tiny vocabulary move to its top (255, 254, ...), the same id to the same place."""

    def __init__(self) -> None:
        self.moved: dict[int, int] = {}

    def __call__(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self(v) for v in value]
        if not _is_int(value) or value < VOCAB:
            return value
        return self.moved.setdefault(value, VOCAB - 1 - len(self.moved))


def _shrunk_spec(default: PreTrainedConfig, token_ids: _TokenIds, parent: Proportions | None = None) -> ConfigSpec:
    """The spec of a tiny version of ``default``: its customised fields (those that differ from its class defaults)
    changed by the rules, sub-configs shrunk recursively (a sub-config with heads of its own by its own proportions,
    any other by its parent's). A field whose class default is None and whose value is not was derived by the
    config (``head_dim``, ``layer_types`` from a window switch, ...) and is left to derive again. The per-layer
    overrides of a heterogeneous config go through the same rules."""
    scale = config_proportions(default, parent)
    spec = ConfigSpec(type(default))
    for name, f in _init_fields(type(default)).items():
        value = _field_value(default, name)
        if value is _MISSING:
            continue
        if isinstance(value, PreTrainedConfig):
            spec.kwargs[name] = _shrunk_spec(value, token_ids, scale)
            continue
        class_default = _class_default(f)
        if class_default is None and value is not None and not _KEPT_FIELD.fullmatch(name):
            continue  # derived in __post_init__ (head_dim, layer_types, ...): derived again from the tiny fields
        new = _shrink(name, value, scale, token_ids)
        if not _same(new, class_default):
            spec.kwargs[name] = new
    if default.is_heterogeneous:
        spec.kwargs["per_layer_config"] = {
            index: {name: _shrink(name, value, scale, token_ids) for name, value in overrides.items()}
            for index, overrides in default._heterogeneity_spec.per_layer_overrides.items()
        }
    return spec


def config_proportions(config: PreTrainedConfig, parent: Proportions | None = None) -> Proportions:
    """The factors that ``config``'s dimensions are divided by (:func:`tests.zoo_proportions.proportions`): its
    own where it has attention heads or no parent, else its parent's (a part of the parent: DBRX's FFN config);
    a composite config without a hidden size of its own takes its decoder's."""
    own = proportions(config, list(_init_fields(type(config))), _read)
    if own is not None and (own.tiny_heads is not None or parent is None):
        return own
    if parent is not None:
        return parent
    text = config.get_text_config(decoder=True)
    return config_proportions(text) if text is not config else Proportions(1.0, 1, None, None)


def _read(config: PreTrainedConfig, name: str) -> Any:
    value = _field_value(config, name)
    return None if value is _MISSING else value


_MISSING = object()


def _field_value(config: PreTrainedConfig, name: str) -> Any:
    """The config's own value of field ``name`` (also for a per-layer field of a heterogeneous config)."""
    return config._getattr_without_heterogeneous_validation(name, _MISSING)


def _shrink(name: str, value: Any, scale: Proportions, token_ids: _TokenIds) -> Any:
    if _TOKEN_ID.fullmatch(name):
        return token_ids(value)
    for pattern, rule in _COMPILED_RULES:
        if pattern.fullmatch(name):
            return rule(value, scale)
    return value


def _is_per_layer(value: Any, layers: int | None) -> bool:
    return isinstance(value, list) and layers is not None and layers > 1 and len(value) == layers


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - tensors, odd objects: whatever their == raises, treat as changed
        return False


def _depth_field(config: PreTrainedConfig) -> str | None:
    """The field that holds the number of decoder layers (a real field, not an ``attribute_map`` alias)."""
    fields = _init_fields(type(config))
    return next((name for name in _DEPTH_FIELDS if name in fields and _is_int(_field_value(config, name))), None)


def _depth(config: PreTrainedConfig) -> int | None:
    name = _depth_field(config)
    return _field_value(config, name) if name is not None else None


# ----------------------------------------------------------------------------------------------
# the decoder's layer pattern
# ----------------------------------------------------------------------------------------------
_NOT_A_KIND = re.compile(r"(idx|index|layer_id|layer_number|layer_num|layers|seed)")  # positions and depths
_KIND_VALUES = (bool, int, str, type(None))  # floats left out: per-layer scales (DiffLlama's lambda) are no kind


def _module_fingerprint(layer: nn.Module) -> tuple:
    """What tells a decoder layer's kind: its modules' classes, parameter shapes and plain attributes."""
    parts = []
    for name, module in layer.named_modules():
        attributes = tuple(
            sorted(
                (key, value)
                for key, value in vars(module).items()
                if isinstance(value, _KIND_VALUES)
                and not key.startswith("_")
                and key != "training"
                and not _NOT_A_KIND.search(key)
            )
        )
        shapes = tuple((key, tuple(p.shape)) for key, p in module.named_parameters(recurse=False))
        parts.append((name, type(module).__name__, attributes, shapes))
    return tuple(parts)


def _decoder_stacks(model: nn.Module, depth: int) -> list[str]:
    """Names of the ``ModuleList``s with one entry per decoder layer (the layers, per-layer norms, ...)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == depth]


def layer_kinds(model: nn.Module, stacks: list[str], depth: int) -> list[tuple]:
    """One fingerprint per decoder layer, over the ``stacks`` (see :func:`_decoder_stacks`)."""
    modules = [model.get_submodule(name) for name in stacks]
    return [tuple(_module_fingerprint(stack[i]) for stack in modules) for i in range(depth)]


def _prefix_depth(kinds: list[tuple]) -> int:
    """The shortest prefix that holds every kind of layer (at least MIN_LAYERS, at most MAX_LAYERS)."""
    first_seen: dict[tuple, int] = {}
    for index, kind in enumerate(kinds):
        first_seen.setdefault(kind, index)
    return max(MIN_LAYERS, min(MAX_LAYERS, max(first_seen.values(), default=0) + 1))


def _build_uninitialised(model_class: type[PreTrainedModel], config: PreTrainedConfig) -> nn.Module:
    """The model's modules only, for their structure (tiny widths, no weight init: faster than the meta device)."""
    with no_init_weights():
        return model_class._from_config(config)


# ----------------------------------------------------------------------------------------------
# variants: features that no default switches on
# ----------------------------------------------------------------------------------------------
ORIGINAL_MAX_POSITIONS = 20  # beyond a shard (16 tokens), below the whole sequence (32)


def _rotary_pairs(config: PreTrainedConfig) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0)) // 2


def _dynamic_rope(config: PreTrainedConfig) -> dict[str, Any]:
    """NTK-aware RoPE whose frequencies depend on the longest position seen beyond the original maximum."""
    rope = {**config.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    return {"max_position_embeddings": ORIGINAL_MAX_POSITIONS, "rope_parameters": rope}


def _longrope(config: PreTrainedConfig) -> dict[str, Any]:
    """LongRoPE: the long factors apply once the sequence is longer than the original maximum."""
    pairs = _rotary_pairs(config)
    rope = {
        "rope_type": "longrope",
        "rope_theta": config.rope_parameters["rope_theta"],
        "partial_rotary_factor": config.rope_parameters.get("partial_rotary_factor", 1.0),
        "short_factor": [1.0] * pairs,
        "long_factor": [1.0 + 3.0 * i / pairs for i in range(pairs)],
        "original_max_position_embeddings": ORIGINAL_MAX_POSITIONS,
    }
    overrides: dict[str, Any] = {"max_position_embeddings": 4 * ORIGINAL_MAX_POSITIONS, "rope_parameters": rope}
    if "original_max_position_embeddings" in _init_fields(type(config)):
        overrides["original_max_position_embeddings"] = ORIGINAL_MAX_POSITIONS
    return overrides


LOGIT_SCALE_FIELDS = ("logits_scaling", "lm_head_multiplier")  # Granite's logits / s, Falcon-H1's and HyperCLOVAX's * s


def _logit_scaling(config: PreTrainedConfig) -> dict[str, Any]:
    """A factor applied to the logits outside ``lm_head``, as the real checkpoints set it (Granite 3: 16; the
    defaults' 1.0 would hide a loss that skips it)."""
    scales = {name: 8.0 for name in LOGIT_SCALE_FIELDS if name in _init_fields(type(config))}
    if not scales:
        raise ValueError(f"{type(config).__name__} has none of {LOGIT_SCALE_FIELDS}")
    return scales


VARIANTS: dict[str, Callable[[PreTrainedConfig], dict[str, Any]]] = {
    "rope=dynamic": _dynamic_rope,
    "rope=longrope": _longrope,
    "logits scaled": _logit_scaling,
    # the last layers reuse the key-value states of earlier ones (Gemma 4's small checkpoints)
    "KV sharing": lambda config: {"num_kv_shared_layers": 2},
}


# ----------------------------------------------------------------------------------------------
# the recipe of a tiny model
# ----------------------------------------------------------------------------------------------
@dataclass
class TinyRecipe:
    """How to build a zoo entry's model: the class, the tiny config, the token ids its data may use."""

    model_class: type[PreTrainedModel]
    config: PreTrainedConfig
    token_ids: list[int]
    lost_layer_kinds: int  # kinds of decoder layer that the full stack has and the tiny one does not

    def build(self, attn_implementation: str, seed: int = 0) -> PreTrainedModel:
        """The model with weights drawn from ``seed``, in fp32."""
        torch.manual_seed(seed)
        config = copy.deepcopy(self.config)
        return self.model_class._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)


def default_text_config(model_type: str) -> PreTrainedConfig:
    """The decoder config of ``model_type``'s default config: what the tiny decoder config is shrunk from."""
    config_class = CONFIG_MAPPING[model_type]
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    return decoder_config(_model_config(_default_config(config_class, FAMILY_FIXES.get(model_type, {})), model_class))


def decoder_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """The sub-config that holds the decoder, or the config itself (see :func:`_text_config_path`)."""
    return _resolve(config, _text_config_path(config))


def tiny_recipe(model_type: str, variant: str | None = None) -> TinyRecipe:
    """The tiny version of ``model_type``'s default config, with its features on (see the module docstring)."""
    config_class = CONFIG_MAPPING[model_type]
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    fixes = FAMILY_FIXES.get(model_type, {})
    root = _model_config(_default_config(config_class, fixes), model_class)
    decoder = _Decoder(root, model_class, fixes, variant)
    config, lost = decoder.tiny()
    return TinyRecipe(model_class, config, _data_token_ids(config), lost)


class _Decoder:
    """Chooses the depth of the tiny decoder: the fewest layers that hold every kind of layer of the full stack."""

    def __init__(
        self, root: PreTrainedConfig, model_class: type[PreTrainedModel], fixes: dict[str, Any], variant: str | None
    ) -> None:
        self.model_class, self.fixes, self.variant = model_class, fixes, variant
        self.default = root
        self.spec = _shrunk_spec(root, _TokenIds())
        self.path = _text_config_path(root)
        self.text_spec = _spec_at(self.spec, self.path)
        self.depth_field = _depth_field(_resolve(root, self.path))
        self.full_depth = _depth(_resolve(root, self.path))

    def tiny(self) -> tuple[PreTrainedConfig, int]:
        """The tiny config and the number of layer kinds of the full stack that it misses."""
        if self.depth_field is None:  # the depth follows from a per-layer list (as long as the default's)
            return self._build(None, None), 0
        pinned = self.fixes.get(self._field_path(self.depth_field))
        if pinned is not None:  # the layer pattern is the family fix's
            return self._build(self.default, pinned), 0
        full = self._build(None, self.full_depth)
        full_model = _build_uninitialised(self.model_class, full)
        stacks = _decoder_stacks(full_model, self.full_depth)
        full_kinds = layer_kinds(full_model, stacks, self.full_depth)
        built: list[tuple[int, PreTrainedConfig]] = []  # (missing kinds, config) of each depth tried
        for depth in sorted({MIN_LAYERS, _prefix_depth(full_kinds)}):
            try:
                config = self._build(full, depth)
                kinds = layer_kinds(_build_uninitialised(self.model_class, config), stacks, depth)
            # too few layers for the family's rules (no attention layer left, ...)
            except Exception as exc:  # noqa: BLE001
                error = exc
                continue
            built.append((len(set(full_kinds) - set(kinds)), config))
            if not built[-1][0]:
                break
        if not built:
            raise error
        lost, config = min(built, key=lambda pair: pair[0])
        return config, lost

    def _build(self, full: PreTrainedConfig | None, depth: int | None) -> PreTrainedConfig:
        """The config with ``depth`` decoder layers (None: as the spec has it), whose per-layer lists are the first
        ``depth`` entries of ``full``'s, with the family fixes and the variant applied."""
        if depth is not None:
            self.text_spec.kwargs[self.depth_field] = depth
        if full is not None:
            self._cut_per_layer(_resolve(full, self.path), depth)
        for path, value in self.fixes.items():
            self.spec.set(path, value)
        config = self.spec.build()
        if self.variant is not None:
            self.text_spec.kwargs.update(VARIANTS[self.variant](_resolve(config, self.path)))
            config = self.spec.build()
        return config

    def _cut_per_layer(self, text_full: PreTrainedConfig, depth: int) -> None:
        """The first ``depth`` entries of ``text_full``'s per-layer lists: those of a tiny config as they are, those
        of the default (a depth pinned by a family fix) shrunk."""
        full_depth = _depth(text_full)
        text_default = _resolve(self.default, self.path)
        scale = config_proportions(text_default) if text_full is text_default else None
        for name in _init_fields(type(text_full)):
            value = _field_value(text_full, name)
            if _is_per_layer(value, full_depth):
                cut = value[:depth]
                self.text_spec.kwargs[name] = cut if scale is None else _shrink(name, cut, scale, _TokenIds())
        if text_full.is_heterogeneous:
            overrides = text_full._heterogeneity_spec.per_layer_overrides
            self.text_spec.kwargs["per_layer_config"] = {i: o for i, o in overrides.items() if i < depth}

    def _field_path(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name


def _default_config(config_class: type[PreTrainedConfig], fixes: dict[str, Any]) -> PreTrainedConfig:
    """The family's default config; where the default does not validate (Gemma 4's assistant), with the fixes."""
    try:
        return config_class()
    except Exception:  # transformers' strict validation errors are no ValueError
        if not fixes:
            raise
        return config_class(**_nested(fixes))


def _nested(fixes: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": v}`` as ``{"a": {"b": v}}``: the fixes as constructor arguments of the default config."""
    nested: dict[str, Any] = {}
    for path, value in fixes.items():
        *parents, name = path.split(".")
        target = nested
        for parent in parents:
            target = target.setdefault(parent, {})
        target[name] = value
    return nested


def _model_config(default: PreTrainedConfig, model_class: type[PreTrainedModel]) -> PreTrainedConfig:
    """The config the causal-LM class takes: the registered config, or its sub-config of the class's config type
    (a composite config whose causal LM is its decoder alone)."""
    if not isinstance(default, model_class.config_class):
        for name in default.sub_configs:
            sub = getattr(default, name, None)
            if isinstance(sub, model_class.config_class):
                return sub
    return default  # also a config of another family that the class reads (ExaoneConfig for LlamaForCausalLM)


def _text_config_path(config: PreTrainedConfig) -> str:
    """The sub-config that holds the decoder, or "" for the config itself (also for legacy encoder-decoder configs,
    whose ``get_text_config`` is a renamed copy)."""
    text = config.get_text_config(decoder=True)
    return next((name for name in config.sub_configs if getattr(config, name, None) is text), "")


def _resolve(config: PreTrainedConfig, path: str) -> PreTrainedConfig:
    return getattr(config, path) if path else config


def _spec_at(spec: ConfigSpec, path: str) -> ConfigSpec:
    return spec.kwargs[path] if path else spec


def _configs(config: PreTrainedConfig) -> Iterator[PreTrainedConfig]:
    """``config`` and its sub-configs, recursively."""
    yield config
    for value in vars(config).values():
        if isinstance(value, PreTrainedConfig):
            yield from _configs(value)


def _data_token_ids(config: PreTrainedConfig) -> list[int]:
    """The ids of the text vocabulary that are no special token of any (sub-)config."""
    special: set[int] = set()
    for sub in _configs(config):
        for name, value in vars(sub).items():
            if _TOKEN_ID.fullmatch(name):
                special.update(v for v in (value if isinstance(value, list) else [value]) if _is_int(v))
    vocab = config.get_text_config(decoder=True).vocab_size
    return [i for i in range(vocab) if i not in special]


# ----------------------------------------------------------------------------------------------
# what a tiny model has switched on
# ----------------------------------------------------------------------------------------------
_WINDOW_ATTRIBUTE = re.compile(r"(sliding_window|window_size|attention_window_size|local_window_size)")
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "moe_k", "top_k_experts")


def features(recipe: TinyRecipe, model: nn.Module) -> str:
    """The features of the tiny model in a few words: its layer kinds, windows, experts, RoPE, towers, ..."""
    config = recipe.config
    text = config.get_text_config(decoder=True)
    depth = _depth(text)
    found = [f"{depth} layers" if depth is not None else "layers as the default"]
    kinds = sorted({kind for name in _init_fields(type(text)) for kind in _per_layer_strings(text, name, depth)})
    if len(kinds) > 1:
        found.append("+".join(kind.removesuffix("_attention") for kind in kinds))
    decoder = model.get_decoder()  # the language model of a vision-language model, not its towers
    layers = [m for name in _decoder_stacks(decoder, depth or 0) for m in decoder.get_submodule(name).modules()]
    windows = sorted(
        {
            value
            for m in [text, *layers]
            for key, value in vars(m).items()
            if _WINDOW_ATTRIBUTE.fullmatch(key) and _is_int(value) and value > 0
        }
    )
    found += [f"window {w}" for w in windows]
    if _is_int(chunk := _field_value(text, "attention_chunk_size")):
        found.append(f"chunk {chunk}")
    experts = next((v for v in (_field_value(text, n) for n in _EXPERT_FIELDS) if _is_int(v) and v > 1), None)
    if experts is not None:
        top_k = next((v for v in (_field_value(text, n) for n in _TOP_K_FIELDS) if _is_int(v)), "?")
        found.append(f"MoE {experts}/top-{top_k}")
    if _is_int(_field_value(text, "kv_lora_rank")):
        found.append("MLA")
    if any("sink" in name for name, _ in model.named_parameters()):
        found.append("sinks")
    found += _rope_features(text)
    if any(_field_value(text, name) not in (None, _MISSING) for name in ("attn_logit_softcapping", "logits_soft_cap")):
        found.append("softcap")
    if _field_value(text, "final_logit_softcapping") not in (None, _MISSING):
        found.append("logit softcap")
    if any(_field_value(text, name) not in (None, _MISSING, 1.0) for name in (*LOGIT_SCALE_FIELDS, "logit_scale")):
        found.append("logits scaled")
    if _is_int(shared := _field_value(text, "num_kv_shared_layers")) and shared > 0:
        found.append("KV sharing")
    found += [
        name.removesuffix("_config")
        for name in config.sub_configs
        if name != _text_config_path(config) and getattr(config, name, None) is not None
    ]
    if recipe.lost_layer_kinds:
        found.append(f"{recipe.lost_layer_kinds} layer kinds of the full stack missing")
    return ", ".join(found)


def _per_layer_strings(config: PreTrainedConfig, name: str, depth: int | None) -> list[str]:
    value = _field_value(config, name)
    if isinstance(value, list) and len(value) == depth and all(isinstance(v, str) for v in value):
        return value
    return []


def _rope_features(config: PreTrainedConfig) -> list[str]:
    rope = _field_value(config, "rope_parameters")
    if not isinstance(rope, dict):
        return []
    per_kind = [v for v in rope.values() if isinstance(v, dict)]  # one per layer type (Gemma 3 and kin) ...
    if "rope_type" in rope or "rope_theta" in rope:
        per_kind = [rope]  # ... or one for all layers
    found = sorted({f"rope={p['rope_type']}" for p in per_kind if p.get("rope_type", "default") != "default"})
    if any(p.get("partial_rotary_factor", 1.0) < 1.0 for p in per_kind):
        found.append("partial rotary")
    no_rope = _field_value(config, "no_rope_layers")
    if isinstance(no_rope, list) and 0 in no_rope:
        found.append("NoPE layers")
    return found
