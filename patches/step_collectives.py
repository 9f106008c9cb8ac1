"""The collectives seam: ``torch.distributed``'s collective functions, wrapped for a while.

DeepSpeed's comm layer (``deepspeed.comm``'s torch backend) calls ``torch.distributed.all_reduce``
and friends through the module attribute, so replacing the attributes sees every collective an
engine issues. Two uses, both by logging-based recovery:

- :func:`wrap_collectives`: wrap every collective while the handle is held (a replay substitutes
  recorded results for the optimizer step's collectives and refuses any other that leaves the
  replayed group);
- :func:`record_step_collectives`: wrap them only during each ``OptimizerStep`` instruction of one
  engine (through the shared instruction-hook seam), so a survivor records the step's results.

What a wrapper does is the caller's: ``make(name, fn, signature)`` returns the replacement of
``torch.distributed.<name>``. Wrappers stack (``inspect.signature`` follows ``__wrapped__``, so an
outer wrapper still binds arguments by name); the same ``tag`` twice at once is refused; the
handle restores exactly the functions it replaced, and refuses when something replaced them again
after it and is still in force.

Pinned to torch >=2.4,<2.14 (the collective names and ``GroupMember.WORLD``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ds_swift.patches._base import PatchError, PatchHandle, check_version
from ds_swift.patches.instructions import hook_instructions, schedule

__all__ = [
    "COLLECTIVES",
    "SUPPORTED_TORCH",
    "Wrapper",
    "arg_reader",
    "call_ranks",
    "group_ranks",
    "record_step_collectives",
    "wrap_collectives",
]

SUPPORTED_TORCH = ("2.4", "2.14")
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "gather",
    "scatter",
    "all_gather_object",
    "broadcast_object_list",
)
_MARK = "_ds_swift_collectives"

#: make(name, the function in force, its signature) -> the replacement
Wrapper = Callable[[str, Callable[..., Any], inspect.Signature], Callable[..., Any]]


def call_ranks(sig: inspect.Signature, args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[Any, tuple[int, ...]]:
    """Bind a collective's arguments; return them with the global ranks of the group it runs over."""
    bound = sig.bind_partial(*args, **kw)
    return bound, group_ranks(bound.arguments.get("group"))


def arg_reader(sig: inspect.Signature, name: str) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    """Reads argument ``name`` of a call by its position in ``sig`` (or its keyword; None when not
    given): what :func:`call_ranks` binds, without binding every argument of every call."""
    names = list(sig.parameters)
    at = names.index(name) if name in names else 1 << 30  # not a parameter: never positional

    def read(args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        return args[at] if at < len(args) else kw.get(name)

    return read


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of ``group`` (None or the world: every rank), sorted."""
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted(dist.get_process_group_ranks(group)))


@functools.lru_cache(maxsize=128)
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    # The recorder wraps the collectives at every optimizer step: inspect.signature of the same 14
    # functions each time cost more than the rest of the wrapping (bounded: a replay's wrappers
    # are new functions, and the cache must not keep each one alive).
    return inspect.signature(fn)


def _tags(fn: Any) -> set[str]:
    tags: set[str] = set()
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        tag = vars(fn).get(_MARK) if hasattr(fn, "__dict__") else None
        if tag is not None:
            tags.add(tag)
        fn = getattr(fn, "__wrapped__", None)
    return tags


def _originals() -> dict[str, Callable[..., Any]]:
    return {name: fn for name in COLLECTIVES if (fn := getattr(dist, name, None)) is not None}


def _build(tag: str, make: Wrapper, originals: dict[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    if any(tag in _tags(fn) for fn in originals.values()):
        raise PatchError(f"torch.distributed collectives are already wrapped by ds-swift ({tag!r})")
    wrappers: dict[str, Callable[..., Any]] = {}
    for name, fn in originals.items():
        wrapper = functools.wraps(fn)(make(name, fn, _signature(fn)))
        # After functools.wraps, which copies the inner wrapper's __dict__ (and its tag) over.
        setattr(wrapper, _MARK, tag)
        wrappers[name] = wrapper
    return wrappers


def _put_in(tag: str, originals: dict[str, Callable[..., Any]], wrappers: dict[str, Callable[..., Any]]) -> PatchHandle:
    for name, wrapper in wrappers.items():
        setattr(dist, name, wrapper)

    def restore() -> None:
        moved = [name for name, w in wrappers.items() if getattr(dist, name) is not w]
        if moved:
            raise PatchError(f"torch.distributed.{moved[0]} was re-patched after ds-swift's {tag!r} and not restored")
        for name, fn in originals.items():
            setattr(dist, name, fn)

    return PatchHandle(f"torch.distributed collectives {tag}", restore)


def wrap_collectives(tag: str, make: Wrapper) -> PatchHandle:
    """Replace every ``torch.distributed`` collective by ``make(name, fn, signature)`` until removed.

    Args:
        tag: names this wrapping; applying a tag already in force is refused.
        make: builds each replacement; it should call ``fn`` for what it does not handle itself.
    """
    check_version("torch", torch.__version__.split("+")[0], *SUPPORTED_TORCH)
    originals = _originals()
    return _put_in(tag, originals, _build(tag, make, originals))


def record_step_collectives(
    engine: Any, tag: str, make: Wrapper, begin_step: Callable[[Any], None] | None = None
) -> PatchHandle:
    """Wrap the collectives with ``make`` during each optimizer step of ``engine``.

    The wrappers are built once (again only if another wrapping replaced the functions in force
    since) and swapped in for each step: building 14 of them (``functools.wraps``, the tag check)
    at every step was most of what recording cost the training thread.

    Args:
        engine: a DeepSpeed ``PipelineEngine``.
        tag: the instruction-hook name on the engine and the collectives' wrapping tag.
        make: builds each replacement (``make(name, fn, signature)``); what a wrapper keeps per
            step is the caller's (``begin_step``).
        begin_step: called at the start of each step (``engine.global_steps`` is the iteration).
    """
    check_version("torch", torch.__version__.split("+")[0], *SUPPORTED_TORCH)
    built: list[tuple[dict[str, Callable[..., Any]], dict[str, Callable[..., Any]]]] = []

    def step(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
        originals = _originals()
        if not built or built[0][0] != originals:
            built[:] = [(originals, _build(tag, make, originals))]
        if begin_step is not None:
            begin_step(eng)
        with _put_in(tag, originals, built[0][1]):
            return call_next(**kw)

    return hook_instructions(engine, tag, {schedule.OptimizerStep: step})
