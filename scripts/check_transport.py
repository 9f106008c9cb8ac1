#!/usr/bin/env python3
"""Check that ds-swift's own traffic between ranks goes through ``ds_swift/transport/``.

Walks the Python files under ``ds_swift/`` and ``launch/`` and flags, by file and line, every use
(a call, or a reference that hands it on) of a ``torch.distributed`` (or ``deepspeed.comm``)
communication function or group constructor (``send``, ``isend``, ``all_gather_object``,
``barrier``, ``new_group``...), reached as

* an attribute of a name bound to the module (``import torch.distributed as dist``;
  ``from torch import distributed``; ``import deepspeed.comm as dscomm``): ``dist.isend(...)``;
* a full chain from ``torch`` or ``deepspeed``: ``torch.distributed.barrier()``;
* a name imported from the module: ``from torch.distributed import all_gather_object``.

Not walked: ``ds_swift/transport/`` (the one place ds-swift talks to torch.distributed for its own
traffic) and ``patches/`` (the seams where DeepSpeed's own traffic is changed). Queries
(``get_rank``, ``get_world_size``, ``is_initialized``...) and the world's own life
(``init_process_group``, ``destroy_process_group``) are not communication and are not flagged.

Limits (a heuristic over names, like check_patch_seams.py): aliases through function returns,
containers, ``getattr`` or ``importlib`` are missed. A line that is DeepSpeed's traffic rather than
ds-swift's can be exempted with a trailing ``# transport: ok`` comment (say why next to it). Exits 1
listing the offenders, 0 when there are none.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Sequence
from pathlib import Path

DEFAULT_DIRS = ("ds_swift", "launch")
ALLOWED = ("ds_swift/transport/",)
EXEMPT = "# transport: ok"
MODULES = ("torch.distributed", "deepspeed.comm")
COMM = frozenset(
    {
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "P2POp",
        "send_object_list",
        "recv_object_list",
        "broadcast",
        "broadcast_object_list",
        "all_reduce",
        "reduce",
        "all_gather",
        "all_gather_object",
        "all_gather_into_tensor",
        "all_gather_coalesced",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "new_group",
        "new_subgroups",
        "new_subgroups_by_enumeration",
        "split_group",
    }
)


def _module_aliases(tree: ast.Module) -> tuple[set[str], set[str], set[str]]:
    """(names bound to a communication module, names bound to ``torch``/``deepspeed`` themselves,
    communication functions imported by name)."""
    modules: set[str] = set()
    roots: set[str] = set()
    functions: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES and alias.asname:
                    modules.add(alias.asname)
                elif alias.name.split(".")[0] in ("torch", "deepspeed"):
                    roots.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in MODULES:
                    modules.add(alias.asname or alias.name)
                elif node.module in MODULES and alias.name in COMM:
                    functions.add(alias.asname or alias.name)
    return modules, roots, functions


def check_source(source: str, path: str = "<string>") -> list[str]:
    """``path:line: what`` for each use of a communication function in one module's source: calls,
    and references too (``send = send or dist.send`` hands the function on)."""
    tree = ast.parse(source, filename=path)
    modules, roots, functions = _module_aliases(tree)
    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        hit = None
        if isinstance(node, ast.ImportFrom) and node.module in MODULES:
            names = [a.name for a in node.names if a.name in COMM]
            hit = f"from {node.module} import {', '.join(names)}" if names else None
        elif isinstance(node, ast.Attribute) and node.attr in COMM:
            owner = ast.unparse(node.value)
            if owner in modules or (
                owner.split(".")[0] in roots and owner.split(".", 1)[-1] in ("distributed", "comm")
            ):
                hit = f"{owner}.{node.attr}"
        elif isinstance(node, ast.Name) and node.id in functions:
            hit = node.id
        if hit is None:
            continue
        line = lines[node.lineno - 1] if 0 < node.lineno <= len(lines) else ""
        if not line.rstrip().endswith(EXEMPT):
            found.append(f"{path}:{node.lineno}: {hit}")
    return sorted(set(found), key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def check_tree(root: Path, dirs: Sequence[str] = DEFAULT_DIRS) -> list[str]:
    found: list[str] = []
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if any(part in (".venv", "build", "__pycache__") for part in path.parts) or rel.startswith(ALLOWED):
                continue
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
            f"{len(found)} torch.distributed communication call(s) outside ds_swift/transport/: move ds-swift's own "
            "traffic onto ds_swift.transport (host tensors on its gloo groups, no pickle)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
