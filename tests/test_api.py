"""The public API is documented: every exported name is in docs/api.md, and every name there imports; one concept,
one public name.

docs/api.md has one ``## `namespace``` section per public namespace and one ``- `Name`: ...`` line per name (a line
may list several names before its colon). Single-process.
"""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest
import torch

import lightning_ulysses
from lightning_ulysses import ulysses_attention
from lightning_ulysses.attention import sdpa_attention
from lightning_ulysses.hf import ULYSSES_ATTN_IMPLEMENTATION, apply_ulysses_attention, remove_ulysses_attention
from tests.tiny import tiny_llama

API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
PACKAGE = Path(lightning_ulysses.__file__).parent
SECTION = re.compile(r"^## `(lightning_ulysses[\w.]*)`$")
ITEM = re.compile(r"^- ((?:`\w+`(?:, )?)+):")


def documented(markdown: str) -> dict[str, list[str]]:
    """``{namespace: [names]}`` of the API doc, in its order."""
    sections: dict[str, list[str]] = {}
    namespace = None
    for line in markdown.splitlines():
        if heading := SECTION.match(line):
            namespace = heading.group(1)
            sections[namespace] = []
        elif (item := ITEM.match(line)) and namespace is not None:
            sections[namespace].extend(re.findall(r"`(\w+)`", item.group(1)))
    return sections


def exporting_packages() -> list[str]:
    """Every package of lightning_ulysses whose ``__init__`` declares ``__all__``, read from source."""
    found = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        if re.search(r"^__all__ = ", init.read_text(), re.MULTILINE):
            found.append(".".join(init.parent.relative_to(PACKAGE.parent).parts))
    return found


def test_the_doc_parser_reads_sections_and_items() -> None:
    markdown = "## `lightning_ulysses.x`\n\nprose `not_a_name`\n- `A`, `b`: two.\n  `c` continued\n- `D`: one.\n"
    assert documented(markdown) == {"lightning_ulysses.x": ["A", "b", "D"]}


def test_every_exported_name_is_documented() -> None:
    sections = documented(API_DOC.read_text())
    packages = exporting_packages()
    assert "lightning_ulysses" in packages and "lightning_ulysses.hf" in packages
    missing = [
        f"{package}.{name}"
        for package in packages
        for name in importlib.import_module(package).__all__
        if name not in sections.get(package, [])
    ]
    assert missing == [], f"exported but not in docs/api.md: {missing}"


def test_every_documented_name_imports() -> None:
    sections = documented(API_DOC.read_text())
    assert len(sections) > 10
    broken = []
    for namespace, names in sections.items():
        module = importlib.import_module(namespace)
        exported = getattr(module, "__all__", None)
        for name in names:
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)
                try:
                    getattr(module, name)
                except (AttributeError, DeprecationWarning):
                    broken.append(f"{namespace}.{name}")
            if exported is not None and name not in exported:
                broken.append(f"{namespace}.{name} (not in __all__)")
    assert broken == [], f"documented but not importable: {broken}"


def test_the_top_level_is_what_a_run_reaches_for() -> None:
    assert sorted(lightning_ulysses.__all__) == sorted(documented(API_DOC.read_text())["lightning_ulysses"])
    assert len(lightning_ulysses.__all__) == len(set(lightning_ulysses.__all__))


@pytest.mark.parametrize(
    ("name", "home"),
    [
        ("apply_ulysses_attention", "lightning_ulysses.hf"),
        ("MemoryOptions", "lightning_ulysses.memory"),
        ("prepare_batch", "lightning_ulysses.sharding"),
        ("convert_checkpoint", "lightning_ulysses.runtime"),
    ],
)
def test_a_moved_name_still_imports_from_the_top_level_with_a_warning(name: str, home: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"lightning_ulysses\.{name} moved: import it from {home}"):
        moved = getattr(lightning_ulysses, name)
    assert moved is getattr(importlib.import_module(home), name)
    assert name not in lightning_ulysses.__all__


def test_every_moved_name_has_a_documented_home() -> None:
    sections = documented(API_DOC.read_text())
    moved = dict(lightning_ulysses._MOVED)
    undocumented = [f"{home}.{name}" for home, names in moved.items() for name in names if name not in sections[home]]
    assert undocumented == []


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = lightning_ulysses.not_a_name


def test_the_attention_backend_has_one_public_name() -> None:
    """``attn_implementation`` everywhere; ``ulysses_attention(attn_fn=)`` and ``apply_ulysses_attention(core=)``,
    the old names, warn and still choose the backend."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 4) for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    expected = ulysses_attention(q, k, v, group=None, attn_implementation="sdpa", position_ids=positions)
    with pytest.warns(DeprecationWarning, match=r"ulysses_attention\(attn_fn=...\) is deprecated"):
        got = ulysses_attention(q, k, v, group=None, attn_fn="sdpa", position_ids=positions)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    custom = ulysses_attention(q, k, v, group=None, attn_implementation=sdpa_attention, position_ids=positions)
    torch.testing.assert_close(custom, expected, rtol=0, atol=0)

    model = tiny_llama()
    with pytest.warns(DeprecationWarning, match=r"apply_ulysses_attention\(core=...\) is deprecated"):
        apply_ulysses_attention(model, None, core="sdpa")
    assert model.config._attn_implementation == ULYSSES_ATTN_IMPLEMENTATION
    remove_ulysses_attention(model)
    with pytest.raises(TypeError, match="both attn_implementation and its deprecated name core"):
        apply_ulysses_attention(model, None, "sdpa", core="sdpa")
    with pytest.raises(TypeError, match="missing the attention backend"):
        apply_ulysses_attention(model, None)
    assert model.config._attn_implementation == "sdpa"  # neither refusal patched it
