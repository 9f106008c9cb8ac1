"""The house move: ds_swift's package layout in story order, done mechanically (issue 31, item 2).

    python scripts/house_move.py [--dry-run] [--format]

1. ``git mv`` every module in :data:`MOVES` whose old file is still there (a module already moved
   is skipped, so a second run moves nothing), and adds an ``__init__.py`` to each new package.
2. Rewrites every reference to a moved module in every file git tracks (ds_swift, launch, patches,
   tests, benchmarks, scripts, examples, configs, docs, README, setup.py, pyproject.toml):
   dotted paths (``import``/``from`` lines, ``"ds_swift.x.y"`` strings in subprocess commands and
   monkeypatch targets, ``:mod:`` roles, ``python -m``), ``from ds_swift.pkg import module`` lines,
   and file paths ``ds_swift/x/y.py``. The rewrite goes by module path, not by a list of files, so
   files this script has never seen (another branch's new modules and tests) are rewritten too.
3. ``ruff check --select I --fix`` on the rewritten Python files (import blocks sorted again).
4. With ``--format``: drops every ``# fmt: skip`` that gives no reason, runs ``ruff format`` over
   the tree and adds ``ruff format --check`` to scripts/check.sh.

Idempotent: a second run changes nothing. Where an old module's name becomes a package's name
(``ds_swift/checkpoint.py`` -> ``ds_swift/checkpoint/``), its references are rewritten only in the
run that moves its file: afterwards ``ds_swift.checkpoint`` means the package.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: old module -> new module (dotted). A module not named here stays where it is.
MOVES: dict[str, str] = {
    # The third step (issue 51): protect/ is the story's "protect" step, what runs while nothing fails
    # (earlier steps' moves are in git's history: this script moves what its list names, once).
    "ds_swift.runtime.protection": "ds_swift.protect.protections",
    "ds_swift.runtime.buddy": "ds_swift.protect.buddy",
    "ds_swift.runtime.buddy_auto": "ds_swift.protect.buddy_interval",
    "ds_swift.runtime.buddy_holdings": "ds_swift.protect.buddy_holdings",
    "ds_swift.runtime.module_buffers": "ds_swift.protect.buddy_payload",
    "ds_swift.runtime.digest": "ds_swift.protect.digest_publisher",
    "ds_swift.runtime.update_logging": "ds_swift.protect.update_logger",
    "ds_swift.runtime.logging_wiring": "ds_swift.protect.message_logging",
    "ds_swift.runtime.running": "ds_swift.protect.running_checkpoint",
    "ds_swift.runtime.costs": "ds_swift.protect.costs",
    "ds_swift.runtime.bench_switch": "ds_swift.protect.costs",
    # one name, one meaning: "simulate" is the what-if simulator (sim/); the failure-simulation mode says so
    "ds_swift.runtime.simulate": "ds_swift.runtime.failure_simulation",
    "ds_swift.recovery.simulated": "ds_swift.recovery.simulated_failure",
    # no twin file names across packages (runtime/teardown is a survivor's; this one ends process groups)
    "ds_swift.transport.teardown": "ds_swift.transport.shutdown",
    "ds_swift.launch.warm": "ds_swift.launch.warm_pool",
    "ds_swift.launch.forkserver": "ds_swift.launch.fork_client",
    # config/ is a leaf: what checks a config against the strategies' needs lives with them
    "ds_swift.config.feasible": "ds_swift.recovery.feasible",
}

#: the docstring of each new package's __init__.py
PACKAGE_DOCS: dict[str, str] = {
    "ds_swift.protect": "Protection: what runs in every worker while nothing fails, so that a failure can be\n"
    "recovered from (buddy copies, state digests, message and update logging, running checkpoints), one\n"
    "object per protection with one lifecycle, built from the configured strategy's services.",
}

#: prose the module mapping cannot rewrite: (file, old text, new text), applied where the old text is
TEXT_EDITS: list[tuple[str, str, str]] = [
    (
        "docs/architecture.md",
        "- **A new recovery strategy**: one module in `ds_swift/recovery/` with",
        "- **A new recovery strategy**: one module in `ds_swift/recovery/strategies/` with",
    ),
]

#: the order in which docs/architecture.md's folder list tells the story (others follow, sorted)
STORY = [
    "config",
    "plan",
    "protect",
    "detect",
    "recovery",
    "runtime",
    "undo",
    "msglog",
    "storage",
    "checkpoint",
    "jobstore",
    "transport",
    "data",
    "models",
    "sim",
    "bench",
    "megatron",
    "testing",
    "cli.py",
]
LAYOUT_BEGIN, LAYOUT_END = "<!-- house_move: layout -->", "<!-- /house_move: layout -->"

#: files the rewrite never touches (this script names the old paths on purpose)
SKIP = {"scripts/house_move.py"}

DOTTED = re.compile(r"(?<![\w.])ds_swift(?:\.\w+)+")
PATH = re.compile(r"(?<![\w/.])ds_swift(?:/\w+)+\.py\b")
FROM_IMPORT = re.compile(
    r"^(?P<indent>[ \t]*)from (?P<base>ds_swift(?:\.\w+)*) import "
    r"(?:(?P<names>[\w ,]+?)[ \t]*$|\((?P<paren>[\w ,\n\t]+?),?\s*\))",
    re.M,
)
RELATIVE = re.compile(r"^(?P<indent>[ \t]*)from (?P<dots>\.+)(?P<rest>\w+(?:\.\w+)*)? import ", re.M)
#: the blocks of pyproject.toml that hold only until the move (dropped by it)
UNTIL_MOVE = re.compile(r"^# house_move: until .*?^# /house_move\n", re.M | re.S)


#: a module that becomes its package's __init__.py keeps its dotted path
INIT_MODULES = {"ds_swift.megatron"}


#: top-level folders installed as sub-packages of ds_swift (setup.py's package_dir)
PACKAGE_DIRS = {"ds_swift.launch": "launch", "ds_swift.patches": "patches", "ds_swift.cuda_ext": "cuda_ext"}


def module_file(module: str) -> Path:
    for pkg, folder in PACKAGE_DIRS.items():
        if module.startswith(pkg + "."):
            return ROOT / folder / (module[len(pkg) + 1 :].replace(".", "/") + ".py")
    return ROOT / (module.replace(".", "/") + ".py")


def new_file(old: str, new: str) -> Path:
    """Where the module ``old`` goes (its dotted path ``new``)."""
    if old in INIT_MODULES:
        return ROOT / new.replace(".", "/") / "__init__.py"
    return module_file(new)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


class Mapper:
    """Maps old dotted module paths to new ones, by the longest moved prefix."""

    def __init__(self, moves: dict[str, str], pending: set[str]) -> None:
        new_packages = {v.rsplit(".", 1)[0] for v in moves.values()}
        # An old module whose name is now a package is rewritten only while its move is pending.
        self.moves = {k: v for k, v in moves.items() if k not in new_packages or k in pending}
        for old in self.moves:
            for new in moves.values():
                if old not in new_packages and (new == old or new.startswith(old + ".")):
                    sys.exit(f"house_move: {new} lies under the moved {old}: the rewrite would not be idempotent")

    def dotted(self, name: str) -> str:
        parts = name.split(".")
        for i in range(len(parts), 1, -1):
            new = self.moves.get(".".join(parts[:i]))
            if new is not None:
                return ".".join([new, *parts[i:]])
        return name

    def from_import(self, m: re.Match[str]) -> str:
        indent, base = m["indent"], m["base"]
        groups: dict[str, list[str]] = {}
        names = m["names"] if m["names"] is not None else m["paren"].replace("\n", " ")
        for item in names.split(","):
            words = item.split()
            if not words:
                return m[0]
            new = self.moves.get(f"{base}.{words[0]}")
            if new is None:
                groups.setdefault(base, []).append(item.strip())
                continue
            pkg, leaf = new.rsplit(".", 1)
            alias = words[2] if len(words) == 3 else words[0]
            groups.setdefault(pkg, []).append(leaf if alias == leaf else f"{leaf} as {alias}")
        if list(groups) == [base]:
            return m[0]
        return "\n".join(f"{indent}from {pkg} import {', '.join(names)}" for pkg, names in groups.items())

    def path(self, m: re.Match[str]) -> str:
        old = m[0][: -len(".py")].replace("/", ".")
        new = self.moves.get(old)
        return m[0] if new is None else new_file(old, new).relative_to(ROOT).as_posix()

    def rewrite(self, text: str) -> str:
        text = DOTTED.sub(lambda m: self.dotted(m[0]), text)
        text = FROM_IMPORT.sub(self.from_import, text)
        return PATH.sub(self.path, text)


def absolutize(path: Path, text: str) -> str:
    """``from .x import y`` in a module of ds_swift, as ``from ds_swift.<package>.x import y``: a
    relative import means something else once its module moved."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]

    def absolute(m: re.Match[str]) -> str:
        up = len(m["dots"]) - 1
        base = ".".join(package[: len(package) - up] if up else package)
        return f"{m['indent']}from {base}{'.' + m['rest'] if m['rest'] else ''} import "

    return RELATIVE.sub(absolute, text)


