"""The failure flag relayed on the machine: one store wait per machine, none per rank.

Under ``ds-swift-launch`` a rank beats in a file for its agent (:class:`ds_swift.detect.beats.BeatFile`)
and learns that its generation failed from its agent too: the agent's :class:`FailureRelay` thread
waits on the job store's failure flag once for the whole machine (a blocking wait on the key its
declarer writes after the flag, ``gen<g>/relay``, woken the moment it is set), writes the reason
next to the beat files (``failed.<generation>``) and wakes each rank's watchdog through its FIFO
(``wake.<rank>``), on which the watchdog blocks with ``select``. At the job's end the agents write
``"job over"`` there: every relay's wait ends while the store is still up.

Why not a store wait per rank: at 16,384 ranks each rank's wait in 2 s slices was 1 request a second
(16k a second, most of the steady load of one TCPStore server), every wait that timed out logged two
c10d warnings in the rank's output, and a wait inside torch's C++ store client cannot be interrupted
(the end of training waited it out). A ``select`` on a FIFO costs no store request, logs nothing, and
the watchdog's ``stop`` wakes it at once.

The rank keeps a backstop: it reads the flag itself every :data:`BACKSTOP_S` (a relay that died, a
machine whose agent cannot reach the store), so a failure is never missed, at worst seen later.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ds_swift.logs import say

if TYPE_CHECKING:
    from ds_swift.jobstore.membership import JobStore

__all__ = ["BACKSTOP_S", "FailureRelay", "WakeFifo", "open_wake", "relay_failure", "relayed_failure"]

#: how often a rank whose agent relays the flag reads it in the store itself, in case the relay is gone
BACKSTOP_S = 10.0
#: the relay's store wait, per request (a wait that times out logs a warning in torch's store client)
RELAY_WAIT_S = 3600.0
#: what the relay key says when the job ended (:meth:`FailureRelay.close`)
JOB_OVER = "job over"


def _failed_path(directory: str, generation: int) -> str:
    return os.path.join(directory, f"failed.{generation}")


def relayed_failure(directory: str, generation: int) -> str | None:
    """The reason the agent relayed for ``generation``'s failure, or None (not failed, or not yet relayed)."""
    try:
        with open(_failed_path(directory, generation)) as f:
            return f.read()
    except OSError:
        return None


def relay_failure(directory: str, generation: int, reason: str) -> None:
    """Write ``generation``'s failure next to the beat files and wake every rank's watchdog."""
    path = _failed_path(directory, generation)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(reason)
    os.replace(tmp, path)  # a watchdog reads the whole reason or none of it
    for name in os.listdir(directory):
        if name.startswith("wake."):
            _poke(os.path.join(directory, name))


def _poke(fifo: str) -> None:
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # ENXIO: no watchdog reads it (its rank ended); ENOENT: gone
    try:
        os.write(fd, b"!")
    except OSError as exc:
        if exc.errno != errno.EAGAIN:  # full: woken already
            raise
    finally:
        os.close(fd)


class WakeFifo:
    """A rank's wake-up FIFO (``wake.<rank>`` in its beat directory): the agent's relay writes to it,
    and so does the rank's own :meth:`poke` (its watchdog stopping). Held open for writing by the
    rank itself, so that a writer that comes and goes never leaves it at end-of-file."""

    def __init__(self, directory: str, rank: int) -> None:
        self.directory = directory
        self.path = os.path.join(directory, f"wake.{rank}")
        with contextlib.suppress(FileExistsError):  # a respawned rank's
            os.mkfifo(self.path, 0o600)
        self._r = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._w = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)

    def wait(self, generation: int, timeout_s: float) -> str | None:
        """``generation``'s relayed failure, waiting up to ``timeout_s`` for a wake-up."""
        reason = relayed_failure(self.directory, generation)
        if reason is None and timeout_s > 0:
            ready, _, _ = select.select([self._r], [], [], timeout_s)
            if ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._r, 4096)
            reason = relayed_failure(self.directory, generation)
        return reason

    def poke(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._w, b"!")

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)


def open_wake(directory: str, rank: int) -> WakeFifo | None:
    """Rank ``rank``'s :class:`WakeFifo`, or None (said: the rank then waits on the store itself)."""
    try:
        return WakeFifo(directory, rank)
    except OSError as exc:
        say(
            f"watchdog: no wake-up FIFO in {directory} ({exc}): this rank waits on the failure flag in the job "
            "store itself (a request a second), not through its agent",
            rank,
            level=logging.WARNING,
            name=__name__,
        )
        return None


class FailureRelay:
    """The agent's thread that waits on the failure flag of each generation in turn, from
    ``generation`` on, and relays each to the machine's ranks (:func:`relay_failure`). Its own store
    connection (``store_factory``): a blocking wait holds a client's connection. A store error is
    said once and retried on a new connection each second; the ranks' backstop reads cover the gap."""

    def __init__(self, store_factory: Callable[[], JobStore], directory: str, generation: int, name: str) -> None:
        self._factory = store_factory
        self.directory = directory
        self.generation = generation
        self.name = name
        self._thread = threading.Thread(target=self._run, name=f"ds-swift-relay-{name}", daemon=True)

    def start(self) -> FailureRelay:
        self._thread.start()
        return self

    def close(self, store: JobStore, timeout_s: float = 2.0) -> None:
        """The job is over: end every relay's wait (this agent's and the others', on any host) with
        ``"job over"`` while the store is still there, and wait for this one's thread to end."""
        with contextlib.suppress(Exception):  # the store gone already: the process ends anyway
            store.set(store.relay_key(max(self.generation, store.generation())), JOB_OVER)
        self._thread.join(timeout_s)

    def catch_up(self, store: JobStore) -> bool:
        """Relay every failed generation from the one waited on to the job's current one, and wait on
        that one next; True if any was relayed. The job's generation is read, not assumed one more than
        the last relayed: a relay behind (a wait that ended late, a store error, its first wait started
        after generations failed), or a generation the job left without its flag, never leaves the relay
        waiting on a generation that is over (its ranks would learn of every later failure only from
        their backstop read, :data:`BACKSTOP_S` late)."""
        relayed = False
        while True:
            reason = store.failure(self.generation)
            if reason is not None:
                relay_failure(self.directory, self.generation, reason)
                self.generation += 1
                relayed = True
                continue
            current = store.generation()
            if current <= self.generation:
                return relayed
            self.generation = current  # left without a failure flag: nothing of it to relay

    def _run(self) -> None:
        store: JobStore | None = None
        said = False
        while True:
            try:
                store = store or self._factory()
                t0 = time.monotonic()
                woken = store.wait_value(store.relay_key(self.generation), RELAY_WAIT_S)
                if woken == JOB_OVER:
                    return
                if not self.catch_up(store) and time.monotonic() - t0 < 1.0:
                    time.sleep(1.0)  # a store whose waits do not block (a test's): no busy loop
                said = False
            except FileNotFoundError:
                return  # the agent removed the beat directory: the job is over
            except Exception as exc:  # noqa: BLE001 - the relay must not end the agent; the ranks read the flag too
                if not said:
                    say(
                        f"{self.name}: relaying the failure flag to this machine's ranks failed ({type(exc).__name__}: "
                        f"{exc}); retrying each second, the ranks read the flag themselves every {BACKSTOP_S:g} s "
                        "meanwhile",
                        level=logging.WARNING,
                        name=__name__,
                    )
                    said = True
                store = None
                time.sleep(1.0)
