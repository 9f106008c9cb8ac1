"""``buddy.interval: "auto"`` (the default): the iterations between buddy rounds, chosen from the
job's own step time (ds_swift.protect.buddy).

A round costs about the same whatever its interval: a host copy of the partition, a send per buddy,
the job-store round that says it landed everywhere. On the tiny CPU GPT (4 ranks on 2 cores, a
0.7 MB partition, a step of ~90 ms) a round takes ~1.6 ms of the copier thread's CPU and 0.45 ms of
the training thread's per rank, and more in gloo's threads and the job store: over 4 interleaved
rounds (``benchmarks/gpu_overhead.py --tiny --nproc 4 --pp 2 --rounds 4 --breakdown
off,defaults,-buddy,buddy@5``) switching copies off saved 25 CPU ms per iteration of 162, a round
after every 5th step 18. What an interval costs instead is recovery time: a failure takes every
rank back to the newest round and trains the iterations since again.

So "auto" copies after every step for the first :data:`DECIDE_AFTER` rounds of each generation
while the landing's leader (rank 0, ds_swift.protect.buddy_holdings.StoreLanding) measures the step
(from one round's submission to the next) and the round (from its submission to its landing on
every rank); then it picks the smallest interval of the 1-2-5 ladder that

- leaves at least :data:`PERIOD_S` between rounds: at most two rounds a second (rounded up the
  ladder: 0.5 to 1.25 s of training between rounds, the most a failure trains again);
- gives a round twice the time it took: the next step does not wait for it;

and writes it into that round's ``done`` key, which every rank reads before its next step: from the
next iteration on, the same rounds on every rank. A step of 0.5 s or more keeps a round after every
step. With ``verify.digest_interval`` 10 (the default) every ladder interval divides 10 or is a
multiple of it, so a round's iteration is a digest's as often as it can be.
"""

from __future__ import annotations

import math
import statistics

__all__ = ["DECIDE_AFTER", "LADDER", "PERIOD_S", "AutoInterval", "choose_interval", "decision", "decided"]

#: the least time between two rounds
PERIOD_S = 0.5
#: rounds of each generation copied after every step before the interval is chosen
DECIDE_AFTER = 20
#: the first rounds of a generation (start-up, the first steps' allocations) are not measured
_SKIP = 4
#: the intervals "auto" chooses from
LADDER = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def choose_interval(step_s: float, round_s: float, period_s: float = PERIOD_S) -> int:
    """The smallest ladder interval with at least ``period_s`` between rounds and twice ``round_s``
    (a round's time from its submission to its landing everywhere) per round, for a step of ``step_s``."""
    if step_s <= 0:
        return LADDER[-1]
    need = max(1, math.ceil(period_s / step_s - 1e-9), math.ceil(2 * round_s / step_s - 1e-9))
    return next((k for k in LADDER if k >= need), LADDER[-1])


def decision(interval: int) -> str:
    """The ``done`` value that carries the chosen interval to every rank."""
    return f"interval={interval}"


def decided(done_value: str | None) -> int | None:
    """The interval a round's ``done`` value carries, or None (a plain round)."""
    if done_value is None or not done_value.startswith("interval="):
        return None
    try:
        value = int(done_value.split("=", 1)[1])
    except ValueError:
        return None
    return value if value >= 1 else None


class AutoInterval:
    """The leader's measurements in one generation, and its choice at the :data:`DECIDE_AFTER`-th round."""

    def __init__(self) -> None:
        self._submitted: list[tuple[int, float]] = []
        """(iteration, time handed to the copier) of each round, in order."""
        self._landed: list[float] = []
        """Each measured round's time from its submission to its landing everywhere."""
        self.chosen: int | None = None
        self.why = ""

    def before_landing(self, version: int, submitted: float) -> str | None:
        """A round of ``version``, handed over at ``submitted`` (``time.perf_counter``), is about to
        land: the interval to publish with it (:func:`decision`), once, at the :data:`DECIDE_AFTER`-th
        round; else None."""
        if self.chosen is not None:
            return None  # measured once per generation: nothing more is kept (a job may run for weeks)
        self._submitted.append((version, submitted))
        if len(self._submitted) < DECIDE_AFTER:
            return None
        measured = self._submitted[_SKIP:]
        steps = [b[1] - a[1] for a, b in zip(measured, measured[1:], strict=False) if b[0] - a[0] == 1]
        if not steps or not self._landed:
            return None
        step, took = statistics.median(steps), statistics.median(self._landed)
        self.chosen = choose_interval(step, took)
        self.why = (
            f"a step takes {step * 1e3:.1f} ms and a round {took * 1e3:.1f} ms until it has landed everywhere "
            f"(medians of {len(steps)} steps and {len(self._landed)} rounds): at least {PERIOD_S:g} s and twice "
            f"a round's time between rounds"
        )
        return decision(self.chosen)

    def after_landing(self, submitted: float, landed: float) -> None:
        """The round handed over at ``submitted`` landed everywhere at ``landed``."""
        if self.chosen is None and len(self._submitted) > _SKIP:
            self._landed.append(landed - submitted)
