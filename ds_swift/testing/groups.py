"""Which process groups an engine still reaches: the check behind a survivor's group swap (issue 50).

:func:`reachable_groups` walks by ``gc.get_referents``, another and deeper walk than the one
ds_swift.patches.group_swap.GroupSwap cuts and refills by: what the swap missed, this finds.
"""

from __future__ import annotations

import gc
import types
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from ds_swift.patches.group_swap import GLOBAL_PACKAGES, module_roots

__all__ = ["reachable_groups"]


def reachable_groups(roots: Iterable[Any], packages: Iterable[str] = GLOBAL_PACKAGES) -> list[Any]:
    """Every process group reachable from ``roots`` and the module globals of ``packages``, by
    ``gc.get_referents`` (which also sees what the swap's walk reads by attribute), without entering
    modules found along the way, classes or functions' globals."""
    found: dict[int, Any] = {}
    seen: set[int] = set()
    start = [*roots, *module_roots(packages)]
    roots_ids = {id(r) for r in start if isinstance(r, types.ModuleType)}
    stack = list(start)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dist.ProcessGroup):
            found[id(obj)] = obj
            continue
        if isinstance(obj, type) or (isinstance(obj, types.ModuleType) and id(obj) not in roots_ids):
            continue
        if isinstance(obj, types.ModuleType):
            refs: Iterable[Any] = list(vars(obj).values())
        elif isinstance(obj, types.FunctionType):
            refs = [*(c.cell_contents for c in obj.__closure__ or () if _full(c)), obj.__defaults__]
        else:
            refs = gc.get_referents(obj)
        stack.extend(r for r in refs if id(r) not in seen and not isinstance(r, str | bytes | int | float))
    return list(found.values())


def _full(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - the only way to ask whether a cell is empty
    except ValueError:
        return False
    return True
