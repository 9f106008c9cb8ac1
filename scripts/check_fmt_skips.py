"""Every ``# fmt: skip`` and ``# fmt: off`` says why (issue 31: ``ruff format`` lays the tree out).

    python scripts/check_fmt_skips.py

The reason goes in a comment of its own on the same line (``]  # columns aligned  # fmt: skip``,
or ``# fmt: skip  # why``) or on the line above. Note: ruff honours a trailing ``# fmt: skip`` only
as a comment of its own: ``# fmt: skip - why`` is formatted all the same, so it is refused here too.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRAGMA = re.compile(r"fmt:\s*(skip|off)\b")


def _starts(text: str) -> dict[int, int]:
    """Last line of a statement or expression -> its first line (a reason may sit above a wrapped one)."""
    starts: dict[int, int] = {}
    for node in ast.walk(ast.parse(text)):
        end = getattr(node, "end_lineno", None)
        if end is not None:
            starts[end] = min(starts.get(end, node.lineno), node.lineno)
    return starts


def problems(path: Path, text: str) -> list[str]:
    """``path:line: why`` for each pragma without a reason, or one ruff would not honour."""
    out = []
    lines, starts = text.splitlines(), _starts(text)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type != tokenize.COMMENT or not PRAGMA.search(tok.string):
            continue
        row = tok.start[0]
        parts = [p.strip() for p in tok.string.split("#") if p.strip()]
        pragmas = [p for p in parts if PRAGMA.match(p)]
        odd = [p for p in pragmas if not re.fullmatch(r"fmt:\s*(skip|off)", p)]
        for p in odd:
            out.append(
                f"{path}:{row}: '# {p}': ruff does not honour it; write '# {p.split()[0]} {p.split()[1]}  # why'"
            )
        above = [r - 1 for r in {row, starts.get(row, row)} if r > 1]
        reason = len(parts) > len(pragmas) or any(lines[r - 1].strip().startswith("#") for r in above)
        if not odd and not reason:
            out.append(
                f"{path}:{row}: '{tok.string.strip()}' without a reason (a comment on its line or the line above)"
            )
    return out


def python_files() -> list[str]:
    """The tracked Python files (every one under the root, skipping .venv and build, outside a git checkout)."""
    done = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode == 0:
        return done.stdout.split()
    skip = {".venv", "build", ".git"}
    return [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts)]


def main() -> int:
    found = []
    for name in python_files():
        path = ROOT / name
        if path.is_file():
            found += problems(Path(name), path.read_text(encoding="utf-8"))
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
