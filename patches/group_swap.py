"""The one seam through which a survivor keeps its DeepSpeed engine across a failure: the process
groups under it are replaced in place (issue 50; shared/DESIGN.md, failure path step 4).

Two halves, both pinned to the DeepSpeed and torch releases they were measured on:

- :class:`StartupLedger` records, from the moment a worker has joined its generation until ds-swift
  takes its engine over (``ds_swift.initialize``), every process group the start-up creates
  (``torch.distributed.new_group``: DeepSpeed's grid, its p2p and tied groups, the engine's clone of
  the world, megatron-core's ``parallel_state``) and every collective and point-to-point op it runs
  (DeepSpeed's ``_broadcast_model``, the pipeline engine's parameter count and its first send to each
  neighbour, Megatron's start-up barriers and flag broadcasts). A replacement runs that very start-up
  in the next generation; a survivor :meth:`~StartupLedger.replay`\\ s the ledger instead: the same
  groups created in the same order (torch names groups by a counter: both sides must create the same
  ones) and the same ops on them, with the values it recorded where they are small (a flag, a
  parameter count: what the replacement's start-up reads) and zeros where they are large (a
  parameter broadcast: the replacement's state comes from the recovery, which overwrites it). What
  a survivor receives in the replay is thrown away: its own state is never touched.
- :class:`GroupSwap` finds every reference to a process group held by the engine, the objects it
  holds (grid, optimizer wrapper, module, parameters' ``_dp_group``, hooks' closures) and the module
  globals of DeepSpeed and Megatron (``p2p._groups``/``_grid``, ``deepspeed.utils.groups``,
  ``megatron.core.parallel_state``), cuts them at the teardown (so the failed generation's sockets
  close and peers blocked on this rank fail at once) and, once the next generation's groups exist,
  puts each one's successor in its place (:meth:`~GroupSwap.refill`); :meth:`~GroupSwap.restore`
  puts the old references back (the reversal, for a caller that gives up on the swap).

Where a swap cannot be proven whole, it says why (:attr:`StartupLedger.why_not`,
:class:`SwapRefused`) and the caller rebuilds the engine as before: an op the ledger cannot replay
(``batch_isend_irecv``, ``split_group``), a group it never saw created (one made after the start-up,
or by another path than ``new_group``), or a group kept where it cannot be replaced (a tuple inside a
``functools.partial``, a dict key).

:func:`ds_swift.testing.groups.reachable_groups` walks what the engine reaches by ``gc.get_referents``
(another walk than the swap's, deeper) and lists the groups found: tests/unit/test_group_swap.py holds
every one of them to the generation in force after a swap.
"""

from __future__ import annotations

import functools
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_swift.patches._base import PatchError, PatchHandle, check_deepspeed, check_version
from ds_swift.patches.group_walk import (
    SwapRefused,
    entries,
    groups_in,
    has_group,
    is_group,
    module_roots,
    named,
    skip,
    write,
)

__all__ = ["GLOBAL_PACKAGES", "GroupSwap", "StartupLedger", "SwapRefused", "module_roots"]

_TORCH_RANGE = ("2.4", "2.14")
#: a tensor the ledger keeps by value (a flag, a count, a pipeline engine's first send); larger ones
#: are replayed as zeros
VALUE_LIMIT_BYTES = 64 * 1024
#: the ops a ledger records and can replay (their tensors by position or keyword, their group)
REPLAYABLE = (
    "broadcast",
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)
#: ops a ledger records only to say it cannot replay them (a survivor then rebuilds its engine)
UNREPLAYABLE = ("batch_isend_irecv", "split_group", "monitored_barrier", "all_to_all", "reduce_scatter")
#: where DeepSpeed and Megatron keep groups in module globals (every loaded module under these names)
GLOBAL_PACKAGES = ("deepspeed", "megatron")
#: objects a walk visits before it gives up (an engine of a large model has a few thousand)
MAX_OBJECTS = 2_000_000


def _check_versions() -> None:
    check_deepspeed()
    check_version("torch", torch.__version__.split("+")[0], *_TORCH_RANGE)


