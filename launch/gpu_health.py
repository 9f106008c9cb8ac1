"""GPU health checks for node agents (NVML through nvidia-ml-py).

A GPU that reports uncorrectable ECC errors, has fallen off the bus, or raised a critical Xid
event is as good as a dead machine: training on it produces wrong numbers or hangs. The agent
polls a :class:`GpuMonitor` and treats a failing GPU like a failed worker (the machine goes, a
replacement comes). Without NVML or a GPU (CPU machines, CI) the check returns healthy and says
why once, at debug level.

The agent's GPU indices are its local slots as CUDA numbers them inside the job; NVML numbers all
of the host's GPUs and ignores ``CUDA_VISIBLE_DEVICES``, so indices go through it first (checking
NVML's GPU 1 when the job runs on NVML's GPU 5 fails the wrong machine, or none).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["GpuHealth", "GpuMonitor", "check_gpus", "ecc_baseline"]

log = logging.getLogger(__name__)

# Xid events that mean the GPU (or its memory) cannot be trusted any more. From NVIDIA's Xid
# catalogue: 48 double-bit ECC, 63/64 row-remapping events/failure, 74 NVLink error, 79 fell off
# the bus, 92 high single-bit ECC rate, 94/95 contained/uncontained ECC error, 119/120 GSP errors.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})


@dataclass
class GpuHealth:
    """The verdict for one machine's GPUs."""

    healthy: bool
    checked: bool
    problems: list[str] = field(default_factory=list)
    reason: str = ""


#: a device file the NVIDIA driver creates: where it exists, this machine has GPUs to check
GPU_DEVICE_FILE = Path("/dev/nvidia0")


def _open_nvml() -> tuple[Any | None, str]:
    """NVML initialised, or None and why not."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError as exc:
        return None, f"nvidia-ml-py is not installed ({exc})"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ... : no usable GPU here
        return None, f"NVML did not initialise ({type(exc).__name__}: {exc})"
    return pynvml, ""


def _load_nvml() -> Any | None:
    return _open_nvml()[0]


def _gpus_expected(environ: Mapping[str, str]) -> bool:
    """Whether this machine looks as if it has GPUs for its workers (the driver's device file, or a
    CUDA_VISIBLE_DEVICES that names some)."""
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    return GPU_DEVICE_FILE.exists() or (spec is not None and bool(_parse_visible(spec)))


def _parse_visible(spec: str) -> list[int | str]:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: NVML indices or UUIDs, up to the first entry it
    cannot parse (``-1`` and ``NoDevFiles`` are the usual ways of hiding every GPU)."""
    out: list[int | str] = []
    for entry in (e.strip() for e in spec.split(",")):
        if entry.startswith(("GPU-", "MIG-")):
            out.append(entry)
        elif entry.isdigit():
            # CUDA's own ordinals follow NVML's (PCI) order with CUDA_DEVICE_ORDER=PCI_BUS_ID, and in
            # practice on machines of identical GPUs, which is what multi-GPU training runs on.
            out.append(int(entry))
        else:
            break
    return out


def _visible_gpus(indices: list[int] | None, nv: Any, environ: Mapping[str, str]) -> list[tuple[int, int | str]]:
    """The GPUs to check: (index as the job sees it, NVML index or UUID)."""
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return [(i, i) for i in (indices if indices is not None else range(nv.nvmlDeviceGetCount()))]
    visible = _parse_visible(spec)
    # A slot past the visible GPUs has no GPU (more ranks than GPUs, or CPU training): nothing to check.
    return [(i, visible[i]) for i in (indices if indices is not None else range(len(visible))) if i < len(visible)]


def _label(local: int, ref: int | str, index: int | None = None) -> str:
    """A GPU as the job sees it and as NVML (nvidia-smi) does, for the operator who pulls it."""
    index = ref if isinstance(ref, int) else index
    return f"GPU {local} (NVML {index})" if index is not None else f"GPU {local} ({ref})"


def _uuid(nv: Any, handle: Any) -> str:
    """A GPU's UUID ("GPU-..."), "" where NVML cannot say: it names a GPU across handles and agents."""
    try:
        uuid = nv.nvmlDeviceGetUUID(handle)
    except Exception:
        return ""
    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)


