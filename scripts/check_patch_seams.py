#!/usr/bin/env python3
"""Check that every change to DeepSpeed / torch behaviour lives in ``patches/``.

Walks the Python files under ``ds_swift/`` and ``launch/`` (``patches/`` is where such changes
belong, so it is not walked) and flags, by file and line:

* ``X.attr = ...``, ``X.attr += ...``, ``X.a, X.b = ...`` and ``del X.attr``
* ``setattr(X, ...)`` and ``delattr(X, ...)``

where ``X`` is a name imported from ``torch`` or ``deepspeed`` (``import torch.distributed as
dist``, ``from deepspeed.runtime.pipe import p2p``, ``import deepspeed``...), an attribute chain
rooted at one (``dist.distributed_c10d.default_pg_timeout = ...``), or a local alias of such a
chain (``c10d = dist.distributed_c10d``; then ``c10d.x = ...``); and the same writes of a private
attribute of a DeepSpeed engine object (``engine._compute_loss = True``,
``setattr(engine, "_x", v)``, ``setattr(engine, name, v)`` with a computed name), which belong in
``patches/deepspeed_engine.py``. An engine object is recognised by its name: the last name of the
expression (``engine``, ``eng``, ``self._engine``, ``ctx.engine``, ``ds_engine``...), less leading
underscores, is ``engine`` or ``eng`` or ends with ``_engine``. Exits 1 listing the offenders, 0
when there are none.

Limits (it is a heuristic over names, not a type checker):

* Instances are not followed beyond the engine's private attributes: ``engine.micro_batches = 1``
  on a DeepSpeed engine object, or ``p.grad = None`` on a parameter, is per-object public state,
  not a patch, and is not flagged; neither is a class reached through an instance
  (``type(engine).x = ...``), an engine under another name (``model._x = ...``), nor a private
  attribute of an object the engine holds (``engine.optimizer._x = ...``). Reads are not checked.
* Aliases are tracked by plain name only, module-wide and flow-insensitively; an alias made
  through a function's return value, a container, ``getattr`` or ``importlib`` is missed.
* Writes through ``vars(X)[...]``, ``X.__dict__[...]``, ``object.__setattr__(X, ...)`` or
  ``X.attr[...] = ...`` (item assignment) are not flagged.
* A line can be exempted with a trailing ``# patch-seams: ok`` comment (say why next to it).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOTS = ("torch", "deepspeed")
DEFAULT_DIRS = ("ds_swift", "launch")
EXEMPT = "# patch-seams: ok"


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _from_root(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in ROOTS


def _chain_root(node: ast.expr) -> str | None:
    """The name at the bottom of ``a.b.c`` (None for calls, subscripts...)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_engine(node: ast.expr) -> bool:
    """Whether ``node`` names a DeepSpeed engine object by the convention above (``self`` does not)."""
    if isinstance(node, ast.Attribute):
        name = node.attr
    elif isinstance(node, ast.Name):
        name = node.id
    else:
        return False
    name = name.lstrip("_")
    return name in ("engine", "eng") or name.endswith("_engine")


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def _engine_setattr(node: ast.Call) -> str | None:
    """What a ``setattr``/``delattr`` on an engine writes, when it may be private; else None."""
    if not (isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") and len(node.args) >= 2):
        return None
    if not _is_engine(node.args[0]):
        return None
    name = node.args[1]
    if isinstance(name, ast.Constant) and isinstance(name.value, str):
        return f"{node.func.id}({_dotted(node.args[0])}, {name.value!r}, ...)" if _private(name.value) else None
    return f"{node.func.id}({_dotted(node.args[0])}, <computed name>, ...) on a DeepSpeed engine"


def _dotted(node: ast.expr) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001 - only used for the message
        return "<expr>"


def tracked_names(tree: ast.Module) -> set[str]:
    """Names bound to torch/deepspeed modules or objects anywhere in the module (aliases included)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _from_root(alias.name):
                    # ``import torch.distributed`` binds ``torch``; ``... as dist`` binds ``dist``.
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _from_root(node.module):
            names.update(alias.asname or alias.name for alias in node.names if alias.name != "*")
    # Aliases of chains (``c10d = dist.distributed_c10d``), to a fixed point.
    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute | ast.Name):
                if _chain_root(node.value) in names:
                    for target in node.targets:
                        if isinstance(target, ast.Name) and target.id not in names:
                            names.add(target.id)
                            changed = True
    return names


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, ast.Assign):
        stack = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        stack = [node.target]
    elif isinstance(node, ast.Delete):
        stack = list(node.targets)
    else:
        return
    while stack:
        t = stack.pop()
        if isinstance(t, ast.Tuple | ast.List):
            stack.extend(t.elts)
        else:
            yield t


def check_source(source: str, path: str = "<string>") -> list[Finding]:
    """The offending writes in one module's source."""
    tree = ast.parse(source, filename=path)
    names = tracked_names(tree)
    lines = source.splitlines()
    found: list[Finding] = []

    def flag(node: ast.AST, what: str) -> None:
        line = getattr(node, "lineno", 0)
        if 0 < line <= len(lines) and lines[line - 1].rstrip().endswith(EXEMPT):
            return
        found.append(Finding(path, line, what))

    for node in ast.walk(tree):
        for target in _targets(node):
            if not isinstance(target, ast.Attribute):
                continue
            verb = "del" if isinstance(node, ast.Delete) else "assignment to"
            if _chain_root(target.value) in names:
                flag(node, f"{verb} {_dotted(target)}")
            elif _private(target.attr) and _is_engine(target.value):
                flag(node, f"{verb} {_dotted(target)} (a DeepSpeed engine's private attribute)")
        if isinstance(node, ast.Call) and (what := _engine_setattr(node)) is not None:
            flag(node, what)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and _chain_root(node.args[0]) in names
        ):
            flag(node, f"{node.func.id}({_dotted(node.args[0])}, ...)")
    return found


def check_tree(root: Path, dirs: Sequence[str] = DEFAULT_DIRS) -> list[Finding]:
    """Every offending write in the ``.py`` files under ``root/dirs``."""
    found: list[Finding] = []
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            if any(part in (".venv", "build", "__pycache__") for part in path.parts):
                continue
            rel = path.relative_to(root).as_posix()
            found += check_source(path.read_text(encoding="utf-8"), rel)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("dirs", nargs="*", default=list(DEFAULT_DIRS))
    args = parser.parse_args(argv)
    found = check_tree(args.root, args.dirs)
    for f in found:
        print(f)
    if found:
        print(
            f"{len(found)} change(s) to torch/deepspeed attributes outside patches/: move them into a "
            "patches/ module (version-pinned, idempotent, reversible; a DeepSpeed engine's own state: "
            "patches/deepspeed_engine.py)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
