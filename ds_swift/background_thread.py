"""One background thread of ds-swift: a queue, a named thread, a stop, an error policy, stats.

The checkpoint writers, the buddy copier, the digest publisher and the update logger each take
items from the training thread and handle them off the critical path. :class:`BackgroundThread` is that
loop once: the training thread :meth:`~BackgroundThread.submit`\\ s, a daemon thread named ``ds-swift-<role>``
(OS name ``sw-<role>``: ds_swift.threadname) calls ``handle(item)`` for each item in order, and
:meth:`~BackgroundThread.wait_idle` says when all of it is done. A bound on queued items or bytes makes a
producer faster than the handler wait (counted in :attr:`ThreadStats.stall_s`, never hidden)
instead of holding ever more host memory; ``stuck_after_s`` bounds that wait where a handler that
makes no progress at all (a hung file system) must not hold the training thread for good.

What an error in ``handle`` does is the owner's choice (:class:`OnError`), because it differs by
what the thread protects: a checkpoint that failed to persist is reported and the next one is
tried (``RECORD``); a buddy copier whose round failed stops, and the training thread turns copying
off loudly at its next step (``STOP``); an update logger that cannot write stops logging, loudly,
and training goes on (``OFF``). No policy drops an error silently: ``RECORD`` and ``STOP`` keep it
for :meth:`~BackgroundThread.check` (which raises it on the training thread) and the ``on_error`` hook;
``OFF`` needs the hook, which must say it.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ds_swift.threadname import name_os_thread, yield_on_wakeup

__all__ = ["OnError", "BackgroundThread", "ThreadStats"]

T = TypeVar("T")


class OnError(enum.Enum):
    """What a :class:`BackgroundThread` does when ``handle`` raises."""

    RECORD = "record"
    """Keep the error (``check`` raises it once) and go on with the next item."""
    STOP = "stop"
    """Keep the error (``check`` raises it) and end the thread: the items queued behind it and
    later ones are dropped unhandled (``submit`` says False)."""
    OFF = "off"
    """As ``STOP``, for a protection that turns off for good (``off`` says why; the ``on_error``
    hook must say it loudly) while training goes on."""


@dataclass
class ThreadStats:
    """What a worker did (read from any thread; written by its own thread and ``submit``)."""

    items: int = 0
    """Items handled without an error."""
    bytes: int = 0
    """Bytes of the items handled (as ``submit`` was told)."""
    errors: int = 0
    busy_s: float = 0.0
    """Wall time spent in ``handle``."""
    cpu_s: float = 0.0
    """CPU time the thread spent in ``handle``."""
    stall_s: float = 0.0
    """Time producers waited in ``submit`` for room (the bound on items or bytes)."""
    max_queued_bytes: int = 0


_STOP = object()


class BackgroundThread(Generic[T]):
    """A daemon thread that handles submitted items in order.

    Args:
        name: the thread's name, ``ds-swift-<role>`` (tests and benchmarks/gpu_overhead.py tell the
            threads apart by it).
        handle: called on the thread with each item.
        on_error: what an error in ``handle`` does (:class:`OnError`).
        on_error_hook: called on the thread with each error, after it is recorded (for ``OFF``:
            say it loudly).
        max_items: items queued (not yet handled) beyond which ``submit`` waits; 0: no bound.
        max_bytes: bytes queued or in ``handle`` beyond which ``submit`` waits (an item alone
            always goes); 0: no bound.
        stuck_after_s: a ``submit`` waiting for room gives up once no item has finished for this
            long: the worker turns off (``off`` says why), and that submit and every later one
            return False. A slow handler that still finishes items never trips it. 0: wait as long
            as it takes.
        setup, teardown: run on the thread before the first item and after the last (teardown also
            after an error stopped it). A setup that raises is an error that ends the worker.
    """

    def __init__(
        self,
        name: str,
        handle: Callable[[T], object],
        *,
        on_error: OnError = OnError.RECORD,
        on_error_hook: Callable[[BaseException], None] | None = None,
        max_items: int = 0,
        max_bytes: int = 0,
        stuck_after_s: float = 0.0,
        setup: Callable[[], None] | None = None,
        teardown: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._handle = handle
        self.on_error = on_error
        self._hook = on_error_hook
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.stuck_after_s = stuck_after_s
        self._setup, self._teardown = setup, teardown
        self.stats = ThreadStats()
        self._queue: queue.SimpleQueue[tuple[object, int]] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._unfinished = 0  # submitted, not yet handled (or dropped)
        self._queued = 0  # submitted, not yet taken by the thread
        self._bytes = 0  # bytes of the unfinished items
        self._done = 0  # items finished (handled, failed or dropped): the progress stuck_after_s watches
        self._errors: list[BaseException] = []
        self._raised = 0
        self.off: str | None = None
        """Why the worker stopped handling items (an error under ``STOP``/``OFF``); None while it works."""
        self._closed = False  # stop() was called: later items are refused, not left pending
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ producer side
    def start(self) -> None:
        """Start the thread (``submit`` does on the first item)."""
        with self._cv:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def submit(self, item: T, nbytes: int = 0) -> bool:
        """Queue ``item`` (``nbytes``: its size, for the byte bound and the stats); waits while the
        bound is reached. False, and the item dropped, once the worker is off or stopped."""
        self.start()
        with self._cv:
            if self._refused():
                return False
            if self._full(nbytes):
                t0 = time.perf_counter()
                self._wait_for_room(nbytes, t0)
                self.stats.stall_s += time.perf_counter() - t0
                if self._refused():
                    return False
            self._unfinished += 1
            self._queued += 1
            self._bytes += nbytes
            self.stats.max_queued_bytes = max(self.stats.max_queued_bytes, self._bytes)
            self._queue.put((item, nbytes))
        return True

    def _wait_for_room(self, nbytes: int, t0: float) -> None:
        """Under the lock: until the bound lets ``nbytes`` in, the worker is refused, or (with
        ``stuck_after_s``) no item has finished for that long, which turns the worker off."""
        done, since = self._done, t0
        while self._full(nbytes) and not self._refused():
            self._cv.wait(1.0 if not self.stuck_after_s else min(1.0, self.stuck_after_s))
            now = time.perf_counter()
            if self._done != done:
                done, since = self._done, now
            elif self.stuck_after_s and now - since >= self.stuck_after_s:
                self.off = (
                    f"{self.name}: no item finished in {now - since:.0f} s while {self._unfinished} wait "
                    f"({self._bytes} bytes): its handler is stuck (a hung file system or store?)"
                )
                self._cv.notify_all()

    def _refused(self) -> bool:
        return self.off is not None or self._closed or self._thread is None or not self._thread.is_alive()

    def _full(self, nbytes: int) -> bool:
        if self.max_items and self._queued >= self.max_items:
            return True
        return bool(self.max_bytes and self._bytes and self._bytes + nbytes > self.max_bytes)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Until every item submitted so far is handled (or dropped); False if ``timeout_s`` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: self._unfinished == 0, timeout_s)

    @property
    def pending(self) -> int:
        """Items submitted and not yet handled (the one in ``handle`` included)."""
        with self._cv:
            return self._unfinished

    @property
    def queued_bytes(self) -> int:
        with self._cv:
            return self._bytes

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        """The first error ``handle`` raised (None: none yet)."""
        with self._cv:
            return self._errors[0] if self._errors else None

    @property
    def errors(self) -> list[BaseException]:
        with self._cv:
            return list(self._errors)

    def check(self) -> None:
        """Raise, on the calling (training) thread, the first error not raised yet."""
        with self._cv:
            if self._raised >= len(self._errors):
                return
            err, self._raised = self._errors[self._raised], len(self._errors)
        raise err

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Handle what is queued, then end the thread (waiting at most ``timeout_s``). True when the
        thread has ended."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            t = self._thread
        if t is None:
            return True
        self._queue.put((_STOP, 0))
        t.join(timeout_s)
        return not t.is_alive()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        name_os_thread()  # top -H, py-spy and the overhead benchmark tell it apart
        yield_on_wakeup()  # a hand-over must not stop the training thread while this one runs
        try:
            if self._setup is not None:
                self._setup()
            while self.off is None:  # STOP and OFF end the thread at their first error
                item, nbytes = self._queue.get()
                if item is _STOP:
                    return
                with self._cv:
                    self._queued -= 1
                    self._cv.notify_all()
                self._one(item, nbytes)  # type: ignore[arg-type]
                item = None  # an item may hold large host buffers: not until the next one comes
                self._finished(nbytes)
        except Exception as exc:  # noqa: BLE001 - setup failed: nothing can be handled; said as any error
            self._failed(exc, stop=True)
        finally:
            with self._cv:
                self._closed = True  # from here on submit refuses, so the drain below sees every item
                self._cv.notify_all()
            self._drop_queued()
            if self._teardown is not None:
                self._teardown()

    def _finished(self, nbytes: int, queued: int = 0) -> None:
        with self._cv:
            self._queued -= queued
            self._unfinished -= 1
            self._bytes -= nbytes
            self._done += 1
            self._cv.notify_all()

    def _drop_queued(self) -> None:
        """What is still queued once the thread ends (after an error under STOP/OFF) is dropped,
        not left pending: a ``wait_idle`` must not wait for a thread that is gone."""
        while True:
            try:
                item, nbytes = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                self._finished(nbytes, queued=1)

    def _failed(self, exc: BaseException, stop: bool) -> None:
        with self._cv:
            self._errors.append(exc)
            self.stats.errors += 1
            if stop:
                self.off = f"{type(exc).__name__}: {exc}"
        if self._hook is not None:
            self._hook(exc)

    def _one(self, item: T, nbytes: int) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self._handle(item)
        except Exception as exc:  # noqa: BLE001 - the owner's policy decides; never dropped silently
            self._failed(exc, stop=self.on_error is not OnError.RECORD)
        else:
            self.stats.items += 1
            self.stats.bytes += nbytes
        finally:
            self.stats.busy_s += time.perf_counter() - t0
            self.stats.cpu_s += time.thread_time() - c0
