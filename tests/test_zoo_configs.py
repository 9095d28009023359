"""The zoo's tiny configs keep the real checkpoint's proportions (:mod:`tests.zoo_proportions`): for every family,
the decoder config that the zoo trains against its default config (usually the flagship checkpoint's), field by
field. Single process, no launch: the configs and the module structure only.

A tiny config that makes two distinct dimensions equal hides bugs (the value head dim taken for the query's made
MLA crash at the first step, and no zoo entry had ``v_head_dim != qk_head_dim``), so every check is of a ratio.
"""

from __future__ import annotations

import pytest
from transformers import PreTrainedConfig

from tests.zoo import CONTROL_ENTRIES, zoo_entries
from tests.zoo_configs import FAMILY_FIXES, TinyRecipe, decoder_config, default_text_config, tiny_recipe
from tests.zoo_proportions import (
    HEAD_COUNTS,
    HEAD_FIELDS,
    HIDDEN_FIELDS,
    INPUT_CHANNELS,
    KV_HEAD_FIELDS,
    MAX_TINY_HEADS,
    PER_HEAD_DIMS,
    WIDTH_ALIGN,
    WIDTHS,
    effective_head_dim,
    first_int,
    partial_rotary_factors,
)

pytestmark = pytest.mark.zoo

FAMILIES = [entry.model_type for entry in zoo_entries() if entry.variant is None and entry not in CONTROL_ENTRIES]


def _read(config: PreTrainedConfig, name: str):
    return config._getattr_without_heterogeneous_validation(name, None)


@pytest.fixture(scope="module")
def recipes() -> dict[str, TinyRecipe | Exception]:
    return {}


def _pair(family: str, recipes: dict) -> tuple[PreTrainedConfig, PreTrainedConfig]:
    """The family's default decoder config and the zoo's tiny one."""
    if family not in recipes:
        try:
            recipes[family] = tiny_recipe(family)
        except ImportError as exc:  # an optional package, as in the zoo (its entry is skipped there too)
            recipes[family] = exc
    recipe = recipes[family]
    if isinstance(recipe, ImportError):
        pytest.skip(f"{family} needs a package that is not installed: {recipe}")
    return default_text_config(family), decoder_config(recipe.config)


def _ints(config: PreTrainedConfig, family: str, pattern) -> dict[str, int]:
    """The positive int fields of ``config`` whose names match ``pattern``, but those a family fix sets."""
    fixed = {path.rpartition(".")[2] for path in FAMILY_FIXES.get(family, {})}
    names = [f for f in type(config).__dataclass_fields__ if pattern.fullmatch(f) and f not in fixed]
    values = {name: _read(config, name) for name in names}
    return {name: v for name, v in values.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_config_keeps_the_default_proportions(family: str, recipes: dict) -> None:
    default, tiny = _pair(family, recipes)
    heads, tiny_heads = first_int(default, HEAD_FIELDS, _read), first_int(tiny, HEAD_FIELDS, _read)

    # key-value groups: MHA stays MHA, MQA stays MQA, heads / kv_heads kept (while the tiny heads allow it)
    kv, tiny_kv = first_int(default, KV_HEAD_FIELDS, _read) or heads, first_int(tiny, KV_HEAD_FIELDS, _read)
    if heads and kv and tiny_kv and "num_key_value_heads" not in FAMILY_FIXES.get(family, {}):
        if kv == heads or kv == 1:
            assert tiny_kv == (tiny_heads if kv == heads else 1), (heads, kv, tiny_heads, tiny_kv)
        elif heads // kv <= MAX_TINY_HEADS:
            assert tiny_heads * kv == heads * tiny_kv, f"groups {heads}/{kv} became {tiny_heads}/{tiny_kv}"

    # every other head count keeps its ratio to the query heads (at least one head)
    if heads and tiny_heads:
        for name, value in _ints(default, family, HEAD_COUNTS).items():
            got = _read(tiny, name)
            assert got == max(1, round(value * tiny_heads / heads)), f"{name}: {value} of {heads} heads -> {got}"

    # per-head dims (head_dim, qk_nope / qk_rope / v head dims, rotary dims, ...) shrink by one factor: distinct ones
    # stay distinct, equal ones equal; the rotary part of a partial rotary head keeps its share
    dims = {name: (value, _read(tiny, name)) for name, value in _ints(default, family, PER_HEAD_DIMS).items()}
    head_dim, tiny_head_dim = effective_head_dim(default, _read), effective_head_dim(tiny, _read)
    if head_dim and tiny_head_dim:
        dims["effective head_dim"] = (head_dim, tiny_head_dim)
        for p in partial_rotary_factors(default, _read):
            assert p in partial_rotary_factors(tiny, _read), f"partial rotary factor {p} lost"
            dims[f"rotary part {p}"] = (int(head_dim * p), int(tiny_head_dim * p))
    factors = {name: old / new for name, (old, new) in dims.items() if new}
    assert len(set(factors.values())) <= 1, f"per-head dims shrink unevenly (default / tiny): {dims}"

    # widths (hidden, FFN, expert and low-rank sizes, ...) keep their ratios to the hidden size, up to rounding to a
    # multiple of WIDTH_ALIGN
    hidden, tiny_hidden = first_int(default, HIDDEN_FIELDS, _read), first_int(tiny, HIDDEN_FIELDS, _read)
    widths = {
        name: v
        for name, v in _ints(default, family, WIDTHS).items()  # the rules' order: other kinds first
        if not any(kind.fullmatch(name) for kind in (INPUT_CHANNELS, PER_HEAD_DIMS, HEAD_COUNTS))
    }
    if hidden and tiny_hidden and "hidden_size" not in FAMILY_FIXES.get(family, {}):
        for name, value in widths.items():
            got, want = _read(tiny, name), value * tiny_hidden / hidden
            off = abs(got - want) if isinstance(got, int) else float("inf")
            assert off <= max(WIDTH_ALIGN / 2, 0.02 * want), f"{name}: {value} -> {got}"
        for a, b in [(a, b) for a in widths for b in widths if widths[a] < widths[b]]:
            assert _read(tiny, a) < _read(tiny, b), f"{a} < {b} in the default, not in the tiny config"

        # the attention's width against the model's: head_dim != hidden / heads stays so
        if heads and tiny_heads and head_dim and tiny_head_dim:
            rounding = max(0.02, WIDTH_ALIGN / tiny_hidden)  # the hidden size, aligned, may be one step off
            assert tiny_head_dim * tiny_heads / tiny_hidden == pytest.approx(head_dim * heads / hidden, rel=rounding)

    # the rope type and its scaling parameters are the default's
    if "rope_parameters" not in FAMILY_FIXES.get(family, {}):
        assert _read(tiny, "rope_parameters") == _read(default, "rope_parameters")
