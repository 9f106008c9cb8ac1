"""Heartbeats as counters, judged on the observer's own monotonic clock.

A heartbeat that carries a wall-clock time compares two hosts' clocks: a peer whose clock runs
15 s behind looks 15 s silent. Every heartbeat in ds-swift is therefore a counter in the job store
that its owner bumps (a worker's ``hb/<rank>``, an agent's ``launch/alive/<node>``), and an
observer judges it by when *it* last saw the counter move, on its own ``time.monotonic()``:
no clock of another host enters a verdict.

The observer's own view can go stale too: a store that stalls (an etcd leader election, a loaded
store host) stalls every beat and every read alike, and when it comes back the observer's first
read may come before the peer's next beat lands. So an observer that had no contact with the store
for a while (an error, or a gap between two rounds longer than ``max_gap_s``) starts every peer's
silence afresh: no verdict for a full timeout after its own store trouble.

Used by the worker's watchdog (:mod:`ds_swift.detect.watchdog`), the comm-error classifier
(:mod:`ds_swift.detect.classify`), the agents' look at their own ranks (``launch/health.py``,
which read the ranks' :class:`BeatFile`) and the agents' liveness (``launch/liveness.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["BeatFile", "CounterClock", "read_beat"]

K = TypeVar("K", bound=Hashable)


def _monotonic() -> float:
    return time.monotonic()  # looked up at each call: tests give each simulated host its own clock


class CounterClock(Generic[K]):
    """How long each watched counter has not moved, on this observer's clock.

    Args:
        timeout_s: a counter silent for longer is stale (:meth:`stale`).
        clock: this observer's monotonic clock.
        max_gap_s: a gap between two rounds of reads longer than this (the observer's own store
            stalled, or its process was descheduled) restarts every silence; default half the timeout.
        first_grace_s: how long a counter never seen above 0 may stay there (a process still
            importing); default the timeout.
    """

    def __init__(
        self,
        timeout_s: float,
        clock: Callable[[], float] = _monotonic,
        max_gap_s: float | None = None,
        first_grace_s: float | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.max_gap_s = timeout_s / 2 if max_gap_s is None else max_gap_s
        self.first_grace_s = timeout_s if first_grace_s is None else max(timeout_s, first_grace_s)
        self._seen: dict[K, tuple[int, float]] = {}
        self._last_contact: float | None = None
        self._round_start = 0.0
        self._blind = False
        self.restarts = 0
        """How many times the observer's own store trouble restarted every silence (for tests, logs)."""

    def store_error(self) -> None:
        """This observer's store call failed: what it reads next says nothing of the peers' past."""
        self._blind = True

    def begin_round(self) -> float:
        """Call before a round of reads; returns the observer's clock. Restarts every silence if
        the observer itself was cut off from the store since the last round."""
        now = self.clock()
        last = self._last_contact
        if self._blind or (last is not None and now - last > self.max_gap_s):
            self._seen = {key: (count, now) for key, (count, _) in self._seen.items()}
            self.restarts += 1
        self._blind = False
        self._round_start = now
        return now

    def end_round(self) -> None:
        """The round's reads all succeeded. A round that itself took longer than ``max_gap_s`` (the
        store stalled mid-round: what it read may predate the peers' next beats) restarts every
        silence at the next round, as an error would."""
        now = self.clock()
        if now - self._round_start > self.max_gap_s:
            self._blind = True
        self._last_contact = now

    def observe(self, key: K, count: int, now: float) -> float:
        """Record ``key``'s counter as read at ``now``; returns how long it has not moved."""
        seen = self._seen.get(key)
        if seen is None or count != seen[0]:
            self._seen[key] = (count, now)
            return 0.0
        return now - seen[1]

    def silent_for(self, key: K) -> float:
        seen = self._seen.get(key)
        return 0.0 if seen is None else self.clock() - seen[1]

    def stale(self, key: K, count: int, now: float) -> float | None:
        """:meth:`observe`, then the silence if it passed the timeout (the first-beat grace for a
        counter still at 0), else None."""
        silent = self.observe(key, count, now)
        limit = self.timeout_s if count > 0 else self.first_grace_s
        return silent if silent > limit else None

    def forget(self, key: K) -> None:
        """Stop judging ``key`` (a new generation, a replaced rank): its silence starts again when next read."""
        self._seen.pop(key, None)

    def reset(self) -> None:
        """Every silence starts again at the next read."""
        self._seen.clear()


class BeatFile:
    """A rank's heartbeat for its machine's agent alone: a small file in a directory on the machine
    (``SWIFT_BEAT_DIR``, made by the agent), ``"<count> <timeout_s> <note>"``, replaced at each beat.

    The agent reads its ranks' files on its own clock (launch/health.py) and fails its machine when
    one is silent for the rank's timeout; the job store sees one liveness counter per machine (the
    agents', launch/liveness.py) instead of one per rank: a rank's beat costs no store request.
    """

    def __init__(self, directory: str, rank: int, timeout_s: float) -> None:
        self.path = os.path.join(directory, str(rank))
        self.timeout_s = timeout_s
        found = read_beat(self.path)
        self.count = found[0] if found is not None else 0  # a respawned rank counts on

    def beat(self, note: str = "") -> None:
        self.count += 1
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{self.count} {self.timeout_s!r} {note}".rstrip())
        os.replace(tmp, self.path)  # readers see the old beat or the new one, never half of one

    def finish(self) -> None:
        """The rank stopped beating on purpose (training ended, its watchdog stopped): a last beat
        with no timeout, so that its agent does not take the rest of the process's exit (its process
        groups' teardown can take seconds) for a hang. A watchdog started again beats as before."""
        self.timeout_s, timeout_s = float("inf"), self.timeout_s
        try:
            self.beat("stopped")
        finally:
            self.timeout_s = timeout_s


def read_beat(path: str) -> tuple[int, float, str] | None:
    """(count, timeout_s, note) of the beat file at ``path``; None before the rank's first beat."""
    try:
        with open(path) as f:
            count, timeout_s, *note = f.read().split(" ", 2)
        return int(count), float(timeout_s), note[0] if note else ""
    except (OSError, ValueError):
        return None
