"""The walk under :class:`~ds_swift.patches.group_swap.GroupSwap`: which values hold a process group,
which a walk never enters, what an object holds where a write replaces it, and the path a slot is
named by. Pure functions of the objects they are given (torch's ``ProcessGroup`` type the only
torch they read), pinned with group_swap to the releases it was measured on.

Speed matters here: the walk runs on a survivor's teardown, before the next generation can form
(0.1-0.2 s on the demo's engine before these were typed checks and lazy paths; ~40,000 values).
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["SwapRefused", "entries", "groups_in", "has_group", "is_group", "module_roots", "named", "skip", "write"]


class SwapRefused(RuntimeError):
    """The engine's groups cannot all be swapped; the message says which and why."""


def module_roots(packages: Iterable[str]) -> list[types.ModuleType]:
    prefixes = tuple(packages)
    return [
        m
        for name, m in list(sys.modules.items())
        if isinstance(m, types.ModuleType) and (name.split(".")[0] in prefixes)
    ]


#: what a walk never enters besides the groups: leaves, classes, modules found as values
_LEAVES = (str, bytes, int, float, bool, complex, type, types.ModuleType, types.BuiltinFunctionType)
#: type -> (it is a process group, a walk never enters it): decided once per type
_KINDS: dict[type, tuple[bool, bool]] = {}


def _kind(value: Any) -> tuple[bool, bool]:
    # By type, once: isinstance(x, dist.ProcessGroup) runs torch's OpaqueBaseMeta.__instancecheck__
    # in Python (for FakeScriptObjects, which only a tracer makes): 40 % of a walk's time, measured.
    kind = type(value)
    known = _KINDS.get(kind)
    if known is None:
        group = issubclass(kind, dist.ProcessGroup)
        known = _KINDS[kind] = (group, group or issubclass(kind, _LEAVES) or kind.__module__.startswith("numpy"))
    return known


def is_group(value: Any) -> bool:
    return _kind(value)[0]


def skip(value: Any) -> bool:
    """Values a walk never enters: leaves, classes, modules found as values, the groups themselves."""
    return value is None or _kind(value)[1]


def named(where: Any) -> str:
    """A path the walk keeps as (parent, key) pairs, written out only where a slot or an error names it
    (a tensor key's ``str``, the optimizer's state dict's, costs ~50 us: a tenth of a walk, measured)."""
    keys = []
    while isinstance(where, tuple):
        where, key = where
        keys.append(str(key))
    return ".".join([where, *reversed(keys)])


def entries(obj: Any) -> Iterator[tuple[Any, Any, Any]]:
    """(container, key, value) of what ``obj`` holds, where a write of the key replaces it;
    container None where it cannot be written (a tuple's item, a set's member)."""
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            if is_group(k):
                raise SwapRefused(f"a process group is a dict key (in a {type(obj).__name__})")
            yield obj, k, v
    elif isinstance(obj, list):
        yield from ((obj, i, v) for i, v in enumerate(list(obj)))
    elif isinstance(obj, tuple | set | frozenset):
        yield from ((None, None, v) for v in list(obj))
    elif isinstance(obj, types.MethodType):
        yield None, None, obj.__self__
    elif isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                yield cell, None, cell.cell_contents
            except ValueError:  # an empty cell
                continue
        yield None, None, obj.__defaults__
    elif isinstance(obj, functools.partial):
        yield None, None, obj.func
        yield None, None, obj.args
        yield None, None, obj.keywords
    elif isinstance(obj, types.ModuleType):
        yield from ((vars(obj), k, v) for k, v in list(vars(obj).items()))
    else:
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            yield from ((attrs, k, v) for k, v in list(attrs.items()))


def has_group(value: Any) -> bool:
    return isinstance(value, tuple) and any(is_group(v) or has_group(v) for v in value)


def groups_in(value: Any) -> list[Any]:
    if is_group(value):
        return [value]
    if isinstance(value, tuple):
        return [g for v in value for g in groups_in(v)]
    return []


def write(container: Any, key: Any, value: Any) -> None:
    if isinstance(container, types.CellType):
        container.cell_contents = value
    else:
        container[key] = value
