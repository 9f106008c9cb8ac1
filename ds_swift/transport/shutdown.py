"""Ending a failed generation's process groups: gloo as it always was, NCCL by aborting its communicators.

Gloo (CPU): a rank leaving the generation wakes its pipeline neighbours blocked in a receive from it
with a 1-element "poison" send on the world group (where DeepSpeed's pipeline receives wait; the
receive check in patches/deepspeed_rebuild.py then raises), and destroys every group: with every
reference dropped, the sockets close and peers blocked on it fail at once
(shared/NOTES-deepspeed-cpu.md). Gloo's ``abort()`` would leave the sockets open.

NCCL (GPU): neither works. The world takes device tensors only, and a poison message of another
size would not match a pending receive; ``destroy_process_group`` shuts NCCL down through
``ncclCommFinalize``, which waits for operations in flight, so with a dead peer it can hang. What
torch and NCCL document for this case is to abort the communicators (``ncclCommAbort``; torch's
``ProcessGroupNCCL.abort()`` and ``distributed_c10d._abort_process_group``): operations in flight
end with an error instead of completing, kernels waiting on a dead peer exit. An abort ends only
this rank's side, so every rank aborts its own as soon as it knows: the watchdog thread on seeing
the failure flag (:func:`abort_device_communicators`, which leaves torch's registry of groups alone:
the training thread may be inside a call that reads it), and the training thread again in its
teardown (:func:`teardown_world`; NCCL's abort is idempotent). Groups without NCCL (ds-swift's own
gloo groups, megatron-core's gloo groups) are still destroyed one by one first, as on CPU, so peers
blocked on them in gloo fail at once.

The settings that make the abort safe (:func:`nccl_environment`, before the world is created):
``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` ("CleanUpOnly": on an error or timeout torch's own watchdog
aborts the communicators but does not end the process). torch's default, 3, ends the process on the
first error it sees, which after an abort (or a dead peer) is every survivor: nobody would be left
to recover in-process. 0 is accepted too (then only ds-swift aborts; torch's note on
``_abort_process_group`` recommends it). ``TORCH_NCCL_BLOCKING_WAIT`` stays as the user has it: with
it, every ``wait()`` (DeepSpeed's pipeline ``recv`` included) blocks the host until the GPU finishes,
which costs the overlap the step relies on; without it, a host thread blocked behind a hung NCCL
kernel is released by the abort, and the receive check catches the half-written buffer.

The decisions are plain functions of the groups' backend names (:func:`plan_teardown`,
:func:`wake_action`, :func:`check_nccl_environment`), tested with fakes: one GPU cannot host a
multi-rank NCCL group, so the multi-rank NCCL path is right by construction, not by a run.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ASYNC_ERROR_HANDLING",
    "POISON_MARK",
    "TeardownPlan",
    "abort_device_communicators",
    "backends_of",
    "carries_poison",
    "check_nccl_environment",
    "nccl_environment",
    "parse_backends",
    "plan_teardown",
    "poison",
    "wake_action",
]

NCCL = "nccl"
ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_SAFE_HANDLING = ("0", "2")


def parse_backends(spec: str) -> frozenset[str]:
    """The backend names in torch's backend string: ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``."""
    return frozenset(p.split(":")[-1].strip().lower() for p in str(spec).split(",") if p.strip())


def backends_of(group: Any = None) -> frozenset[str]:
    """The backends of ``group`` (None: the world) as torch registered them."""
    return parse_backends(str(dist.get_backend(group)))


def wake_action(world: frozenset[str]) -> str:
    """How a rank leaving a failed generation wakes the pipeline neighbours blocked in a receive
    from it: ``"poison"`` on a gloo world, ``"abort"`` where the world has NCCL."""
    return "abort" if NCCL in world else "poison"


@dataclass(frozen=True)
class TeardownPlan:
    """What ending a generation does, in order."""

    destroy: tuple[Any, ...] = ()
    """Groups without NCCL, destroyed one by one first (only where the world has NCCL)."""
    abort_world: bool = False
    """Abort every remaining group's communicators and forget them (``_abort_process_group``)."""
    destroy_world: bool = False
    """Destroy every group at once (``destroy_process_group``: no NCCL anywhere)."""


def plan_teardown(groups: Sequence[tuple[Any, frozenset[str]]], world: frozenset[str]) -> TeardownPlan:
    """The teardown of a generation whose world has the backends ``world`` and whose live groups
    (with their backends) are ``groups``."""
    if NCCL not in world and not any(NCCL in b for _, b in groups):
        return TeardownPlan(destroy_world=True)
    return TeardownPlan(destroy=tuple(g for g, b in groups if NCCL not in b), abort_world=True)


