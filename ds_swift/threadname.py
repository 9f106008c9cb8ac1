"""OS-level names, and scheduling, for ds-swift's background threads.

Python 3.11 names a ``threading.Thread`` for Python only: ``top -H``, ``py-spy``, ``perf`` and
``/proc/<pid>/task/<tid>/comm`` all show every thread as ``python``. Each ds-swift thread calls
:func:`name_os_thread` first, so that what it costs can be told apart from the training thread and
from gloo's (benchmarks/gpu_overhead.py ``--breakdown`` sums CPU time per thread name).

The threads the training thread hands work to (ds_swift.background_thread: buddy copier, digests, checkpoint
writers, loggers), and the watchdog, also call :func:`yield_on_wakeup`. Without it, the training
thread's hand-over woke the worker *onto its own core*: Linux lets a thread that wakes preempt the
running one, so the training thread stood in ``queue.put`` while the worker ran its share of the
round (py-spy on the tiny CPU GPT, 4 ranks on 2 cores: ``BackgroundThread.submit`` was a fifth of ds-swift's
own samples on the training threads). ``SCHED_BATCH`` keeps the worker's share of the CPU (its nice
value is unchanged) and only takes away that wake-up preemption, so the work runs where a core is
free: beside the training thread on a GPU host, in its communication waits on a busy one.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["name_os_thread", "os_thread_name", "threads_yield_on_wakeup", "yield_on_wakeup"]

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


def yield_on_wakeup() -> bool:
    """Put the calling thread under ``SCHED_BATCH`` (Linux): it no longer preempts the thread running
    on a core when it wakes up, with the same share of the CPU (see the module docstring). True when
    set; False where the OS has no such policy or refuses it (the thread then runs as before: this
    is about where the work runs, never whether)."""
    if not _batch_available():
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: the calling thread (Linux)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def threads_yield_on_wakeup() -> Iterator[bool]:
    """Threads started inside (a C++ library's too: a gloo group starts its loop and work threads
    when it is created) run under ``SCHED_BATCH``, which a new thread inherits; the calling thread's
    own policy is back on leaving. Yields whether it applied: only from ``SCHED_OTHER``, the one
    policy an unprivileged thread can always return to."""
    if not _batch_available() or os.sched_getscheduler(0) != os.SCHED_OTHER or not yield_on_wakeup():
        yield False
        return
    try:
        yield True
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def _batch_available() -> bool:
    """Linux with ``SCHED_BATCH``, and not benchmarks/gpu_overhead.py's ``-wakeup`` variant
    (``SWIFT_BENCH_WITHOUT=wakeup``, see ds_swift.protect.costs, which this leaf module does not
    import), which measures what it buys."""
    without = (n.strip() for n in os.environ.get("SWIFT_BENCH_WITHOUT", "").split(","))
    return hasattr(os, "SCHED_BATCH") and sys.platform.startswith("linux") and "wakeup" not in without
