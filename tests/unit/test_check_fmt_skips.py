"""scripts/check_fmt_skips.py: a `# fmt: skip` / `# fmt: off` says why, in a form ruff honours."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_fmt_skips.py"


def checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_fmt_skips", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SOURCE = """
bare = [1,
        2]  # fmt: skip
# the columns line up with the table below
above = [1,
         2]  # fmt: skip
same = [1]  # one piece  # fmt: skip
after = [1]  # fmt: skip  # one piece
odd = [1]  # fmt: skip - ruff formats this line anyway
text = "# fmt: skip inside a string is no pragma"
# fmt: off
"""


def test_a_pragma_without_a_reason_or_that_ruff_ignores_is_named() -> None:
    found = checker().problems(Path("x.py"), SOURCE)
    assert [line.split(":")[1] for line in found] == ["3", "9", "11"], found
    assert "without a reason" in found[0] and "ruff does not honour it" in found[1]
