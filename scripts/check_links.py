"""Every relative link in README.md and docs/ points at a file that exists, and at a heading that exists.

    python scripts/check_links.py [FILE.md ...]

``mkdocs build --strict`` checks the links between the pages of docs/; README.md lies outside them,
and GitHub renders both. So this checks, in README.md and every page of docs/ (stdlib only):

- a link or image ``[text](path#anchor)``: the path exists (relative to the page), and the anchor
  is a heading of the target page whose anchor GitHub and mkdocs spell alike (a heading with
  punctuation they drop differently is refused: rename it);
- a file or folder of the repository named in code, `` `ds_swift/recovery/registry.py` `` or
  `` `scripts/` `` (a path under a top-level folder of the repository, with a file suffix or a
  trailing slash), or a name in a module, `` `patches/deepspeed_wrappers.kind_of` ``: it exists;
- a module named in code, `` `ds_swift.recovery.registry` `` (or a name in one,
  `` `ds_swift.initialize` ``): the module exists and, for a name, the module's text holds it.

Links to other sites (``https://...``) and text inside code blocks are not checked. Exits 1 naming
each broken link with its file and line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: folders of the repository a path in code may start with
REPO_DIRS = (
    "ds_swift",
    "launch",
    "patches",
    "cuda_ext",
    "scripts",
    "configs",
    "examples",
    "benchmarks",
    "tests",
    "docs",
)
#: where ``ds_swift.<x>`` lives when it is not under ds_swift/ (setup.py's package_dir)
INSTALLED_AS = {"launch": "launch", "patches": "patches", "cuda_ext": "cuda_ext"}

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE = re.compile(r"(`+)(.+?)\1", re.S)
_PATH = re.compile(r"^(?:" + "|".join(REPO_DIRS) + r")/[\w./-]*$")
_MODULE = re.compile(r"^ds_swift(?:\.\w+)+(?:\(.*\))?$")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"`|\*\*?|__", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def mkdocs_slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading: runs of spaces and hyphens one hyphen."""
    text = re.sub(r"`|\*\*?|__", "", heading)
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def anchors(page: Path) -> dict[str, str | None]:
    """GitHub's anchor of each heading of ``page`` -> the heading (None: two headings share it, and
    GitHub and mkdocs number the second differently: a link to either is ambiguous)."""
    found: dict[str, str | None] = {}
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = github_slug(m.group(1))
            found[slug] = None if slug in found else m.group(1)
    return found


def link_problem(page: Path, target: str) -> str | None:
    """Why the relative link ``target`` on ``page`` is broken (None: it is not, or it is not relative)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
        return None  # another site, mailto:
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{target}: no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}"
    if not anchor:
        return None
    if dest.suffix != ".md":
        return f"{target}: an anchor into a file that is not a Markdown page"
    heads = anchors(dest)
    if anchor not in heads:
        return f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}"
    heading = heads[anchor]
    if heading is None:
        return f"{target}: two headings of {dest.relative_to(ROOT)} have anchor #{anchor}: rename one"
    if mkdocs_slug(heading) != anchor:
        return f"{target}: heading {heading!r} gets another anchor in mkdocs (#{mkdocs_slug(heading)}): rename it"
    return None


def module_problem(name: str) -> str | None:
    """Why the module (or module attribute) ``name`` named in code does not exist (None: it does)."""
    parts = re.sub(r"\(.*\)$", "", name).split(".")
    where = ROOT / "ds_swift"
    for i, part in enumerate(parts[1:], 1):
        if where.is_dir():
            base = ROOT / INSTALLED_AS[part] if where == ROOT / "ds_swift" and part in INSTALLED_AS else where / part
            if base.is_dir():
                where = base
                continue
            if base.with_suffix(".py").is_file():
                where = base.with_suffix(".py")
                continue
            where = where / "__init__.py"
        # ``part`` is a name defined in the module ``where``
        if not where.is_file() or not re.search(rf"\b{re.escape(part)}\b", where.read_text(encoding="utf-8")):
            return f"`{name}`: {'.'.join(parts[:i])} has no module or name {part!r}"
        return None
    return None


def code_problem(code: str) -> str | None:
    """Why a repository path or module named in inline code does not exist (None: it does, or it is neither)."""
    code = code.strip()
    if _MODULE.match(code):
        return module_problem(code)
    if not (_PATH.match(code) and (code.endswith("/") or re.search(r"\.\w+$", code))) or (ROOT / code).exists():
        return None
    module, _, name = code.rpartition(".")  # patches/deepspeed_wrappers.kind_of: a name in a module
    source = ROOT / f"{module}.py"
    if source.is_file() and re.search(rf"\b{re.escape(name)}\b", source.read_text(encoding="utf-8")):
        return None
    return f"`{code}`: no such file or folder in the repository"


def paragraphs(text: str) -> list[tuple[int, str]]:
    """``(first line number, text)`` of every paragraph outside fenced code blocks (a code span or a
    link may run over a line break, never over a blank line)."""
    out: list[tuple[int, str]] = []
    last = -1
    for n, line in prose_lines(text):
        if not line.strip():
            continue
        if out and n == last + 1:
            out[-1] = (out[-1][0], out[-1][1] + "\n" + line)
        else:
            out.append((n, line))
        last = n
    return out


def problems(page: Path) -> list[str]:
    """Every broken link and every missing repository path or module on ``page``, with its line."""
    rel = page.relative_to(ROOT)
    out = []
    for first, para in paragraphs(page.read_text(encoding="utf-8")):
        found: list[tuple[int, str]] = []
        for m in _CODE.finditer(para):
            why = code_problem(" ".join(m.group(2).split()))
            if why:
                found.append((m.start(), why))
        outside = _CODE.sub(lambda m: " " * len(m.group(0)), para)  # offsets kept: line numbers stay right
        for m in _LINK.finditer(outside):
            why = link_problem(page, m.group(1))
            if why:
                found.append((m.start(), f"broken link {why}"))
        out += [f"{rel}:{first + para[:at].count(chr(10))}: {why}" for at, why in sorted(found)]
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    pages = [Path(a).resolve() for a in args] or [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [p for page in pages for p in problems(page)]
    for line in found:
        print(line, file=sys.stderr)
    if found:
        print(f"check_links: {len(found)} broken link(s) or name(s) in {len(pages)} page(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