def absolutize_tree(dry_run: bool) -> None:
    for p in text_files():
        rel = p.relative_to(ROOT)
        if p.suffix == ".py" and rel.parts[0] == "ds_swift":
            text = p.read_text(encoding="utf-8")
            new = absolutize(p, text)
            if new != text and not dry_run:
                p.write_text(new, encoding="utf-8")


def move_files(moves: dict[str, str], dry_run: bool) -> set[str]:
    """``git mv`` each pending module; the old modules moved."""
    pending = {old for old, new in moves.items() if module_file(old).exists() and not new_file(old, new).exists()}
    for old in sorted(pending):
        src, dst = module_file(old), new_file(old, moves[old])
        print(f"git mv {src.relative_to(ROOT)} {dst.relative_to(ROOT)}")
        if not dry_run:
            dst.parent.mkdir(parents=True, exist_ok=True)
            git("mv", str(src), str(dst))
    for pkg in sorted({v.rsplit(".", 1)[0] for k, v in moves.items() if k not in INIT_MODULES}):
        init = ROOT / pkg.replace(".", "/") / "__init__.py"
        if not init.exists() and not dry_run and init.parent.is_dir():
            init.write_text(f'"""{PACKAGE_DOCS.get(pkg, pkg)}"""\n')
            git("add", str(init))
    return pending


