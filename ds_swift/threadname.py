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

__all__ = ["name_os_thread", "os_thread_name"]

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
