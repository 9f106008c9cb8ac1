"""The import-graph contracts of pyproject.toml (``lint-imports`` in scripts/check.sh) cover what they
claim: the config leaf's list of forbidden modules is every other top-level module of ds_swift, so a
module added later is not silently outside it."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_the_config_leaf_forbids_every_other_top_level_module() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (leaf,) = [c for c in contracts if c.get("source_modules") == ["ds_swift.config"]]
    package = ROOT / "ds_swift"
    top = {
        f"ds_swift.{p.stem if p.suffix == '.py' else p.name}"
        for p in package.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    }
    assert set(leaf["forbidden_modules"]) == top - {"ds_swift.config"}