def text_files() -> list[Path]:
    out = []
    for rel in git("ls-files", "-z").split("\0"):
        if not rel or rel in SKIP:
            continue
        p = ROOT / rel
        if not p.is_file() or p.is_symlink():
            continue
        try:
            p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(p)
    return out


def rewrite_tree(mapper: Mapper, dry_run: bool) -> list[Path]:
    changed = []
    for p in text_files():
        text = p.read_text(encoding="utf-8")
        new = mapper.rewrite(text)
        if new != text:
            changed.append(p)
            if not dry_run:
                p.write_text(new, encoding="utf-8")
    return changed


def first_line(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except (SyntaxError, OSError):
        return ""
    para = doc.split("\n\n")[0].replace("\n", " ").strip()
    return para.split(". ")[0].split(" (")[0].rstrip(".:") + "."


def layout_block() -> str:
    """The folder list of ds_swift/, in story order, each entry with its docstring's first paragraph."""
    top = ROOT / "ds_swift"
    entries = [p for p in top.iterdir() if (p / "__init__.py").exists() or (p.suffix == ".py" and p.stem != "__init__")]
    order = {name: i for i, name in enumerate(STORY)}
    entries.sort(key=lambda p: (order.get(p.name, len(order)), p.name))
    rows = []
    for p in entries:
        name = p.name + ("/" if p.is_dir() else "")
        rows.append(f"- `ds_swift/{name}`: {first_line(p / '__init__.py' if p.is_dir() else p)}")
        if p.is_dir():
            for sub in sorted(q for q in p.iterdir() if (q / "__init__.py").exists()):
                rows.append(f"  - `ds_swift/{name}{sub.name}/`: {first_line(sub / '__init__.py')}")
    return "\n".join([LAYOUT_BEGIN, *rows, LAYOUT_END])


def edit_text(dry_run: bool) -> None:
    """The prose edits, and pyproject.toml's blocks that held only until the move, dropped."""
    for rel, old, new in TEXT_EDITS:
        p = ROOT / rel
        if p.exists() and old in (text := p.read_text(encoding="utf-8")) and not dry_run:
            p.write_text(text.replace(old, new), encoding="utf-8")
    p = ROOT / "pyproject.toml"
    if p.exists() and not dry_run:
        text = p.read_text(encoding="utf-8")
        p.write_text(UNTIL_MOVE.sub("", text), encoding="utf-8")


def edit_docs(dry_run: bool) -> None:
    """docs/architecture.md's folder list, generated again."""
    p = ROOT / "docs" / "architecture.md"
    text = p.read_text(encoding="utf-8") if p.exists() else ""
    if LAYOUT_BEGIN in text and LAYOUT_END in text and not dry_run:
        head, rest = text.split(LAYOUT_BEGIN, 1)
        tail = rest.split(LAYOUT_END, 1)[1]
        p.write_text(head + layout_block() + tail, encoding="utf-8")


FMT_SKIP = re.compile(r"[ \t]*# fmt: skip[ \t]*$", re.M)


def format_tree() -> None:
    """Drop ``# fmt: skip`` markers that give no reason, then ``ruff format`` the tree."""
    for p in text_files():
        if p.suffix == ".py":
            text = p.read_text(encoding="utf-8")
            new = FMT_SKIP.sub("", text)
            if new != text:
                p.write_text(new, encoding="utf-8")
    subprocess.run(["ruff", "format", "--quiet", "."], cwd=ROOT, check=True)
    # Formatting moves line counts: the size check's list of older offenders is taken again, once.
    baseline = ROOT / "scripts" / "size_baseline.txt"
    if baseline.exists():
        listed = subprocess.run(
            [sys.executable, "scripts/check_sizes.py", "--list"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        lines = baseline.read_text(encoding="utf-8").splitlines()
        head = [line for line in lines if line.startswith("#") and "listed again" not in line]
        note = "# (listed again after ruff format, by scripts/house_move.py --format)"
        baseline.write_text("\n".join([*head, note, listed.rstrip()]) + "\n")
    check = ROOT / "scripts" / "check.sh"
    text = check.read_text(encoding="utf-8")
    if "ruff format --check" not in text:
        check.write_text(
            text.replace("ruff check . || exit 1\n", "ruff check . || exit 1\nruff format --check . || exit 1\n")
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the moves and the files it would rewrite")
    ap.add_argument("--format", action="store_true", help="also drop reasonless `# fmt: skip` and run ruff format")
    args = ap.parse_args(argv)
    absolutize_tree(args.dry_run)
    edit_text(args.dry_run)
    pending = move_files(MOVES, args.dry_run)
    changed = rewrite_tree(Mapper(MOVES, pending), args.dry_run)
    for p in changed:
        print(f"rewrote {p.relative_to(ROOT)}")
    edit_docs(args.dry_run)
    py = [str(p) for p in changed if p.suffix == ".py" and p.exists()]
    if py and not args.dry_run:
        # Import blocks are sorted by module path: a moved module may now sort elsewhere.
        subprocess.run(["ruff", "check", "--quiet", "--select", "I", "--fix", *py], cwd=ROOT, check=False)
    if args.format and not args.dry_run:
        format_tree()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
