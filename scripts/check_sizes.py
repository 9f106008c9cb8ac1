"""No module over 500 lines, no function over 80 (issues 31 and 51; STYLE.md habit 1).

    python scripts/check_sizes.py [--list]

Walks ds_swift/, launch/ and patches/, and the benchmarks, examples, scripts and tests beside them,
with ``ast``. The modules and functions that were already over the limits when the check came in
(or reached them) are listed in ``scripts/size_baseline.txt``: they may shrink, never grow, and a
new offender fails. ``--list`` prints every offender (to refresh the
baseline after a split: only ever remove lines from it).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ds_swift", "launch", "patches")
#: the code beside the packages: the same limits (a 476-line benchmark grew unseen outside the reach)
BESIDE = ("benchmarks", "examples", "scripts", "tests")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
BASELINE = ROOT / "scripts" / "size_baseline.txt"


def offenders() -> dict[str, int]:
    """``path`` or ``path::qualified.function`` -> its length in lines, for everything over a limit."""
    found: dict[str, int] = {}
    for pkg in (*PACKAGES, *BESIDE):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            text = path.read_text(encoding="utf-8")
            lines = len(text.splitlines())
            if lines > MAX_MODULE_LINES:
                found[rel] = lines
            _functions(ast.parse(text, rel), rel, "", found)
    return found


def _functions(node: ast.AST, rel: str, prefix: str, found: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found[f"{rel}::{name}"] = length
            _functions(child, rel, f"{name}.", found)


def baseline() -> dict[str, int]:
    """The known offenders and their lengths when they were listed."""
    if not BASELINE.exists():
        return {}
    lines = BASELINE.read_text(encoding="utf-8").splitlines()
    rows = [line.split() for line in lines if line.strip() and not line.startswith("#")]
    return {row[0]: int(row[1]) for row in rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="print every offender with its length")
    args = ap.parse_args(argv)
    found = offenders()
    if args.list:
        for key, n in sorted(found.items()):
            print(f"{key} {n}")
        return 0
    known = baseline()
    new = sorted(k for k in found if found[k] > known.get(k, 0))
    for key in new:
        limit = MAX_FUNCTION_LINES if "::" in key else MAX_MODULE_LINES
        was = f" (it was {known[key]} when listed: it may shrink, not grow)" if key in known else ""
        print(f"{key}: {found[key]} lines, over {limit}{was}: split it along a seam", file=sys.stderr)
    gone = sorted(set(known) - set(found))
    for key in gone:
        print(f"check_sizes: {key} is within the limits now: remove its line from {BASELINE.name}")
    return 1 if new else 0


if __name__ == "__main__":
    raise SystemExit(main())