def check_nccl_environment(environ: Mapping[str, str]) -> str | None:
    """Why ``environ`` makes in-process recovery on NCCL impossible (None: it does not)."""
    value = environ.get(ASYNC_ERROR_HANDLING)
    if value is None or value.strip() in _SAFE_HANDLING:
        return None
    return (
        f"{ASYNC_ERROR_HANDLING}={value} makes torch end the process on the first NCCL error or timeout it sees, so no "
        "survivor of a failure would live to recover in-process (and ds-swift's own abort of a failed generation "
        f"counts as such an error); unset it (ds-swift then sets 2: abort the communicators, keep the process) or set "
        "it to 2 or 0"
    )


def nccl_environment(environ: MutableMapping[str, str] | None = None) -> None:
    """Before a world with NCCL is created: the settings that make aborting a failed generation safe
    (the module's docstring). Raises ValueError naming the variable where the user set one that
    makes it unsafe."""
    env = os.environ if environ is None else environ
    problem = check_nccl_environment(env)
    if problem is not None:
        raise ValueError(problem)
    env.setdefault(ASYNC_ERROR_HANDLING, "2")


# ----------------------------------------------------------------------------- effects
def _live_groups() -> list[Any]:
    c10d = dist.distributed_c10d
    return [g for g in list(c10d._world.pg_map) if not c10d._rank_not_in_group(g)]


def _nccl_backend(group: Any) -> Any:
    try:
        backend = group._get_backend(torch.device("cuda"))
    except (RuntimeError, ValueError):
        return None
    return backend if NCCL in parse_backends(getattr(backend, "name", lambda: "")()) else None


def abort_device_communicators() -> int:
    """Abort the NCCL communicators of every group of this rank, from any thread; torch's registry of
    groups is left alone (:func:`teardown_world` clears it on the training thread). Returns how many
    were aborted (0 on a gloo world)."""
    if not dist.is_initialized():
        return 0
    backends = [b for b in (_nccl_backend(g) for g in _live_groups()) if b is not None]
    if not backends:
        return 0
    # torch aborts a world's communicators inside one NCCL group call, so that aborts of different
    # communicators cannot wait on each other (pytorch/pytorch#119797): the same here.
    backends[0]._group_start()
    try:
        for b in backends:
            b.abort()
    finally:
        backends[0]._group_end()
    return len(backends)


#: The 4 bytes a poison message carries. Gloo lets a receive of N bytes complete with fewer, so a
#: poison lands in the first 4 bytes of whatever buffer the neighbour was receiving into; read as
#: any dtype a pipeline sends, the mark is no value a healthy job produces: a NaN with a payload in
#: float32, two such NaNs in bfloat16 and float16 (arithmetic yields the canonical NaN, 0x7FC0 /
#: 0x7E00), and 2,141,552,549 in the int32/int64 tensor-meta handshake (ranks and shape sizes). So
#: a receive needs no job-store read to know it was not woken (:func:`carries_poison`).
POISON_MARK = 0x7FA57FA5


def carries_poison(tensor: torch.Tensor) -> bool:
    """Whether a host buffer just received into starts with :data:`POISON_MARK` (a device buffer
    never does: NCCL worlds are woken by an abort, not a poison message)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() * tensor.element_size() < 4:
        return False
    # The first 4 bytes read in place (after every pipeline receive: a slice, a view and an item
    # were five torch calls, ~70 us each receive on a loaded CPU host).
    return ctypes.c_int32.from_address(tensor.data_ptr()).value == POISON_MARK


def poison(peers: Iterable[int]) -> list[Any]:
    """The gloo branch of :func:`wake_action`: a send of :data:`POISON_MARK` to each of ``peers`` on
    the world group, where DeepSpeed's pipeline receives wait. Returns the works (not waited for:
    gloo completes a send only once the peer receives). Only reached where the world is gloo."""
    works = []
    for peer in peers:
        try:
            work = dist.isend(torch.tensor([POISON_MARK], dtype=torch.int32), peer)
            if work is not None:
                works.append(work)
        except Exception:  # noqa: BLE001, S112 - a dead peer cannot be woken and needs no waking
            continue
    return works


def execute(plan: TeardownPlan) -> None:
    """Carry ``plan`` out on this rank's live groups."""
    for g in plan.destroy:
        dist.destroy_process_group(g)
    if plan.abort_world and dist.is_initialized():
        dist.distributed_c10d._abort_process_group()
    elif plan.destroy_world and dist.is_initialized():
        dist.destroy_process_group()


def current_plan() -> TeardownPlan:
    """:func:`plan_teardown` of this rank's live groups."""
    if not dist.is_initialized():
        return TeardownPlan()
    return plan_teardown([(g, backends_of(g)) for g in _live_groups()], backends_of())