# ---------------------------------------------------------------------------- the ledger
@dataclass(frozen=True)
class _TensorArg:
    shape: tuple[int, ...]
    dtype: torch.dtype
    value: torch.Tensor | None  # None: replayed as zeros

    def fresh(self) -> torch.Tensor:
        if self.value is not None:
            return self.value.clone()
        return torch.zeros(self.shape, dtype=self.dtype)


@dataclass(frozen=True)
class _GroupArg:
    index: int  # into StartupLedger's groups; WORLD: the default group


WORLD = -1


@dataclass(frozen=True)
class _Call:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class StartupLedger:
    """Records the start-up's groups and ops on this process's training thread (see the module's
    docstring); :meth:`close` ends the recording, :meth:`replay` re-issues it in a later generation.

    Use :meth:`start` (it patches ``torch.distributed``'s functions until :meth:`close`)."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.why_not: str | None = None
        """Why the ledger cannot be replayed (None: it can)."""
        self._index: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._groups = 0
        self._thread = threading.get_ident()
        self._depth = threading.local()
        self._patch: PatchHandle | None = None
        self._world: weakref.ref[Any] | None = None
        self.restored = False
        self.closed_at: float | None = None
        """``time.time()`` when the recording ended (ds-swift took the engine over)."""
        self.seconds: dict[str, float] = {"new_group": 0.0, "ops": 0.0}
        """Seconds the start-up spent creating groups and in its ops (what a replacement's start-up
        costs its survivors, who wait in the replay)."""

    @classmethod
    def start(cls, restored: bool = False) -> StartupLedger:
        """A ledger recording from now on (the world must be initialised). ``restored``: the engine
        built under it gets its state from a recovery (a replacement's, a survivor's rebuilt one): it
        skips DeepSpeed's start-up broadcast of the model from data-parallel rank 0
        (``_broadcast_model``), which no ledger records either (a survivor's replay would send a
        whole model's zeros for nothing), so every side of a recovery skips it alike."""
        _check_versions()
        ledger = cls()
        ledger.restored = restored
        ledger._world = weakref.ref(dist.distributed_c10d._get_default_group())
        ledger._patch = _record_into(ledger)
        return ledger

    @property
    def recording(self) -> bool:
        return self._patch is not None and self._patch.active

    def close(self) -> None:
        """End the recording (ds-swift took the engine over: what runs from now on is training)."""
        if self._patch is not None and self._patch.active:
            self._patch.remove()
            self.closed_at = time.time()

    def refuse(self, why: str) -> None:
        """The start-up did something a replacement's will not (a checkpoint load a replacement
        skips): a replay would disagree with it, so survivors rebuild (``why`` says so)."""
        self.why_not = self.why_not or why

    def index_of(self, group: Any) -> int | None:
        """The ledger's number of ``group`` (WORLD for the default group; None: not one it saw)."""
        if self._world is not None and group is self._world():
            return WORLD
        return self._index.get(group)

    # -------------------------------------------------------------- recording
    def _arg(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            small = value.numel() * value.element_size() <= VALUE_LIMIT_BYTES
            return _TensorArg(tuple(value.shape), value.dtype, value.detach().clone().cpu() if small else None)
        if isinstance(value, dist.ProcessGroup):
            index = self.index_of(value)
            if index is None:
                self.why_not = self.why_not or "the start-up used a process group it did not create with new_group"
                return None
            return _GroupArg(index)
        if isinstance(value, list | tuple):
            return type(value)(self._arg(v) for v in value)
        return value

    def _record(self, name: str, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        outermost = not getattr(self._depth, "n", 0)
        if not outermost or threading.get_ident() != self._thread:
            return original(*args, **kwargs)  # inside another recorded call, or not the training thread
        self._depth.n = 1
        try:
            if name in UNREPLAYABLE:
                self.why_not = (
                    self.why_not or f"the start-up ran torch.distributed.{name}, which a replay cannot repeat"
                )
                return original(*args, **kwargs)
            call = _Call(name, tuple(self._arg(a) for a in args), {k: self._arg(v) for k, v in kwargs.items()})
            t0 = time.perf_counter()
            result = original(*args, **kwargs)
            self.seconds["new_group" if name == "new_group" else "ops"] += time.perf_counter() - t0
            if name == "new_group" and isinstance(result, dist.ProcessGroup):
                self._index[result] = self._groups
            if name == "new_group":
                self._groups += 1
            self.calls.append(call)
            return result
        finally:
            self._depth.n = 0

    # -------------------------------------------------------------- replay
    def replay(self) -> dict[int, Any]:
        """Re-issue the recorded start-up on the world in force (every rank of the next generation
        runs the same: a replacement its start-up, a survivor this). Returns the new groups by the
        ledger's numbers (WORLD: the new default group); they become the ones :meth:`index_of` knows.

        Raises:
            SwapRefused: the ledger cannot be replayed (:attr:`why_not`), or is still recording.
        """
        _check_versions()
        if self.recording:
            raise SwapRefused("the start-up ledger is still recording (ds-swift has not taken the engine over)")
        if self.why_not is not None:
            raise SwapRefused(self.why_not)
        world = dist.distributed_c10d._get_default_group()
        made: dict[int, Any] = {WORLD: world}
        pending: list[Any] = []
        count = 0

        def value(arg: Any) -> Any:
            if isinstance(arg, _TensorArg):
                return arg.fresh()
            if isinstance(arg, _GroupArg):
                return made.get(arg.index)
            if isinstance(arg, list | tuple):
                return type(arg)(value(a) for a in arg)
            return arg

        for call in self.calls:
            fn = getattr(dist.distributed_c10d, call.name)
            result = fn(*(value(a) for a in call.args), **{k: value(v) for k, v in call.kwargs.items()})
            if call.name == "new_group":
                made[count] = result
                count += 1
            elif result is not None and hasattr(result, "wait"):
                pending.append(result)  # an async op (isend, irecv, async_op=True): done by the end
        for work in pending:
            work.wait()
        self._world = weakref.ref(world)
        self._index = weakref.WeakKeyDictionary(
            {g: i for i, g in made.items() if i != WORLD and isinstance(g, dist.ProcessGroup)}
        )
        return made


def _record_into(ledger: StartupLedger) -> PatchHandle:
    """Route ``torch.distributed``'s group creation and ops through ``ledger`` (both the package's
    names, which DeepSpeed and Megatron call, and ``distributed_c10d``'s, which torch's own object
    collectives call) until the handle is removed."""
    c10d = dist.distributed_c10d
    if getattr(c10d, "_ds_swift_ledger", None) is not None:
        raise PatchError("torch.distributed is already recorded by a ds-swift start-up ledger")
    names = ("new_group", *REPLAYABLE, *UNREPLAYABLE)
    originals = {name: getattr(c10d, name) for name in names}
    wrapped = {}
    for name, original in originals.items():

        def recorded(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            return ledger._record(_name, _original, args, kwargs)

        functools.update_wrapper(recorded, original)
        wrapped[name] = recorded
    for module in (c10d, dist):
        for name in names:
            if getattr(module, name, None) is originals[name]:
                setattr(module, name, wrapped[name])
    c10d._ds_swift_ledger = ledger  # type: ignore[attr-defined]
    from deepspeed.runtime.engine import DeepSpeedEngine

    broadcast_model = DeepSpeedEngine._broadcast_model

    def _broadcast_model(self: Any) -> None:
        if ledger.restored:
            return  # its parameters come from the recovery
        depth = getattr(ledger._depth, "n", 0)
        ledger._depth.n = depth + 1  # not recorded: a replacement skips it
        try:
            broadcast_model(self)
        finally:
            ledger._depth.n = depth

    DeepSpeedEngine._broadcast_model = _broadcast_model  # type: ignore[method-assign]

    def restore() -> None:
        for module in (c10d, dist):
            for name in names:
                if getattr(module, name, None) is wrapped[name]:
                    setattr(module, name, originals[name])
        c10d._ds_swift_ledger = None  # type: ignore[attr-defined]
        if DeepSpeedEngine._broadcast_model is _broadcast_model:
            DeepSpeedEngine._broadcast_model = broadcast_model  # type: ignore[method-assign]

    return PatchHandle("start-up ledger", restore)


# ---------------------------------------------------------------------------- the swap
@dataclass
class _Slot:
    """One place a group reference lives: ``container[key]`` (an object's ``__dict__``, a dict, a
    list, a closure cell: key None), holding ``template`` (a group's number, or a tuple of them and
    other values) whose groups were ``old``."""

    container: Any
    key: Any
    template: Any
    old: Any
    where: str = ""


@dataclass(frozen=True)
class _Ref:
    index: int


def _template(value: Any, ledger: StartupLedger, where: str) -> Any:
    if is_group(value):
        index = ledger.index_of(value)
        if index is None:
            raise SwapRefused(
                f"{where} holds a process group the start-up did not create (made after it, or not by new_group)"
            )
        return _Ref(index)
    if isinstance(value, tuple):
        return tuple(_template(v, ledger, where) for v in value)
    return value


def _filled(template: Any, made: dict[int, Any]) -> Any:
    if isinstance(template, _Ref):
        return made[template.index]
    if isinstance(template, tuple):
        return tuple(_filled(v, made) for v in template)
    return template


class GroupSwap:
    """The group references of one engine (and of DeepSpeed's and Megatron's module globals), cut
    out and later refilled with the next generation's groups.

    Args:
        roots: the objects to search (the DeepSpeed engine; its module, optimizer... are reached).
        ledger: the start-up ledger that numbered the groups.
        packages: whose loaded modules' globals are searched too.
    """

    def __init__(self, roots: Iterable[Any], ledger: StartupLedger, packages: Iterable[str] = GLOBAL_PACKAGES) -> None:
        _check_versions()
        self._ledger = ledger
        self.slots: list[_Slot] = []
        self._find([*roots, *module_roots(packages)])

    def _find(self, roots: list[Any]) -> None:
        """Every slot reachable from ``roots``: objects in depth; a module's globals one container
        deep (DeepSpeed's and Megatron's keep groups there, or in a list or dict of them: a deeper
        walk of every module's globals costs a tenth of a second, and the objects behind them are
        the engine's, walked from it)."""
        seen: set[int] = set()
        # (object, where it was found (see _named), how many more levels to enter: None for no limit)
        stack: list[tuple[Any, Any, int | None]] = [
            (r, getattr(r, "__name__", type(r).__name__), 1 if isinstance(r, types.ModuleType) else None) for r in roots
        ]
        while stack:
            obj, where, depth = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if len(seen) > MAX_OBJECTS:
                raise SwapRefused(f"the engine reaches more than {MAX_OBJECTS} objects")
            if isinstance(obj, types.ModuleType) and depth is None:
                continue  # a module found along the way: only the roots' globals are searched
            for container, key, value in entries(obj):
                here = (where, key) if container is not None and not isinstance(container, list) else where
                if is_group(value) or has_group(value):
                    if container is None:
                        raise SwapRefused(f"{named(here)} holds a process group where it cannot be replaced")
                    name = named(here)
                    self.slots.append(_Slot(container, key, _template(value, self._ledger, name), value, name))
                    continue
                if skip(value) or id(value) in seen:
                    continue
                if depth is None:
                    stack.append((value, here, None))
                elif depth > 0 and isinstance(value, list | dict):
                    stack.append((value, here, depth - 1))

    def cut(self) -> list[Any]:
        """Drop every reference the slots hold; returns the groups that were there, for the caller to
        let go of (a gloo group's sockets close and its threads end when its last reference goes:
        ~15 ms a group, measured on torch 2.13, without the GIL: another thread can do it)."""
        groups: dict[int, Any] = {}
        for slot in self.slots:
            for g in groups_in(slot.old):
                groups[id(g)] = g
            write(slot.container, slot.key, None)
            slot.old = None
        return list(groups.values())

    def refill(self, made: dict[int, Any]) -> None:
        """Put the successor of each group cut in its place (``made``: :meth:`StartupLedger.replay`'s)."""
        for slot in self.slots:
            write(slot.container, slot.key, _filled(slot.template, made))

    def restore(self) -> None:
        """Put the groups found back where they were (only before :meth:`cut`: after it they are gone)."""
        for slot in self.slots:
            if slot.old is not None:
                write(slot.container, slot.key, slot.old)

    def __len__(self) -> int:
        return len(self.slots)