def _by_uuid(nv: Any, uuid: str) -> Any:
    try:
        return nv.nvmlDeviceGetHandleByUUID(uuid)
    except Exception:
        # CUDA also takes a unique prefix of a GPU's UUID; NVML wants all of it.
        for i in range(nv.nvmlDeviceGetCount()):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
            except Exception:  # a lost GPU: if it is the one asked for, it is unreachable either way
                continue
            if _uuid(nv, h).startswith(uuid):
                return h
        raise


def _resolve(nv: Any, local: int, ref: int | str) -> tuple[Any, str]:
    """The NVML handle of a job's GPU, and its label. A MIG instance resolves to its physical GPU:
    ECC counters and Xid event registration are the GPU's, not the instance's."""
    h = nv.nvmlDeviceGetHandleByIndex(ref) if isinstance(ref, int) else _by_uuid(nv, ref)
    try:
        if nv.nvmlDeviceIsMigDeviceHandle(h):
            h = nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h)
    except Exception:  # a driver or binding without MIG: h is a whole GPU
        pass
    index: int | None = None
    if not isinstance(ref, int):
        try:
            index = int(nv.nvmlDeviceGetIndex(h))
        except Exception:
            pass
    return h, _label(local, ref, index)


def _ecc(nv: Any, handle: Any) -> int | None:
    """Uncorrectable ECC errors since the driver loaded (NVML's volatile counter); None where the
    board has no ECC (consumer GPUs)."""
    try:
        return int(nv.nvmlDeviceGetTotalEccErrors(handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
    except Exception:
        return None


def ecc_baseline(
    indices: list[int] | None = None, nvml: Any | None = None, environ: Mapping[str, str] | None = None
) -> dict[int, int]:
    """Each GPU's uncorrectable ECC count now (by index as the job sees it), for :func:`check_gpus`.
    A GPU that already has errors is logged once, at warning level: it has a history."""
    nv = nvml if nvml is not None else _load_nvml()
    if nv is None:
        return {}
    try:
        gpus = _visible_gpus(indices, nv, os.environ if environ is None else environ)
    except Exception as exc:  # NVML cannot count its GPUs: the first check says so
        log.debug("no ECC baseline: %s", exc)
        return {}
    out: dict[int, int] = {}
    for local, ref in gpus:
        try:
            handle, name = _resolve(nv, local, ref)
        except Exception:  # lost: the first check reports it
            continue
        ecc = _ecc(nv, handle)
        if ecc is None:
            continue
        if ecc:
            log.warning(
                "%s already has %d uncorrectable ECC error(s) since the driver loaded; only new ones will fail it",
                name,
                ecc,
            )
        out[local] = ecc
    return out


def check_gpus(
    indices: list[int] | None = None,
    nvml: Any | None = None,
    baseline: dict[int, int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> GpuHealth:
    """Check the GPUs (all, or the job's ``indices``) for lost devices and uncorrectable ECC errors.

    Args:
        indices: GPU indices as the job sees them (through ``CUDA_VISIBLE_DEVICES``); all if None.
        nvml: the NVML module (a fake in tests); loaded if None.
        baseline: ECC counts when the job started (:func:`ecc_baseline`): only errors beyond them
            count. Without one, any error since the driver loaded does, and a GPU that had one
            before the job fails every job on that machine.
        environ: where ``CUDA_VISIBLE_DEVICES`` is read; ``os.environ`` if None.
    """
    nv = nvml if nvml is not None else _load_nvml()
    if nv is None:
        log.debug("GPU health check skipped: NVML is not available (no NVIDIA driver or GPU on this machine)")
        return GpuHealth(healthy=True, checked=False, reason="NVML not available")
    problems: list[str] = []
    for local, ref in _visible_gpus(indices, nv, os.environ if environ is None else environ):
        try:
            handle, name = _resolve(nv, local, ref)
        except Exception as exc:
            problems.append(f"{_label(local, ref)}: not reachable through NVML ({exc})")
            continue
        ecc = _ecc(nv, handle)
        before = (baseline or {}).get(local, 0)
        if ecc is not None and ecc > before:
            problems.append(
                f"{name}: {ecc} uncorrectable ECC error(s) since the driver loaded"
                if baseline is None
                else f"{name}: {ecc - before} new uncorrectable ECC error(s) during this job ({ecc} since the driver loaded)"
            )
    return GpuHealth(healthy=not problems, checked=True, problems=problems)


class GpuMonitor:
    """Watches this agent's GPUs: ECC errors new since the monitor started, lost GPUs, and NVML's
    Xid event stream for critical events between polls.

    Args:
        indices: the agent's GPU slots as the job sees them; all visible GPUs if None.
        nvml: the NVML module (a fake in tests); loaded if None.
        environ: where ``CUDA_VISIBLE_DEVICES`` is read: the agent's own, which its workers inherit.
    """

    def __init__(
        self, indices: list[int] | None = None, nvml: Any | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        self.nv = nvml if nvml is not None else _load_nvml()
        self.indices = indices
        self.environ: Mapping[str, str] = os.environ if environ is None else environ
        self.baseline: dict[int, int] = {}
        self._ours: dict[str, str] = {}  # UUID -> label of this agent's GPUs, whose Xid events count
        self._events: Any | None = None
        if self.nv is None:
            if _gpus_expected(self.environ):
                # A container without the driver's libnvidia-ml mounted, or without nvidia-ml-py:
                # the machine trains on, unwatched, and that must not go unsaid.
                log.warning(
                    "GPU health checks are off on this machine: %s; a GPU with new uncorrectable ECC errors "
                    "or a critical Xid is not failed by its agent (training goes on)",
                    _open_nvml()[1] or "NVML not available",
                )
            return
        self.baseline = ecc_baseline(indices, self.nv, self.environ)
        try:
            self._events = self.nv.nvmlEventSetCreate()
            gpus = _visible_gpus(indices, self.nv, self.environ)
        except Exception as exc:
            log.warning("Xid event monitoring unavailable (ECC errors are still checked): %s", exc)
            self._events = None
            return
        registered = 0
        for local, ref in gpus:
            try:
                h, name = _resolve(self.nv, local, ref)
            except Exception:  # lost: poll reports it
                continue
            uuid = _uuid(self.nv, h)
            if uuid and uuid in self._ours:
                continue  # two MIG instances of one GPU: its events once
            try:
                self.nv.nvmlDeviceRegisterEvents(h, self.nv.nvmlEventTypeXidCriticalError, self._events)
            except Exception as exc:
                log.warning("Xid events of %s unavailable (its ECC errors are still checked): %s", name, exc)
                continue
            registered += 1
            if uuid:
                self._ours[uuid] = name
        if not registered:
            self._events = None

    def _owner(self, ev: Any) -> str | None:
        """The label of the event's GPU if it is one of ours, None if it belongs to another agent."""
        uuid = _uuid(self.nv, getattr(ev, "device", None))
        if not uuid or not self._ours:  # cannot tell: only our GPUs were registered, so take it as ours
            return "a GPU of this machine"
        return self._ours.get(uuid)

    def poll(self) -> GpuHealth:
        """Health now: the ECC check plus any critical Xid seen since the last poll."""
        if self.nv is None:
            return GpuHealth(healthy=True, checked=False, reason="NVML not available")
        health = check_gpus(self.indices, self.nv, self.baseline, self.environ)
        if self._events is not None:
            while True:
                try:
                    ev = self.nv.nvmlEventSetWait_v2(self._events, 0)
                except Exception:  # NVML_ERROR_TIMEOUT: no pending event
                    break
                xid = int(getattr(ev, "eventData", 0))
                if xid not in CRITICAL_XIDS:
                    continue
                name = self._owner(ev)
                if name is None:
                    # Another agent's GPU on a shared host: its own agent fails its machine, not us.
                    log.debug("critical Xid %d on a GPU of another agent, ignored", xid)
                    continue
                health.problems.append(f"{name}: critical Xid {xid}")
                health.healthy = False
        return health
