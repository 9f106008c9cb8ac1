"""CheckFreq's checkpoint interval: chosen from measured costs, not guessed.

CheckFreq (Mohan et al., FAST '21) checkpoints in two phases, a snapshot to host memory that
training waits for and a persist in the background (:mod:`ds_swift.checkpoint.background`), and picks
the interval ``k`` by profiling: the first checkpoint (after ``profile_at`` iterations) measures
the snapshot ``s`` and persist ``w`` times against the iteration time ``t``, and

    k = max(ceil(s / (p * t)), ceil((s + w) / t), 1)

keeps the snapshot's share of training time under the allowed overhead ``p``
(``checkfreq.max_overhead``) and lets each persist finish before the next snapshot. Every rank
computes its own ``k``; the job takes the largest (one collective, once). The choice goes into
the job store, where a replacement rank started later finds it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from ds_swift import transport
from ds_swift.checkpoint.background import AsyncWriter, SaveStats
from ds_swift.logs import say

__all__ = ["CheckFreqTuner", "checkfreq_interval"]

STORE_KEY = "checkfreq/interval"


def checkfreq_interval(snapshot_s: float, persist_s: float, iteration_s: float, max_overhead: float) -> int:
    """CheckFreq's rule (see the module docstring)."""
    t = max(iteration_s, 1e-9)
    return max(1, math.ceil(snapshot_s / (max_overhead * t)), math.ceil((snapshot_s + persist_s) / t))


@dataclass
class CheckFreqTuner:
    """Measures iteration times until the profiling checkpoint, then chooses the interval."""

    max_overhead: float
    profile_at: int
    rank: int
    store: Any = None
    """The job store (:class:`ds_swift.jobstore.membership.JobStore`) or None."""
    chosen: int | None = None
    costs: dict[str, float] = field(default_factory=dict)
    _times: list[float] = field(default_factory=list)
    _last: float | None = None

    def __post_init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Take the job's choice from the store if made: a warm spare built its engine before the
        profiling checkpoint and learns the interval when it joins (every rank must save together)."""
        if self.store is not None and self.chosen is None:
            value = self.store.get(STORE_KEY)
            self.chosen = int(value) if value is not None else None

    def tick(self) -> None:
        """One iteration ended (the engine calls this after each step)."""
        now = time.perf_counter()
        if self._last is not None and self.chosen is None:
            self._times.append(now - self._last)
        self._last = now

    def choose(self, stats: SaveStats, writer: AsyncWriter) -> int:
        """After the profiling checkpoint's snapshot: wait for its persist (once), choose, agree."""
        writer.wait_idle()
        iteration_s = statistics.median(self._times[1:] or self._times or [1.0])  # the first includes warm-up
        mine = checkfreq_interval(stats.snapshot_s, stats.persist_s, iteration_s, self.max_overhead)
        self.chosen = max(everyone for (everyone,) in transport.current().all_gather_ints([mine]))
        self.costs = {"snapshot_s": stats.snapshot_s, "persist_s": stats.persist_s, "iteration_s": iteration_s}
        if self.store is not None:  # every rank: a failure right now must not leave the key unwritten
            self.store.set(STORE_KEY, str(self.chosen))
        if self.rank == 0:
            say(
                f"checkfreq: snapshot {stats.snapshot_s * 1e3:.1f} ms, persist {stats.persist_s * 1e3:.1f} ms, "
                f"iteration {iteration_s * 1e3:.1f} ms (rank 0), overhead at most {self.max_overhead:.1%}: "
                f"a checkpoint every {self.chosen} iterations",
                name=__name__,
            )
        return self.chosen
