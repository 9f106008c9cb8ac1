"""The writer thread: appends queued messages to the log off the training thread.

:class:`WriterThread` drains a FIFO of :class:`WriteItem` into a ``msglog.writer.LogWriter``. The
training thread only enqueues; a bound on the bytes in flight keeps a slow disk from exhausting
host memory (the training thread then waits, and the wait is counted in the stats, never hidden).

A write that fails (ENOSPC, EIO, ...) is recorded as a ``LogWriteError`` naming the file; it is
raised by the next :meth:`WriterThread.check`/``flush`` on the training side. Records are never
dropped silently.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ds_swift.background_thread import BackgroundThread
from ds_swift.msglog.writer import LogWriteError, LogWriter, MessageMeta

__all__ = ["HostStaged", "Staged", "WriteItem", "WriterStats", "WriterThread"]

_log = logging.getLogger(__name__)


class Staged(Protocol):
    """Host copies of a message's tensors that may still be in flight (a CUDA copy)."""

    def ready(self) -> bool: ...

    def take(self) -> list[torch.Tensor]: ...

    def release(self, tensors: list[torch.Tensor]) -> None: ...


@dataclass
class HostStaged:
    """Tensors already in host memory."""

    tensors: list[torch.Tensor]

    def ready(self) -> bool:
        return True

    def take(self) -> list[torch.Tensor]:
        out, self.tensors = self.tensors, []
        return out

    def release(self, tensors: list[torch.Tensor]) -> None:
        pass


@dataclass
class WriteItem:
    meta: MessageMeta
    staged: Staged
    nbytes: int


