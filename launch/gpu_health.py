"""GPU health checks for node agents (NVML through nvidia-ml-py).

A GPU that reports uncorrectable ECC errors, has fallen off the bus, or raised a critical Xid
event is as good as a dead machine: training on it produces wrong numbers or hangs. The agent
polls :func:`check_gpus` and treats a failing GPU like a failed worker (the machine goes, a
replacement comes). Without NVML or a GPU (CPU machines, CI) the check returns healthy and says
why once, at debug level.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GpuHealth", "GpuMonitor", "check_gpus"]

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


def _load_nvml() -> Any | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ... : no usable GPU here
        return None
    return pynvml


def check_gpus(indices: list[int] | None = None, nvml: Any | None = None) -> GpuHealth:
    """Check the GPUs (all, or ``indices``) for uncorrectable ECC errors and lost devices."""
    nv = nvml if nvml is not None else _load_nvml()
    if nv is None:
        log.debug("GPU health check skipped: NVML is not available (no NVIDIA driver or GPU on this machine)")
        return GpuHealth(healthy=True, checked=False, reason="NVML not available")
    problems: list[str] = []
    count = nv.nvmlDeviceGetCount()
    for i in indices if indices is not None else range(count):
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(i)
        except Exception as exc:
            problems.append(f"GPU {i}: not reachable through NVML ({exc})")
            continue
        try:
            ecc = nv.nvmlDeviceGetTotalEccErrors(handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            if ecc:
                problems.append(f"GPU {i}: {ecc} uncorrectable ECC error(s) since boot")
        except Exception:  # ECC unsupported (consumer boards): nothing to report
            pass
    return GpuHealth(healthy=not problems, checked=True, problems=problems)


class GpuMonitor:
    """Watches NVML's Xid event stream for critical events between polls."""

    def __init__(self, indices: list[int] | None = None, nvml: Any | None = None) -> None:
        self.nv = nvml if nvml is not None else _load_nvml()
        self.indices = indices
        self._events: Any | None = None
        if self.nv is not None:
            try:
                self._events = self.nv.nvmlEventSetCreate()
                count = self.nv.nvmlDeviceGetCount()
                for i in indices if indices is not None else range(count):
                    h = self.nv.nvmlDeviceGetHandleByIndex(i)
                    self.nv.nvmlDeviceRegisterEvents(h, self.nv.nvmlEventTypeXidCriticalError, self._events)
            except Exception as exc:
                log.debug("Xid event monitoring unavailable: %s", exc)
                self._events = None

    def poll(self) -> GpuHealth:
        """Health now: the ECC check plus any critical Xid seen since the last poll."""
        if self.nv is None:
            return GpuHealth(healthy=True, checked=False, reason="NVML not available")
        health = check_gpus(self.indices, self.nv)
        if self._events is not None and self.nv is not None:
            while True:
                try:
                    ev = self.nv.nvmlEventSetWait_v2(self._events, 0)
                except Exception:  # NVML_ERROR_TIMEOUT: no pending event
                    break
                xid = int(getattr(ev, "eventData", 0))
                if xid in CRITICAL_XIDS:
                    health.problems.append(f"critical Xid {xid} on a GPU of this machine")
                    health.healthy = False
        return health
