"""scripts/check_links.py: the README's and docs/' relative links, anchors and named repository paths resolve."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_links.py"


@pytest.fixture(scope="module")
def links() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_links", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def page(tmp: Path, text: str) -> Path:
    path = ROOT / "docs" / f"_test_links_{tmp.name}.md"
    path.write_text(text, encoding="utf-8")
    return path


def test_broken_links_and_names_are_found_with_their_line(links: ModuleType, tmp_path: Path) -> None:
    text = (
        "# Title\n\n## A heading: with `code`\n\n"
        "[ok](strategies.md#buddy) [self](#title) [file](figures/bench_logging_layout.png)\n"
        "[gone](no_such_page.md) [anchor](strategies.md#no-such-heading)\n"
        "```\n[in a code block](nowhere.md) `ds_swift/nowhere.py`\n```\n"
        "`ds_swift/recovery/registry.py` `ds_swift/nowhere.py` `ds_swift.recovery.registry.plan_recovery`\n"
        "`ds_swift.recovery.no_such_module` `ds_swift.initialize` `swift-demo/loss_curves.png` [web](https://x.org/a.md)\n"
    )
    path = page(tmp_path, text)
    try:
        found = links.problems(path)
    finally:
        path.unlink()
    name = path.relative_to(ROOT)
    assert found == [
        f"{name}:6: broken link no_such_page.md: no such file docs/no_such_page.md",
        f"{name}:6: broken link strategies.md#no-such-heading: no heading with anchor #no-such-heading in docs/strategies.md",
        f"{name}:10: `ds_swift/nowhere.py`: no such file or folder in the repository",
        f"{name}:11: `ds_swift.recovery.no_such_module`: ds_swift.recovery has no module or name 'no_such_module'",
    ]


def test_an_anchor_github_and_mkdocs_spell_differently_is_refused(links: ModuleType, tmp_path: Path) -> None:
    # GitHub keeps both hyphens of " - ", mkdocs makes one of them
    path = page(tmp_path, "# Kill - and back\n\n[here](#kill---and-back)\n")
    try:
        found = links.problems(path)
    finally:
        path.unlink()
    assert len(found) == 1 and "gets another anchor in mkdocs (#kill-and-back)" in found[0]