@dataclass
class _Call:
    fn: Callable[[LogWriter], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


@dataclass
class WriterStats:
    records: int = 0
    messages: int = 0
    bytes: int = 0
    failed_messages: int = 0
    stall_s: float = 0.0
    max_inflight_bytes: int = 0
    cpu_s: float = 0.0  # CPU time the writer thread spent writing (checksums, syscalls)


class WriterThread:
    """A daemon thread that appends queued messages; the only thread touching the LogWriter."""

    #: how often a not-yet-complete CUDA copy at the head of the queue is polled
    POLL_S = 0.0005

    def __init__(
        self,
        writer: LogWriter,
        max_inflight_bytes: int = 1 << 30,
        name: str = "ds-swift-log-writer",
        nice: int | None = 19,
        stuck_after_s: float = 0.0,
    ) -> None:
        """
        Args:
            writer: the LogWriter this thread owns.
            max_inflight_bytes: queued bytes beyond which :meth:`submit` waits.
            nice: the writer thread's nice value (Linux: per thread), None to leave it. Without
                a copy engine (CPU training) the "bubble-time copy" is CPU work; at nice 19 the
                kernel gives the writer the cores the training ranks leave idle (their bubbles)
                and only a small share while they compute, and it is never starved outright
                (SCHED_IDLE could be: then backpressure would stall training).
            stuck_after_s: a :meth:`submit` waiting for room while no message has been written for
                this long stops the thread's intake and raises (ds_swift.background_thread.Worker): a hung
                disk must not hold the training thread (0: wait as long as it takes).
        """
        self.writer = writer
        self.max_inflight_bytes = max_inflight_bytes
        self.nice = nice
        self._stats = WriterStats()
        self._lock = threading.Lock()  # guards the error list (written here, read by the training thread)
        self._errors: list[LogWriteError] = []
        self._raised = 0
        # A failed write is recorded by _write itself (as a LogWriteError naming the file) and raised
        # by the next check/flush on the training thread; the worker goes on with the next message.
        self._worker: BackgroundThread[WriteItem | _Call] = BackgroundThread(
            name, self._one, max_bytes=max_inflight_bytes, stuck_after_s=stuck_after_s, setup=self._renice
        )
        self._worker.start()
        # A daemon thread dies silently at interpreter exit; write out what is queued first.
        atexit.register(self._at_exit)

    @property
    def stats(self) -> WriterStats:
        self._stats.stall_s = self._worker.stats.stall_s
        self._stats.max_inflight_bytes = self._worker.stats.max_queued_bytes
        return self._stats

    def _at_exit(self) -> None:
        if self._worker.alive and self.pending():
            try:
                self.call(lambda w: None, 60.0)
            except Exception as exc:  # at exit there is nobody left to raise to
                _log.error("message log: %d items not written at exit: %s", self.pending(), exc)

    # ------------------------------------------------------------ producer side
    def submit(self, item: WriteItem) -> None:
        if not self._worker.submit(item, item.nbytes):
            raise self._stopped()

    def call(self, fn: Callable[[LogWriter], Any], timeout_s: float) -> Any:
        """Run ``fn(writer)`` on the writer thread after everything queued before it."""
        c = _Call(fn)
        if not self._worker.submit(c):
            raise self._stopped()
        if not c.done.wait(timeout_s):
            raise TimeoutError(f"message-log writer: {self.pending()} items still queued after {timeout_s:.1f} s")
        if c.error is not None:
            raise c.error
        return c.result

    def _stopped(self) -> LogWriteError:
        why = self._worker.off
        return LogWriteError(errno.EPIPE, "the message-log writer thread has stopped" + (f": {why}" if why else ""))

    def flush(self, timeout_s: float, sync: bool = False) -> None:
        """Wait until everything queued so far is on disk (fsync'd with ``sync``); raise any write error."""
        self.call((lambda w: w.sync()) if sync else (lambda w: None), timeout_s)
        self.check()

    def check(self) -> None:
        """Raise the first write error not raised yet."""
        with self._lock:
            if self._raised < len(self._errors):
                err = self._errors[self._raised]
                self._raised = len(self._errors)
                more = len(self._errors) - 1
                text = err.strerror or str(err)
                raise LogWriteError(err.errno, text + (f" (and {more} more failed writes)" if more > 0 else ""))

    @property
    def errors(self) -> list[LogWriteError]:
        with self._lock:
            return list(self._errors)

    def pending(self) -> int:
        return self._worker.pending

    def inflight_bytes(self) -> int:
        return self._worker.queued_bytes

    def close(self, timeout_s: float = 60.0) -> None:
        atexit.unregister(self._at_exit)
        if self._worker.alive and self._worker.off is None:  # off: it takes nothing more
            try:
                self.call(lambda w: None, timeout_s)
            finally:
                self._worker.stop(timeout_s)
        if self._worker.alive:
            # Still in a write on a hung disk (its intake is off): its files stay open for it, since
            # a descriptor closed under it could be reused by another file and take its late write.
            return
        self.writer.close()

    # ------------------------------------------------------------ consumer side
    def _renice(self) -> None:
        if self.nice is not None and hasattr(os, "setpriority"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError as exc:  # not permitted in some containers: run at normal priority
                _log.debug("message-log writer keeps its priority: %s", exc)

    def _one(self, item: WriteItem | _Call) -> None:
        if isinstance(item, _Call):
            try:
                item.result = item.fn(self.writer)
            except BaseException as exc:  # handed to the caller, who raises it
                item.error = exc
            item.done.set()
            return
        # One side stream: copies complete in order, so polling the head is enough.
        while not item.staged.ready():
            time.sleep(self.POLL_S)
        self._write(item)

    def _write(self, item: WriteItem) -> None:
        cpu0 = time.thread_time()
        tensors = item.staged.take()
        try:
            n = self.writer.write(item.meta, tensors)
            self._stats.records += len(tensors)
            self._stats.messages += 1
            self._stats.bytes += n
        except LogWriteError as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(LogWriteError(exc.errno, f"message log {self.writer.directory}: {exc}"))
        except Exception as exc:  # a bug must not kill the thread and leave flush() hanging
            self._fail(LogWriteError(errno.EIO, f"message log {self.writer.directory}: {type(exc).__name__}: {exc}"))
        finally:
            item.staged.release(tensors)
            self._stats.cpu_s += time.thread_time() - cpu0

    def _fail(self, exc: LogWriteError) -> None:
        _log.error("%s", exc)
        with self._lock:
            self._errors.append(exc)
            self._stats.failed_messages += 1
