"""What the Python interpreter itself costs a training process, and where ds-swift avoids it.

- :func:`collector_paused`: the cyclic garbage collector off while a large package imports (rank
  and warm-spare start-up). Importing torch, DeepSpeed and megatron-core makes hundreds of
  thousands of objects that live as long as the process; each collection that runs meanwhile
  walks all of them again. Measured on the 2-core host: megatron-core and ds-swift's modules
  1.3-1.5 -> 1.0 CPU-s per rank, DeepSpeed 1.7 -> 1.3. The collector is back on, as it was, when
  the imports are done; nothing is frozen.
- :func:`exit_process`: the end of a finished process without the interpreter's teardown of those
  objects (2-3 s per rank at the end of every job).
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

__all__ = ["collector_paused", "exit_process"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside; the collector's state (on, or off by the caller) after."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def exit_process(code: int | str | None = 0) -> NoReturn:
    """End this process with ``code`` (as ``sys.exit`` takes it) once training is over and the
    engine is closed: the atexit handlers run (ds-swift's, logging's, torch's), every open file is
    flushed, and the process ends without the interpreter's teardown.

    That teardown destroys the objects of torch, DeepSpeed and megatron-core (~300k) module by
    module: 2.3-2.9 s per process on the 2-core CI machine under load, of which a full garbage
    collection is 0.25 s; a job ends when its last rank does, and a test suite starts hundreds of
    them. None of it is the job's work: what a rank leaves behind it has written, and its files
    are flushed here. Where a non-daemon thread is still running this exits normally instead
    (ending the process would cut that thread off).
    """
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    code = 0 if code is None else int(code)
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if others:
        sys.exit(code)
    atexit._run_exitfuncs()
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads each object's __class__, and some objects
        # warn on any attribute read (torch.distributed.reduce_op's deprecation warning).
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001, S112 - a file that cannot flush now would not at teardown either
                continue
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S112 - a closed pipe: nothing left to say
            continue
    os._exit(code)
