"""OS-level names for ds-swift's background threads.

Python 3.11 names a ``threading.Thread`` for Python only: ``top -H``, ``py-spy``, ``perf`` and
``/proc/<pid>/task/<tid>/comm`` all show every thread as ``python``. Each ds-swift thread calls
:func:`name_os_thread` first, so that what it costs can be told apart from the training thread and
from gloo's (benchmarks/gpu_overhead.py ``--breakdown`` sums CPU time per thread name).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import threading
from typing import Any

__all__ = ["BACKGROUND_NICE", "lower_os_priority", "name_os_thread", "os_thread_name"]

_PR_SET_NAME = 15
#: Linux keeps 15 bytes of a thread's name (16 with the terminating zero)
_MAX = 15


def os_thread_name(name: str) -> str:
    """The name the OS is given for a thread named ``name``: ``sw-`` and the name without its
    ``ds-swift-`` prefix, cut to 15 bytes (``ds-swift-buddy`` -> ``sw-buddy``)."""
    short = name.removeprefix("ds-swift-")
    return ("sw-" + short).encode()[:_MAX].decode(errors="ignore")


def name_os_thread(name: str | None = None) -> None:
    """Name the calling thread in the OS (its Python name by default, see :func:`os_thread_name`).
    Does nothing where the OS has no such call: the name is for tools, never for correctness."""
    if not sys.platform.startswith("linux"):
        return
    try:
        text = os_thread_name(name if name is not None else threading.current_thread().name)
        _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(text.encode()), 0, 0, 0)
    except (OSError, AttributeError):
        pass


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


#: how much lower than the training thread's a background worker's CPU priority is (nice steps)
BACKGROUND_NICE = 10
#: ``SWIFT_BENCH_WITHOUT=priority`` (ds_swift.runtime.bench_switch, benchmarks only) keeps the
#: workers at the training thread's priority, to measure what the lower one saves
_BENCH_ENV, _BENCH_SWITCH = "SWIFT_BENCH_WITHOUT", "priority"


def lower_os_priority(by: int = BACKGROUND_NICE) -> int | None:
    """Lower the calling thread's CPU priority by ``by`` nice steps, up to 19, and return its new
    nice value (None where nothing changed).

    ds-swift's background workers (buddy copier, log writer, digests, checkpoint writers) call it
    first: where the cores are busy, the training thread, which every rank's pipeline waits for,
    runs first, and the workers take the time it leaves (a GPU rank's thread waiting for its
    kernels, the bubbles). Where the cores are idle it changes nothing. Linux keeps a nice value
    per thread; elsewhere this does nothing. The watchdog never calls it: its heartbeat must not
    wait behind a busy training thread, or a slow machine would look dead."""
    import os

    if not sys.platform.startswith("linux") or by <= 0:
        return None
    if _BENCH_SWITCH in os.environ.get(_BENCH_ENV, "").split(","):
        return None
    try:
        tid = threading.get_native_id()
        nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + by)
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        return nice
    except OSError:
        return None
