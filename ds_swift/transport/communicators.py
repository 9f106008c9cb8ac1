"""This rank's device communicators (NCCL) as ds-swift acts on them: abort, errors, a wait for the device.

NCCL completes asynchronously: ``wait()`` on an NCCL work only orders the current CUDA stream after
it and returns at once, and an abort ends kernels that wait on a dead peer with whatever part of
their buffer had landed. torch says so itself when its watchdog sees a failed collective ("Due to
the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete
data", ``WorkNCCL::handleException``). So a step computed after an abort must not be trusted, and
whoever aborts must say so first: ds-swift marks the generation before it aborts
(ds_swift.transport.on_generation_failed), torch's watchdog records its error
(``ProcessGroupNCCL::getError``: the first error or timeout a work hit) before its own abort, and the
step guard (ds_swift.patches.step_guard) reads both right before the optimizer applies a step,
after the host waited for the device (:meth:`NcclCommunicators.synchronize`). An abort that
happened after that wait came after the reduce landed; one before it was marked. torchft does the
same (torchft/process_group.py: ``ProcessGroupNCCL.abort`` sets the error before ``abort()``;
``Manager.should_commit`` synchronises, then asks ``errored()``).

Aborting: every NCCL backend of this rank's groups inside one NCCL group call, as torch's
``_abort_process_group`` does (pytorch/pytorch#119797: aborts of several communicators one by one
can wait on each other); from any thread, torch's registry of groups left alone.

A CPU test replaces the whole object with a stand-in for NCCL's semantics
(ds_swift.testing.nccl_standin, :func:`use_device_communicators`): the gloo world it runs on has no
NCCL communicator to abort.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = [
    "DeviceCommunicators",
    "NcclCommunicators",
    "Taint",
    "abort_device_communicators",
    "device_communicators",
    "live_groups",
    "use_device_communicators",
]

NCCL = "nccl"


@dataclass(frozen=True)
class Taint:
    """Why the collectives a step follows may have been cut by an abort."""

    why: str
    declared: bool
    """ds-swift's own mark: its watchdog saw the generation's failure flag before it aborted (False:
    torch's NCCL watchdog recorded an error or timeout, which nobody may have declared yet)."""


class DeviceCommunicators(Protocol):
    """What ds-swift needs of this rank's device communicators."""

    def present(self) -> bool:
        """Whether this rank has any (a gloo world has none: nothing to abort, nothing to mark)."""
        ...

    def abort(self) -> int:
        """Abort them all (any thread); how many."""
        ...

    def errors(self) -> list[str]:
        """The errors or timeouts their own watchdog recorded (each: the group and what), if any."""
        ...

    def synchronize(self) -> None:
        """Wait until the device finished what was enqueued so far (the collectives included)."""
        ...


def live_groups() -> list[Any]:
    """Every process group this rank belongs to."""
    c10d = dist.distributed_c10d
    return [g for g in list(c10d._world.pg_map) if not c10d._rank_not_in_group(g)]


def _backend_names(backend: Any) -> str:
    return str(getattr(backend, "name", lambda: "")()).lower()


def _nccl_backend(group: Any) -> Any:
    try:
        backend = group._get_backend(torch.device("cuda"))
    except (RuntimeError, ValueError):
        return None
    return backend if NCCL in _backend_names(backend) else None


def _describe(backend: Any) -> str:
    try:
        return f"NCCL group of {backend.size()} ranks (this rank {backend.rank()})"
    except Exception:  # noqa: BLE001 - only a name for a message
        return "an NCCL group"


class NcclCommunicators:
    """torch's NCCL backends of this rank's live groups."""

    def _backends(self) -> list[Any]:
        if not dist.is_initialized():
            return []
        return [b for b in (_nccl_backend(g) for g in live_groups()) if b is not None]

    def present(self) -> bool:
        return bool(self._backends())

    def abort(self) -> int:
        backends = self._backends()
        if not backends:
            return 0
        backends[0]._group_start()
        try:
            for b in backends:
                b.abort()
        finally:
            backends[0]._group_end()
        return len(backends)

    def errors(self) -> list[str]:
        out = []
        for b in self._backends():
            get_error = getattr(b, "get_error", None)
            error = get_error() if get_error is not None else None
            name = getattr(error, "name", str(error))
            if error is not None and name != "SUCCESS":
                out.append(f"{_describe(b)}: {name}")
        return out

    def synchronize(self) -> None:
        # The current stream has waited for every collective DeepSpeed waited on (a non-blocking
        # wait() makes it wait for the NCCL stream); DeepSpeed's own norm or overflow check has just
        # read a device value, so this returns at once on its paths (docs/gpu.md).
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()


class _Chosen:
    """The communicators ds-swift acts on in this process (torch's NCCL, or a test's stand-in)."""

    def __init__(self) -> None:
        self.comms: DeviceCommunicators = NcclCommunicators()


_CHOSEN = _Chosen()


def device_communicators() -> DeviceCommunicators:
    return _CHOSEN.comms


def use_device_communicators(comms: DeviceCommunicators | None) -> DeviceCommunicators:
    """Act on ``comms`` from now on (None: torch's NCCL again); returns the previous ones."""
    previous, _CHOSEN.comms = _CHOSEN.comms, comms if comms is not None else NcclCommunicators()
    return previous


def abort_device_communicators() -> int:
    """Abort this rank's device communicators, from any thread (0 on a world without any)."""
    return _CHOSEN.comms.abort()
