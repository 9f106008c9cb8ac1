"""The checkpoint's small file-system calls, off the training thread and with a deadline.

A shared file system that hangs (an NFS server gone, a Lustre OST failing over) holds whatever
thread touches it. The periodic checkpoint's own calls used to be made on the training thread with
nothing watching them: the read of the completion marker after every iteration while an
asynchronous save is pending, the scan of every tag's marker after each save, and rank 0's removal
and write of the marker. Training waited as long as the file system did (outside the iteration,
where the hang detector does not look).

:class:`FsCalls` runs them on one daemon thread of its own, one at a time:

- :meth:`FsCalls.call` waits for a call at most ``deadline_s``; on expiry it says so, loudly, and
  returns ``(False, None)``: the caller goes on without it (a checkpoint that does not count yet);
- :meth:`FsCalls.ask` never waits: it starts a call, and a later :meth:`ask` collects its answer
  (the per-iteration marker check).

A call still hung when the next one comes is not queued behind it: the next one fails at once
(said once per hang), so a file system that never answers costs the training thread nothing
more. The hung thread is a daemon: it never holds up the process's exit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ds_swift.logs import say

__all__ = ["FsCalls"]


class _Call:
    def __init__(self, fn: Callable[[], Any], what: str, asked: bool) -> None:
        self.fn, self.what, self.asked = fn, what, asked
        self.t0 = time.monotonic()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class FsCalls:
    """One thread that makes the checkpoint's file-system calls for the training thread.

    Args:
        directory: where the calls go (named in what is said).
        deadline_s: the longest the training thread waits for one call.
        rank: named in what is said.
    """

    def __init__(self, directory: str, deadline_s: float, rank: int | None = None) -> None:
        self.directory, self.deadline_s, self.rank = directory, deadline_s, rank
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._current: _Call | None = None
        self._said: _Call | None = None  # the hung call already said (once per hang)

    def call(self, fn: Callable[[], Any], what: str) -> tuple[bool, Any]:
        """``fn()`` on the thread, waited for at most ``deadline_s``: ``(True, result)``, or
        ``(False, None)`` where it did not finish in time (said loudly; it goes on in the
        background). An error ``fn`` raised is raised here."""
        c = self._start(fn, what, asked=False)
        if c is None:
            return False, None
        if not c.done.wait(self.deadline_s):
            self._hung(c)
            return False, None
        return True, self._take(c)

    def ask(self, fn: Callable[[], Any], what: str) -> tuple[str, Any] | None:
        """Without waiting: ``(what, result)`` of the call :meth:`ask` started earlier once it has
        finished (and then ``fn`` is started anew at the next ask), else None (started now, or still
        running: said loudly once it runs past ``deadline_s``)."""
        c = self._current
        if c is not None and c.done.is_set() and c.asked:
            self._current = None
            return c.what, self._take(c)
        if c is not None and not c.done.is_set():
            if time.monotonic() - c.t0 >= self.deadline_s:
                self._hung(c)
            return None
        self._start(fn, what, asked=True)
        return None

    def _start(self, fn: Callable[[], Any], what: str, asked: bool) -> _Call | None:
        c = self._current
        if c is not None and not c.done.wait(max(0.0, self.deadline_s - (time.monotonic() - c.t0))):
            self._hung(c)
            return None  # nothing queues behind a hung call
        if c is not None and not c.asked:
            self._late(c)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ds-swift-ckpt-fs", daemon=True)
            self._thread.start()
        c = _Call(fn, what, asked)
        self._current = c
        self._queue.put(c)
        return c

    def _take(self, c: _Call) -> Any:
        if self._current is c:
            self._current = None
        if self._said is c:
            say(
                f"the file system under {self.directory} answered again ({c.what} took "
                f"{time.monotonic() - c.t0:.0f} s)",
                self.rank,
                level=logging.WARNING,
                name=__name__,
            )
            self._said = None
        if c.error is not None:
            raise c.error
        return c.result

    def _late(self, c: _Call) -> None:
        """A :meth:`call` that finished after its caller stopped waiting: only what it ended with is said."""
        try:
            self._take(c)
        except Exception as exc:  # noqa: BLE001 - its caller has gone on: said, not raised
            say(
                f"{c.what} failed after its deadline: {type(exc).__name__}: {str(exc)[:200]}",
                self.rank,
                level=logging.WARNING,
                name=__name__,
            )

    def _hung(self, c: _Call) -> None:
        if self._said is c:
            return
        self._said = c
        say(
            f"{c.what} has not returned for {time.monotonic() - c.t0:.0f} s: the file system under "
            f"{self.directory} is slow or hung. Training goes on; checkpoints do not count until it answers "
            "(a recovery meanwhile loads the last complete one, and the logs since it are kept)",
            self.rank,
            level=logging.WARNING,
            name=__name__,
        )

    def _run(self) -> None:
        from ds_swift.threadname import name_os_thread

        name_os_thread()
        while True:
            c = self._queue.get()
            try:
                c.result = c.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                c.error = exc
            c.done.set()
