"""docs/configuration.md lists every field of the swift section with its default, and is current
(scripts/config_reference.py generates it from the config dataclasses' field docs)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ds_swift.config import SwiftConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "config_reference.py"
PAGE = ROOT / "docs" / "configuration.md"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def leaves(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every leaf field of the swift section, dotted from ``swift``, with its default (sections recursed)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[prefix + f.name] = f.default
            continue
        made = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(made):
            out.update(leaves(type(made), f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = made
    return out


def entries(page: str) -> dict[str, str]:
    """Each field entry of the page (``### `path` `` up to the next heading) by its path."""
    parts = re.split(r"^#{2,3} ", page, flags=re.M)
    return {m.group(1): part for part in parts if (m := re.match(r"`([\w.]+)`\n", part))}


def test_the_page_lists_every_field_with_its_default() -> None:
    fields = leaves(SwiftConfig)
    listed = entries(PAGE.read_text(encoding="utf-8"))
    assert len(fields) > 40  # the walk found the sections, not only the top level
    missing = sorted(set(fields) - set(listed))
    assert not missing, f"docs/configuration.md lacks {missing}: run python scripts/config_reference.py"
    for path, default in fields.items():
        assert f"default `{json.dumps(default)}`" in listed[path], f"{path}: default {default!r} not on the page"
    sections = {f.name for f in dataclasses.fields(SwiftConfig) if f.name not in fields}
    stray = sorted(set(listed) - set(fields) - sections)
    assert not stray, f"the page lists fields the config no longer has: {stray}"


def test_the_committed_page_is_what_the_dataclasses_say_now() -> None:
    assert PAGE.read_text(encoding="utf-8") == generator().render(SwiftConfig), (
        "docs/configuration.md is stale: run python scripts/config_reference.py"
    )


@dataclass(frozen=True)
class _Section:
    """A section."""

    documented: int = 1
    """What it does."""

    undocumented: bool = False


@dataclass(frozen=True)
class _Config:
    """A config."""

    section: _Section = field(default_factory=_Section)
    """The section."""


def test_a_field_without_a_doc_is_refused_by_name() -> None:
    gen = generator()
    with pytest.raises(gen.MissingDoc, match=r"_Section\.undocumented \(swift config field section\.undocumented\)"):
        gen.walk(_Config)


def test_types_read_as_json() -> None:
    gen = generator()
    assert gen.type_words(tuple[tuple[int, ...], ...]) == "list[list[int]]"
    assert gen.type_words(float | None) == "float or null"
    assert gen.type_words(str | tuple[str, ...]) == "str or list[str]"
