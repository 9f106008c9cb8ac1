"""Compare-and-swap loops with a retry budget: a counter update that keeps losing ends with an error.

A compare-and-swap (``SignedKV.add``/``advance``, ``EtcdStore.add``) that loses was beaten by a
write in between: among honest clients someone made progress, so a loop terminates, but nothing
bounded how often one client loses (thousands of ranks adding to one counter at once) or a writer
that never stops (a client outside the job rewriting the key on an ``etcd://`` store anyone can
write). Each lost round here backs off (jittered, growing, so that a crowd spreads out), and after
:data:`CAS_ATTEMPTS` rounds or :data:`CAS_BUDGET_S` seconds the update raises
:class:`StoreContention` naming the key, instead of spinning for good.
"""

from __future__ import annotations

import random
import time

__all__ = ["CAS_ATTEMPTS", "CAS_BUDGET_S", "CasBudget", "StoreContention"]

#: lost compare-and-swaps after which an update gives up
CAS_ATTEMPTS = 1000
#: seconds after which an update gives up, however few rounds it lost
CAS_BUDGET_S = 60.0
_FREE_ROUNDS = 3  # retried at once: two or three clients colliding is ordinary
_MAX_BACKOFF_S = 0.5


class StoreContention(RuntimeError):
    """A job-store update lost its compare-and-swap more often, or for longer, than the budget allows."""


class CasBudget:
    """The retry budget of one compare-and-swap update of ``key``."""

    def __init__(self, key: str, attempts: int | None = None, budget_s: float | None = None) -> None:
        self.key = key
        self.attempts = CAS_ATTEMPTS if attempts is None else attempts
        self.budget_s = CAS_BUDGET_S if budget_s is None else budget_s
        self.lost_rounds = 0
        self._t0 = time.monotonic()

    def lost(self) -> None:
        """One more lost round: wait before the next (after the first few), or raise once spent."""
        self.lost_rounds += 1
        waited = time.monotonic() - self._t0
        if self.lost_rounds >= self.attempts or waited >= self.budget_s:
            raise StoreContention(
                f"job store: the update of {self.key!r} lost its compare-and-swap {self.lost_rounds} times in "
                f"{waited:.1f} s (budget: {self.attempts} rounds, {self.budget_s:g} s): another writer keeps changing "
                "it between the read and the write (too many clients updating one counter at once, or a client "
                "outside the job rewriting it: restrict who can write to the store)"
            )
        if self.lost_rounds > _FREE_ROUNDS:
            time.sleep(random.uniform(0.0, min(_MAX_BACKOFF_S, 0.001 * 2 ** (self.lost_rounds - _FREE_ROUNDS))))
