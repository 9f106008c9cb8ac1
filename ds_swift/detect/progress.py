"""Progress of the training thread, for hang detection by the watchdog thread.

The watchdog's heartbeat says the *process* is alive; it says nothing of a training thread stuck
in a deadlock, a collective that never completes, or a device that stopped making progress. So
the training thread also beats: every pipeline-schedule instruction records its name, the
iteration and the time (three attribute writes, no lock, no store traffic). The watchdog thread
reads them at each poll, publishes them with its heartbeat (what a peer names when this rank's
heartbeat stops: a SIGSTOPped process), and declares this rank hung after
``watchdog.hang_timeout_s`` without a new instruction while an iteration runs.

Only :meth:`Progress.arm`-ed time counts: from the start of an iteration's instructions to their
end. Periodic checkpoint saves, recoveries and the user's code between iterations are outside it
(they have timeouts of their own).
"""

from __future__ import annotations

import time

__all__ = ["Progress"]


class Progress:
    """What the training thread last started, and when (monotonic seconds)."""

    def __init__(self) -> None:
        self.what = "start-up"
        self.iteration = -1
        self.count = 0
        self.t = time.monotonic()
        self.armed = False

    def beat(self, what: str, iteration: int) -> None:
        """The training thread starts instruction ``what`` of ``iteration`` (the hot path)."""
        self.what = what
        self.iteration = iteration
        self.count += 1
        self.t = time.monotonic()

    def arm(self, on: bool) -> None:
        """Count time without progress from now (on) or not at all (off)."""
        self.t = time.monotonic()
        self.armed = on

    def stuck_for(self, now: float | None = None) -> float:
        """Seconds since the last beat while armed (0 while not armed)."""
        if not self.armed:
            return 0.0
        return (time.monotonic() if now is None else now) - self.t

    def note(self) -> str:
        """Where the training thread is, for a heartbeat: ``<instruction> of iteration <i>``."""
        return f"{self.what} of iteration {self.iteration}"
